"""CUDA tests (run on the GPU machine: scripts/device_run.sh). A Triton kernel reads through the pointer tables,
one contiguous ``[num_experts]`` address array per (layer, projection) as pointer-table MoE kernels take them, so
these check what a real MoE kernel would see, including while swaps are in flight, from pinned stacked homes and
from read-only file mappings registered with CUDA (the served model's home)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from expert_cache import (
    ExpertCache,
    ExpertCacheConfig,
    ExpertRows,
    ProjectionSpec,
    SyntheticTraceConfig,
    generate,
    policy_config,
    simulate,
)

# deselected by -m "not gpu" (CI); skipped per test where someone asks for them without a GPU
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@functools.cache
def _read_through() -> Any:
    """The Triton kernel reading expert ``i`` of one (layer, projection) through ``table``, that contiguous
    ``[num_experts]`` int64 array (built on first use: Triton is there wherever torch has CUDA)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_through(table, out, nbytes, out_stride, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        addr = tl.load(table + i)
        src = addr.to(tl.pointer_type(tl.uint8))
        for off in range(0, nbytes, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < nbytes
            tl.store(out + i * out_stride + o, tl.load(src + o, mask=m), mask=m)

    return read_through


def read_all(cache: ExpertCache, stream: torch.cuda.Stream) -> list[torch.Tensor]:
    """Per projection, uint8 ``[L*E, nbytes]``: the bytes a kernel on ``stream`` reads through the tables now (one
    launch per layer and projection, given ``cache.layer_pointers(layer)[p]``)."""
    cfg = cache.config
    E = cfg.num_experts
    outs = []
    with torch.cuda.stream(stream):
        for p, spec in enumerate(cfg.projection_specs):
            out = torch.full((cfg.num_keys, spec.nbytes), 0xAB, dtype=torch.uint8, device=cache.device)
            for layer in range(cfg.num_layers):
                tab = cache.layer_pointers(layer)[p]
                assert tab.is_contiguous() and tab.shape == (E,)
                _read_through()[(E,)](tab, out[layer * E :], spec.nbytes, spec.nbytes, BLOCK=1024)
            outs.append(out)
    return outs


def expected(home: list[list[torch.Tensor]], cfg: ExpertCacheConfig) -> list[torch.Tensor]:
    return [
        torch.cat([home[layer][p].reshape(cfg.num_experts, -1).view(torch.uint8) for layer in range(cfg.num_layers)])
        for p in range(len(cfg.projection_specs))
    ]


PROJ = (ProjectionSpec("w13", (2, 64, 48), "int16"), ProjectionSpec("w2", (3000,), "uint8"))


@pytest.mark.parametrize("async_fill", [True, False])
@pytest.mark.parametrize("policy", ["decayed", "hybrid", "arc"])
def test_kernel_reads_right_bytes_after_random_operations(make_home, policy: str, async_fill: bool) -> None:
    cfg = ExpertCacheConfig(
        num_layers=3,
        num_experts=16,
        projections=PROJ,
        num_slots=9,
        replan_every=2,
        admit_limit=4,
        policy=policy_config(policy),
        elastic=True,
        prefill_tokens=6,
        rewarm_after=2,
        async_fill=async_fill,
    )
    home = make_home(cfg, 1, pin=True)
    cache = ExpertCache(cfg, home, "cuda")
    want = [w.cuda() for w in expected(home, cfg)]
    stream = cache._compute
    rng = np.random.default_rng(0)
    checks = []
    for _ in range(80):
        op = rng.integers(10)
        if op < 7:
            tokens = int(rng.choice([1, 2, 9])) if rng.random() < 0.9 else 20
            cache.before_step(tokens)
            for layer in range(3):
                ids = np.stack(
                    [rng.choice(5 if rng.random() < 0.7 else 16, 2, replace=False) for _ in range(min(tokens, 4))]
                )
                cache.observe(layer, torch.from_numpy(ids).cuda())
            cache.after_step()
        elif op == 7:
            cache.replan()
        elif op == 8:
            cache.release()
        else:
            cache.rewarm()
        checks.append(read_all(cache, stream))  # no synchronize: reads are ordered only by the compute stream
    torch.cuda.synchronize()
    for i, outs in enumerate(checks):
        for p, (got, w) in enumerate(zip(outs, want, strict=True)):
            bad = (got != w).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"after op {i}: projection {p} keys {bad} read wrong bytes"
    cache.synchronize()
    st = cache.stats()
    assert st.admits > 0 and st.evicts > 0 and st.releases > 0
    assert (cache.slot_of >= 0).sum().item() == len(cache.resident())


def _race_setup(make_home, async_fill: bool):
    """One slot holding expert 0; ``async_observe`` so that a replan never waits for the compute stream (with a
    synchronous drain the wait itself would order everything and hide a missing event)."""
    cfg = ExpertCacheConfig(
        num_layers=1,
        num_experts=4,
        projections=(ProjectionSpec("w", (4 << 20,), "uint8"),),
        num_slots=1,
        replan_every=1024,
        admit_limit=1,
        async_fill=async_fill,
        async_observe=True,
    )
    home = make_home(cfg, 2, pin=True)
    cache = ExpertCache(cfg, home, "cuda")
    cache.before_step(1)
    cache.observe(0, torch.tensor([[0]], device="cuda"))
    cache.after_step()
    cache.replan()  # snapshot held
    cache.replan()  # planned with it
    cache.synchronize()
    assert cache.resident() == {0: 0}
    return cfg, home, cache


def _route_to_expert_1(cache: ExpertCache) -> None:
    """Five tokens route expert 1; one replan snapshots that, so the next replan (score 5 against expert 0's
    0.81) moves expert 1 into slot 0."""
    cache.before_step(5)
    cache.observe(0, torch.ones((5, 1), dtype=torch.int64, device="cuda"))
    cache.after_step()
    assert cache.replan() == []
    torch.cuda.synchronize()


@pytest.mark.parametrize("broken", [False, True])
def test_stale_pointer_is_slower_never_wrong(make_home, monkeypatch, broken: bool) -> None:
    """A kernel queued before a swap reads the victim through its old slot pointer while the compute stream is
    held back; the newcomer's fill must wait for it. ``broken`` removes the stream waits: the same check must
    then see the newcomer's bytes (so the check can fail)."""
    cfg, home, cache = _race_setup(make_home, async_fill=True)
    stream = cache._compute
    _route_to_expert_1(cache)
    if broken:
        monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, ev: None)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the reader runs
    early = read_all(cache, stream)[0]  # reads expert 0 from slot 0 (pointer not yet repointed)
    cache.replan()  # victim 0 -> home, expert 1 filled into slot 0
    assert cache.resident() == {1: 0}
    torch.cuda.synchronize()
    monkeypatch.undo()
    cache.synchronize()
    w0 = home[0][0][0].view(-1).cuda()
    ok = bool(torch.equal(early[0], w0))
    assert ok != broken, "the reader saw the newcomer's bytes" if not broken else "the race did not show without waits"
    after = read_all(cache, stream)[0]
    torch.cuda.synchronize()
    assert torch.equal(after[1], home[0][0][1].view(-1).cuda()) and cache.slot_of[0, 1].item() == 0


@pytest.mark.parametrize("broken", [False, True])
def test_newcomer_pointer_waits_for_its_fill(make_home, monkeypatch, broken: bool) -> None:
    """Synchronous activation: the side stream is held back, so the fill lands late; a kernel right after the
    replan must still read the newcomer's bytes (the compute stream waits for the fill)."""
    cfg, home, cache = _race_setup(make_home, async_fill=False)
    stream = cache._compute
    _route_to_expert_1(cache)
    if broken:
        monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, ev: None)
    with torch.cuda.stream(cache._side):
        torch.cuda._sleep(200_000_000)
    cache.replan()
    got = read_all(cache, stream)[0]
    torch.cuda.synchronize()
    monkeypatch.undo()
    ok = bool(torch.equal(got[1], home[0][0][1].view(-1).cuda()))
    assert ok != broken


def test_observe_and_decode_steps_never_sync(make_home) -> None:
    cfg = ExpertCacheConfig(num_layers=4, num_experts=32, slot_bytes=4096, num_slots=20, replan_every=8)
    cache = ExpertCache(cfg, make_home(cfg, pin=True), "cuda")
    ids = torch.stack([torch.randperm(32, device="cuda")[:6] for _ in range(4)])
    torch.cuda.synchronize()
    for _ in range(7):  # steps 1..7: no replan due
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "prototype feature" notice
            torch.cuda.set_sync_debug_mode("error")
        try:
            cache.before_step(4)
            for layer in range(4):
                cache.observe(layer, ids)
            cache.after_step()
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:  # the check is live: a host read of a device value raises
        with pytest.raises(RuntimeError, match="synchroniz"):
            cache.slot_of.sum().item()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("default")
    assert cache.stats().picks == 7 * 4 * 24


@pytest.mark.parametrize("policy", ["decayed", "hybrid"])
def test_replans_never_sync_with_async_observe(make_home, policy: str) -> None:
    """Replans off the critical path: with ``async_observe`` (and ``async_fill``) a replan, its admissions and
    evictions (table writes on the compute stream, fills on the side stream) and the activation of finished fills
    never make the host wait for the device, step after step."""
    cfg = ExpertCacheConfig(
        num_layers=4,
        num_experts=32,
        slot_bytes=1 << 16,
        num_slots=20,
        replan_every=1,
        admit_limit=4,
        policy=policy_config(policy),
        async_observe=True,
    )
    cache = ExpertCache(cfg, make_home(cfg, pin=True), "cuda")
    rng = np.random.default_rng(2)
    steps = [torch.from_numpy(rng.integers(0, 32, (4, 2, 6))).cuda() for _ in range(40)]
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in steps:
            cache.before_step(2)
            cache.observe_all(ids)
            cache.after_step()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("default")
    cache.synchronize()
    st = cache.stats()
    assert st.replans == 40 and st.admits >= 20 and st.evicts > 0, st


def test_observe_in_a_cuda_graph(make_home) -> None:
    """A decode step's observe calls captured once and replayed give the same counters and residents as eager
    calls with the same ids."""
    cfg = ExpertCacheConfig(num_layers=2, num_experts=16, slot_bytes=512, num_slots=6, replan_every=4)
    side = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    steps = [torch.from_numpy(np.stack([rng.choice(16, 3, replace=False) for _ in range(2)])).cuda() for _ in range(12)]
    with torch.cuda.stream(side):
        graphed = ExpertCache(cfg, make_home(cfg, pin=True), "cuda", compute_stream=side)
        eager = ExpertCache(cfg, make_home(cfg, pin=True), "cuda", compute_stream=side)
        static = steps[0].clone()
        graphed.before_step(2)
        for layer in range(2):
            graphed.observe(layer, static)  # eager warm-up = step 0
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for layer in range(2):
                graphed.observe(layer, static)
        graphed.after_step()
        for i, ids in enumerate(steps):
            if i:
                static.copy_(ids)
                graphed.before_step(2)
                g.replay()
                graphed.after_step()
            eager.before_step(2)
            for layer in range(2):
                eager.observe(layer, ids)
            eager.after_step()
    torch.cuda.synchronize()
    a, b = graphed.stats(), eager.stats()
    assert a == b and a.replans == 3 and a.hits > 0
    assert graphed.resident() == eager.resident()
    assert torch.equal(graphed.slot_of, eager.slot_of)


def test_gpu_cache_matches_the_simulator(make_home) -> None:
    tr = generate(
        SyntheticTraceConfig(
            num_layers=3,
            num_experts=16,
            top_k=2,
            decode_steps=120,
            streams=2,
            mean_decode_tokens=40,
            mean_prompt_tokens=30,
            prefill_rows=5,
            seed=4,
        )
    )
    cfg = ExpertCacheConfig(
        num_layers=3,
        num_experts=16,
        slot_bytes=256,
        num_slots=10,
        prefill_tokens=8,
        replan_every=3,
        admit_limit=4,
        elastic=True,
        rewarm_after=2,
        async_fill=False,
    )
    cache = ExpertCache(cfg, make_home(cfg, pin=True), "cuda")
    off = 0
    for s in range(tr.num_steps):
        r = int(tr.rows_per_step[s])
        ids = torch.from_numpy(tr.ids[off : off + r].astype(np.int64)).cuda()
        off += r
        cache.before_step(int(tr.tokens_per_step[s]))
        for layer in range(3):
            if r:
                cache.observe(layer, ids[:, layer, :])
        cache.after_step()
    assert cache.stats() == simulate(tr, cfg)


def test_home_must_be_pinned_on_cuda(make_home) -> None:
    cfg = ExpertCacheConfig(num_layers=1, num_experts=4, slot_bytes=64, num_slots=2)
    with pytest.raises(ValueError, match=r"home\[0\]\[0\] \(weights\): must be page-locked"):
        ExpertCache(cfg, make_home(cfg), "cuda")


# ------------------------------------------------------------------- the served model's home: registered mappings

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_READ_ONLY = 8  # cudaHostRegisterReadOnly


class MappedRows:
    """``rows``' buffers written to a file (each at a page boundary + its own misalignment), the file mapped
    read-only (``MAP_SHARED``, ``PROT_READ``), optionally registered with CUDA (read-only, mapped, portable) through
    dma-prefill's ``_cudart`` like vllm-dsv41's ``ExpertHome``; ``self.rows`` addresses the mapping."""

    def __init__(self, rows: ExpertRows, path: Path, register: bool) -> None:
        from dma_prefill import _cudart

        self._cudart = _cudart
        page = mmap.PAGESIZE
        starts, pos = [], 0
        with open(path, "wb") as f:
            for t in rows.buffers:
                lead = t.data_ptr() % page  # keep the buffer's misalignment
                pos += -pos % page + lead
                starts.append(pos)
                f.seek(pos)
                f.write(t.numpy().tobytes())
                pos += t.numel()
            f.write(b"\0" * 16)
        self.length = pos + -pos % page
        fd = os.open(path, os.O_RDONLY)
        try:
            base = _libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        assert base not in (None, ctypes.c_void_p(-1).value), f"mmap failed: errno {ctypes.get_errno()}"
        self.base: int = base
        self.registered = False
        dev = base
        if register:
            flags = _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED | _READ_ONLY
            _cudart.host_register(base, self.length, flags)
            self.registered = True
            dev, _ = _cudart.device_pointer(base)
        views = tuple(
            torch.frombuffer((ctypes.c_uint8 * t.numel()).from_address(base + s), dtype=torch.uint8)
            for t, s in zip(rows.buffers, starts, strict=True)
        )
        self.rows = ExpertRows(views, rows.buffer, rows.offset, tuple(dev + s for s in starts), self)

    def close(self) -> None:
        if self.registered:
            self._cudart.host_unregister(self.base)
            self.registered = False
        if self.base:
            _libc.munmap(self.base, self.length)
            self.base = 0


@pytest.mark.parametrize("async_fill", [True, False])
@pytest.mark.parametrize("policy", ["decayed", "hybrid"])
def test_kernel_reads_right_bytes_from_a_registered_mapping(
    make_home, make_rows, tmp_path: Path, policy: str, async_fill: bool
) -> None:
    """The address home as the served model has it: rows scattered in a read-only file mapping, CUDA-registered,
    the table holding GPU-mapped addresses. A kernel reads every expert right (from the mapping when not resident,
    from the slot when resident) after every operation, with fills copying from the mapping."""
    cfg = ExpertCacheConfig(
        num_layers=3,
        num_experts=16,
        projections=PROJ,
        num_slots=9,
        replan_every=2,
        admit_limit=4,
        policy=policy_config(policy),
        elastic=True,
        prefill_tokens=6,
        rewarm_after=2,
        async_fill=async_fill,
    )
    home = make_home(cfg, 3)
    mapped = MappedRows(make_rows(cfg, home, 3), tmp_path / "rows.bin", register=True)
    try:
        cache = ExpertCache(cfg, mapped.rows, "cuda")
        assert (cache.pointer_table.cpu().numpy() == mapped.rows.kernel_addresses()).all()
        want = [w.cuda() for w in expected(home, cfg)]
        rng = np.random.default_rng(1)
        checks = []
        for _ in range(60):
            op = rng.integers(10)
            if op < 7:
                tokens = int(rng.choice([1, 2, 9])) if rng.random() < 0.9 else 20
                cache.before_step(tokens)
                for layer in range(3):
                    ids = np.stack(
                        [rng.choice(5 if rng.random() < 0.7 else 16, 2, replace=False) for _ in range(min(tokens, 4))]
                    )
                    cache.observe(layer, torch.from_numpy(ids).cuda())
                cache.after_step()
            else:
                (cache.replan, cache.release, cache.rewarm)[op - 7]()
            checks.append(read_all(cache, cache._compute))
        torch.cuda.synchronize()
        for i, outs in enumerate(checks):
            for p, (got, w) in enumerate(zip(outs, want, strict=True)):
                bad = (got != w).any(dim=1).nonzero().flatten().tolist()
                assert not bad, f"after op {i}: projection {p} keys {bad} read wrong bytes"
        cache.synchronize()
        st = cache.stats()
        assert st.admits > 0 and st.evicts > 0 and st.releases > 0
        del cache
        torch.cuda.synchronize()
    finally:
        mapped.close()


def test_unregistered_mapping_is_refused(make_home, make_rows, tmp_path: Path) -> None:
    """A file mapping the GPU cannot read (not registered) is refused, naming the buffer; registered, accepted."""
    cfg = ExpertCacheConfig(num_layers=2, num_experts=8, projections=PROJ, num_slots=3)
    rows = make_rows(cfg, make_home(cfg))
    plain = MappedRows(rows, tmp_path / "plain.bin", register=False)
    try:
        with pytest.raises(ValueError, match=r"rows\.buffers\[0\]: must be page-locked"):
            ExpertCache(cfg, plain.rows, "cuda")
    finally:
        plain.close()
    pinned = MappedRows(rows, tmp_path / "pinned.bin", register=True)
    try:
        assert all(t.is_pinned() for t in pinned.rows.buffers)
        assert ExpertCache(cfg, pinned.rows, "cuda").num_slots == 3
    finally:
        pinned.close()
