"""``dev_stage``: the device path's staged read. The definition (torch ops, host copies) against what it must do on
fresh random calls over a misaligned home; the Triton kernels against the definition in Triton's interpreter (bit
for bit); the kernels compiled for sm_80 / sm_86 / sm_90; on a GPU, from page-locked host memory."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

from vllm_dsv41.dev_stage import MAX_PICKS, DeviceStaging


class Home:
    """``e`` experts of ``len(nbytes)`` projections in one host buffer at 4 (mod 16) byte addresses (a checkpoint's
    8-byte or worse alignment), a pointer table ``[P, e]`` into it (resident experts: into a "cache" buffer, never
    copied), ``per`` transient slots, 256-byte aligned."""

    def __init__(self, rng: np.random.Generator, e: int, nbytes: list[int], per: int, device: torch.device,
                 pinned: bool = False) -> None:  # fmt: skip
        self.nbytes, self.per, self.e = nbytes, per, e
        total = e * sum(nbytes)
        self.raw = torch.empty(total + 64, dtype=torch.uint8, pin_memory=pinned)
        lead = (4 - self.raw.data_ptr()) % 16
        self.buf = self.raw[lead : lead + total]
        self.buf.numpy()[:] = rng.integers(0, 256, total, dtype=np.uint8)
        base = self.buf.data_ptr()
        assert base % 16 == 4
        self.offs = np.zeros((len(nbytes), e), np.int64)  # projection p of expert x at base + offs[p, x]
        pos = 0
        for x in range(e):
            for p, nb in enumerate(nbytes):
                self.offs[p, x] = pos
                pos += nb
        self.resident = rng.random(e) < 0.3
        self.cache = torch.zeros(256, dtype=torch.uint8, device=device)
        tab = base + self.offs
        tab[:, self.resident] = self.cache.data_ptr()
        self.table = torch.from_numpy(tab).to(device)
        stride = -(-max(nbytes) // 256) * 256 * len(nbytes)
        self.pool = torch.full((per * stride + 256,), 0xAB, dtype=torch.uint8, device=device)
        pbase = -(-self.pool.data_ptr() // 256) * 256
        addr = pbase + np.arange(per)[None, :] * stride + np.arange(len(nbytes))[:, None] * (stride // len(nbytes))
        self.slot_addr = torch.from_numpy(np.ascontiguousarray(addr, dtype=np.int64)).to(device)
        self.pool_lead = pbase - self.pool.data_ptr()
        self.stride = stride

    def expert_bytes(self, x: int, p: int) -> np.ndarray:
        o = int(self.offs[p, x])
        return self.buf.numpy()[o : o + self.nbytes[p]]

    def slot_bytes(self, s: int, p: int) -> np.ndarray:
        a = self.pool_lead + s * self.stride + p * (self.stride // len(self.nbytes))
        return self.pool.cpu().numpy()[a : a + self.nbytes[p]]

    def call(self, rng: np.random.Generator, t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rng.integers(0, self.e, (t, k))
        ids[rng.random((t, k)) < 0.1] = -1
        if t > 2:
            ids[t // 2] = -1  # a padding row
        ids = ids.astype(np.int32)
        hit = (ids >= 0) & self.resident[np.maximum(ids, 0)]
        return torch.from_numpy(ids).to(device), torch.from_numpy(hit).to(device)


def check(home: Home, st: DeviceStaging, ids: torch.Tensor, hit: torch.Tensor) -> int:
    """Plan and copy a call round by round; check each round against what it must do. Returns the rounds."""
    table = home.table
    ids_r = st.plan(ids, hit, table)
    i = ids.cpu().numpy().reshape(-1)
    h = hit.cpu().numpy().reshape(-1)
    rounds = ids_r.shape[0]
    assert rounds == max(1, -(-i.size // home.per)) and ids_r.shape[1:] == ids.shape
    missed = list(dict.fromkeys(int(x) for x in i[(i >= 0) & ~h]))  # in order of first pick
    assert st.rank_expert.cpu().tolist() == missed + [-1] * (MAX_PICKS - len(missed))
    tab = table.cpu().numpy()
    tab_d = st.table_d.cpu().numpy()
    slot_addr = home.slot_addr.cpu().numpy()
    for x in range(home.e):
        want = slot_addr[:, missed.index(x) % home.per] if x in missed else tab[:, x]
        assert np.array_equal(tab_d[:, x], want), x
    seen = np.zeros(i.size, np.int64)
    for r in range(rounds):
        got = ids_r[r].cpu().numpy().reshape(-1)
        mine = got >= 0
        assert np.array_equal(got[mine], i[mine])  # a round's picks are the call's, in place
        seen += mine
        assert r == 0 or not (mine & h).any()  # hits in the first round only
        round_missed = sorted({int(x) for x in got[mine & ~h]})
        assert round_missed == sorted(missed[r * home.per : (r + 1) * home.per])
        st.copy(table, r)
        for x in round_missed:
            for p in range(len(home.nbytes)):
                assert np.array_equal(home.slot_bytes(missed.index(x) % home.per, p), home.expert_bytes(x, p)), (r, x)
    assert np.array_equal(seen, (i >= 0).astype(np.int64))  # every pick in exactly one round
    return rounds


def test_the_definition_stages_every_miss_once_in_rounds_of_the_slots() -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    cpu = torch.device("cpu")
    for e, nbytes, per, shapes in ((384, [192, 36, 20, 64], 16, [(1, 6), (4, 6), (16, 8)]),
                                   (20, [8, 4, 12], 3, [(1, 2), (5, 6), (16, 8)]),
                                   (7, [4], 1, [(1, 1), (3, 4)])):  # fmt: skip
        home = Home(rng, e, nbytes, per, cpu)
        st = DeviceStaging(home.slot_addr, nbytes, e)
        for t, k in shapes:
            for _ in range(3):
                ids, hit = home.call(rng, t, k, cpu)
                check(home, st, ids, hit)
        assert st.bytes_copied > 0


def test_bad_calls_are_refused() -> None:
    rng = np.random.default_rng(1)
    home = Home(rng, 10, [8, 4], 2, torch.device("cpu"))
    st = DeviceStaging(home.slot_addr, [8, 4], 10)
    ids = torch.zeros((MAX_PICKS + 1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="129 picks"):
        st.plan(ids, torch.zeros_like(ids, dtype=torch.bool), home.table)
    with pytest.raises(ValueError, match="pointer table"):
        st.plan(ids[:2], torch.zeros((2, 1), dtype=torch.bool), home.table[:, :5].contiguous())
    with pytest.raises(ValueError, match="table must be contiguous"):
        st.plan(ids[:2], torch.zeros((2, 1), dtype=torch.bool), home.table[:, :5])
    with pytest.raises(ValueError, match="ids must be contiguous torch.int32"):
        st.plan(ids[:2].long(), torch.zeros((2, 1), dtype=torch.bool), home.table)
    with pytest.raises(ValueError, match="hit must be contiguous torch.bool"):
        st.plan(ids[:2], torch.zeros((2, 1), dtype=torch.uint8), home.table)
    with pytest.raises(ValueError, match=r"hit \(3, 1\) for ids \(2, 1\)"):
        st.plan(ids[:2], torch.zeros((3, 1), dtype=torch.bool), home.table)
    with pytest.raises(ValueError, match="3 projections"):
        DeviceStaging(home.slot_addr, [8, 4, 4], 10)
    assert DeviceStaging.supported(8, [8, 4])
    assert not DeviceStaging.supported(2, [8]) and not DeviceStaging.supported(8, [6])


INTERPRETED = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_vllm_dsv41_dev_stage import Home
    from vllm_dsv41.dev_stage import DeviceStaging

    rng = np.random.default_rng(int(os.environ["SEED"]))
    cpu = torch.device("cpu")
    for e, nbytes, per, shapes in ((384, [192, 36, 20], 16, [(1, 6), (4, 6), (16, 8)]),
                                   (20, [40000, 4], 3, [(5, 6), (2, 2)])):  # (40000: a projection of 3 chunks)
        a, b = Home(rng, e, nbytes, per, cpu), Home(rng, e, nbytes, per, cpu)
        b.buf.copy_(a.buf)
        b.resident[:] = a.resident
        b.table = a.table.clone()
        ref = DeviceStaging(a.slot_addr, nbytes, e)
        tri = DeviceStaging(b.slot_addr, nbytes, e, use_triton=True)
        for t, k in shapes:
            ids, hit = a.call(rng, t, k, cpu)
            rr, rt = ref.plan(ids, hit, a.table), tri.plan(ids, hit, b.table)
            assert torch.equal(rr, rt), (t, k)
            assert torch.equal(ref.rank_expert, tri.rank_expert)
            # the tables equal once each slot address is read as its slot index
            sa, sb = a.slot_addr.numpy(), b.slot_addr.numpy()
            da, db = ref.table_d.numpy().copy(), tri.table_d.numpy().copy()
            for p in range(len(nbytes)):
                for s in range(per):
                    da[p][da[p] == sa[p, s]] = -1 - s
                    db[p][db[p] == sb[p, s]] = -1 - s
            assert np.array_equal(da, db), (t, k)
            for r in range(rr.shape[0]):
                ref.copy(a.table, r)
                tri.copy(b.table, r)
                for s in range(per):
                    for p in range(len(nbytes)):
                        assert np.array_equal(a.slot_bytes(s, p), b.slot_bytes(s, p)), (t, k, r, s, p)
            print("ok", e, t, k, rr.shape[0])
    """
)


@pytest.mark.slow
def test_the_kernels_equal_the_definition_in_the_interpreter(interpreted: Callable[[str, int, float], None]) -> None:
    interpreted(INTERPRETED, 5, 900)


IN_THE_RUNTIME = textwrap.dedent(
    """
    import os, sys, tempfile
    from pathlib import Path
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import test_vllm_dsv41_tiered as T
    import vllm_dsv41.tiered as tiered
    from pack_tools.presets.tiny_demo import synth_tiny_demo
    from vllm_dsv41.dev_stage import DeviceStaging
    from vllm_dsv41.home import ExpertHome
    from vllm_dsv41.reference import ReferenceExperts
    from vllm_dsv41.route_prep import prepare_routing

    class Kernels(DeviceStaging):  # what a CUDA device runs, here in the interpreter
        def __init__(self, *a, **kw):
            super().__init__(*a, use_triton=True, **kw)

    tiered.DeviceStaging = Kernels
    tiered.prepare_routing = lambda *a, **kw: prepare_routing(*a, use_triton=True, **kw)
    rng = np.random.default_rng(int(os.environ["SEED"]))
    with tempfile.TemporaryDirectory() as d, ExpertHome(synth_tiny_demo(Path(d) / "tiny-demo")) as home:
        ref = ReferenceExperts()
        for lx in home.layers():
            ref.add_layer(lx.layer, lx.gate, lx.up, lx.down, swiglu_limit=None)
        for slots in (2, 16):  # rounds of 2 slots; one round
            rt = T._wide_runtime(home, split="pcie", pcie_read="auto", pcie_stage_slots=slots)
            try:
                for step in range(4):
                    for layer, x, ids, w, out in T._step(rt, rng, tokens=[1, 3][step % 2], hot=6):
                        want = ref.forward(layer, x, ids, w)
                        np.testing.assert_allclose(out, want, rtol=0, atol=3e-5 * np.abs(want).max())
                s = rt.stats
                assert isinstance(rt._dstage, Kernels) and s.device_steps == 4 and s.pcie_picks > 0, s
            finally:
                rt.close()
            print("ok", slots, s.hit_picks, s.pcie_picks)
    """
)


@pytest.mark.slow
def test_the_runtime_with_the_kernels_in_the_interpreter(interpreted: Callable[[str, int, float], None]) -> None:
    """The tiered runtime's device path on a home its hit kernel cannot read in place, with the kernels (what a GPU
    runs) in the interpreter: exact against the float64 reference, in rounds and in one."""
    interpreted(IN_THE_RUNTIME, 2, 900)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_the_kernels_compile_for_ampere_and_hopper(arch: int) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_dsv41.dev_stage import _BLOCK_E, CHUNK_BYTES, _stage_copy, _stage_plan

    target = GPUTarget("cuda", arch, 32)
    sig = dict(IDS="*i32", HIT="*u8", TABLE="*i64", SLOT_ADDR="*i64", TABLE_D="*i64", IDS_R="*i32",
               RANK_EXPERT="*i32", N="i32", E="i32", PER="i32", R="i32", NRANK="i32", P="constexpr",
               BLOCK_N="constexpr", BLOCK_E="constexpr")  # fmt: skip
    for block_n in (16, MAX_PICKS):  # the smallest and the largest pick block
        consts = dict(P=9, BLOCK_N=block_n, BLOCK_E=_BLOCK_E)
        k = triton.compile(ASTSource(_stage_plan, sig, constexprs=consts), target=target, options=dict(num_warps=8))
        assert k.asm["cubin"], "ptxas built no cubin"
    sig = dict(TABLE="*i64", SLOT_ADDR="*i64", NBYTES="*i64", RANK_EXPERT="*i32", R0="i32", NRANK="i32", E="i32",
               PER="i32", CHUNK="constexpr")  # fmt: skip
    k = triton.compile(ASTSource(_stage_copy, sig, constexprs=dict(CHUNK=CHUNK_BYTES)), target=target,
                       options=dict(num_warps=4))  # fmt: skip
    assert k.asm["cubin"], "ptxas built no cubin"


@pytest.mark.gpu
def test_on_the_gpu_the_kernels_stage_from_page_locked_host_memory() -> None:
    """Device machine (``scripts/gpu_run.sh`` STEPS=tests): the kernels on CUDA, the home in page-locked host memory
    read in place at 4 (mod 16) byte addresses, each round checked as the definition's test does."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    home = Home(rng, 384, [131072, 4096, 2048, 40000], 16, dev, pinned=True)
    st = DeviceStaging(home.slot_addr, home.nbytes, 384)
    assert st.use_triton
    for t, k in ((1, 6), (2, 6), (4, 6), (16, 8)):
        for _ in range(3):
            ids, hit = home.call(rng, t, k, dev)
            check(home, st, ids, hit)
