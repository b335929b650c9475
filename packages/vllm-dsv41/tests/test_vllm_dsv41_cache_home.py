"""The host home as the VRAM expert cache's address-based home: the columns and layer ids, the bytes behind every
pointer of a cache built on it, the same behaviour as a stacked copy, and the refusals."""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

# vllm-dsv41 does not declare expert-cache yet (the tiered runtime that owns the cache adds it): in the member-alone
# environment this module is skipped, in the workspace it runs.
pytest.importorskip("expert_cache", reason="expert-cache is not a dependency of vllm-dsv41 yet")

from expert_cache import ExpertCache, policy_config  # noqa: E402
from vllm_dsv41.home import EXPERT_COLUMNS, CacheHome, ExpertHome, expert_tensor  # noqa: E402


def _name(home: ExpertHome, layer: int, expert: int, column: int) -> str:
    """The checkpoint name of one expert's column tensor."""
    want = (layer, expert, *EXPERT_COLUMNS[column])
    return next(n for n in home.tensor_names() if expert_tensor(n) == want)


def _stacked(home: ExpertHome, ch: CacheHome) -> list[list[torch.Tensor]]:
    """A stacked copy of the same experts: ``[layer][column]`` ``[experts, *shape]`` tensors."""
    return [
        [
            torch.from_numpy(np.stack([home.array(_name(home, lid, e, p)) for e in range(ch.num_experts)]))
            for p in range(len(EXPERT_COLUMNS))
        ]
        for lid in ch.layer_ids
    ]


def _check_pointers(cache: ExpertCache, home: ExpertHome, ch: CacheHome) -> int:
    """Resident experts: each slot pointer reads the home's bytes; the others: the pointer is the home address.
    Returns the number of resident experts."""
    tab = cache.pointer_table.numpy()
    slot_of = cache.slot_of.numpy()
    resident = 0
    for i, lid in enumerate(ch.layer_ids):
        for e in range(ch.num_experts):
            s = int(slot_of[i, e])
            resident += s >= 0
            for p, spec in enumerate(ch.projections):
                name = _name(home, lid, e, p)
                ptr = int(tab[i, p, e])
                if s >= 0:
                    assert cache.pool is not None
                    assert (
                        ptr == cache.pool.data_ptr() + s * cache.config.slot_stride + cache.config.projection_offsets[p]
                    )
                    assert ctypes.string_at(ptr, spec.nbytes) == home.array(name).tobytes(), (name, "slot", s)
                else:
                    assert ptr == home.address(name), (name, "home")
    return resident


def test_cache_home_columns_and_rows(home: ExpertHome) -> None:
    ch = home.cache_home()
    assert ch.layer_ids == home.layer_ids == (0, 1) and ch.num_experts == 8
    assert [s.name for s in ch.projections] == [f"{r}.{p}" for r, p in EXPERT_COLUMNS]
    kern, host = ch.rows.kernel_addresses(), ch.rows.host_addresses()
    assert (kern == host).all()  # not registered: a kernel is given the host address
    for i, lid in enumerate(ch.layer_ids):
        for p, spec in enumerate(ch.projections):
            for e in range(ch.num_experts):
                name = _name(home, lid, e, p)
                arr = home.array(name)
                assert spec.shape == arr.shape and spec.nbytes == arr.nbytes, name
                assert spec.dtype == {"I16": "int16", "F16": "float16"}[home.info(name).dtype], name
                assert int(kern[i, p, e]) == home.address(name), name
                assert ch.rows.host_row(i, e, p, spec.nbytes).numpy().tobytes() == arr.tobytes(), name
    cfg = ch.cache_config(num_slots=3)
    assert (cfg.num_layers, cfg.num_experts, cfg.projections) == (2, 8, ch.projections)


def test_cache_on_the_home_reads_the_right_bytes(home: ExpertHome) -> None:
    """Forced admissions (routing, replans, a release and a re-warm): every resident expert's slot pointers read the
    home's bytes, every other pointer is the home address."""
    ch = home.cache_home()
    cache = ExpertCache(ch.cache_config(num_slots=5, replan_every=1, admit_limit=3), ch.rows, "cpu")
    assert cache.home is ch.rows
    assert _check_pointers(cache, home, ch) == 0

    def step(routes: dict[int, list[list[int]]]) -> None:
        cache.before_step(len(next(iter(routes.values()))))
        for lid, ids in routes.items():
            cache.observe(ch.cache_layer(lid), torch.tensor(ids))
        cache.after_step()

    step({0: [[1, 2]], 1: [[7, 3]]})
    assert set(cache.resident()) == {1, 2, 8 + 3}  # admit_limit 3 of the 4 routed
    assert _check_pointers(cache, home, ch) == 3
    for _ in range(3):
        step({0: [[1, 5], [6, 5]], 1: [[7, 0], [7, 4]]})
    assert len(cache.resident()) == 5 and cache.stats().evicts > 0
    assert _check_pointers(cache, home, ch) == 5
    cache.release()
    assert _check_pointers(cache, home, ch) == 0
    cache.rewarm()
    assert _check_pointers(cache, home, ch) == 5


@pytest.mark.parametrize("policy", ["decayed", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_stacked_and_address_homes_agree(home: ExpertHome, policy: str, seed: int) -> None:
    """Fuzzed routing, replans, releases and re-warms on a cache over the home and one over a stacked copy of the
    same experts: the same residents, slots, counters and slot bytes throughout."""
    ch = home.cache_home()
    cfg = ch.cache_config(
        num_slots=6, replan_every=2, admit_limit=3, policy=policy_config(policy), elastic=True, prefill_tokens=5,
        rewarm_after=2,
    )  # fmt: skip
    a = ExpertCache(cfg, ch.rows, "cpu")
    b = ExpertCache(cfg, _stacked(home, ch), "cpu")
    rng = np.random.default_rng(seed)
    most = 0
    for _ in range(80):
        op = int(rng.integers(10))
        if op < 7:
            tokens = int(rng.choice([1, 2, 3, 8]))
            ids = torch.from_numpy(np.stack([[rng.choice(4 if rng.random() < 0.7 else 8, 2, replace=False)
                                              for _ in range(min(tokens, 3))] for _ in range(2)]))  # fmt: skip
            for c in (a, b):
                c.before_step(tokens)
                c.observe_all(ids)
                c.after_step()
        else:
            for c in (a, b):
                (c.replan, c.release, c.rewarm)[op - 7]()
        assert a.resident() == b.resident() and torch.equal(a.slot_of, b.slot_of)
        most = max(most, _check_pointers(a, home, ch))
        if a.pool is not None and b.pool is not None:
            live = a.slot_of.view(-1)[a.slot_of.view(-1) >= 0].long()
            for o, spec in zip(cfg.projection_offsets, cfg.projections, strict=True):
                assert torch.equal(a.pool[live, o : o + spec.nbytes], b.pool[live, o : o + spec.nbytes])
    assert a.stats() == b.stats()
    assert most == 6 and a.stats().evicts > 0 and a.stats().rewarms > 0


def test_layer_ids_map_to_cache_layers(home: ExpertHome) -> None:
    ch = home.cache_home([1])
    assert ch.layer_ids == (1,) and ch.cache_layer(1) == 0
    with pytest.raises(KeyError, match=r"MoE layer 0 is not in the cache \(layers \[1\]\)"):
        ch.cache_layer(0)
    assert int(ch.rows.kernel_addresses()[0, 0, 3]) == home.address(_name(home, 1, 3, 0))
    rev = home.cache_home([1, 0])
    assert rev.cache_layer(0) == 1
    assert (rev.rows.kernel_addresses()[::-1] == home.cache_home().rows.kernel_addresses()).all()
    with pytest.raises(KeyError, match=r"MoE layer 5 has no routed experts in the pack \(layers \(0, 1\)\)"):
        home.cache_home([0, 5])
    with pytest.raises(ValueError, match=r"layer_ids: \[0, 0\] lists a layer twice"):
        home.cache_home([0, 0])
    with pytest.raises(ValueError, match="layer_ids: no layers given"):
        home.cache_home([])


def _rewrite_header(shard: Path, change: dict[str, dict[str, object]]) -> None:
    """Change header entries of a safetensors file in place (same data, same byte ranges)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name, fields in change.items():
        header[name].update(fields)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = raw[8 + n :]
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    ("tensor", "fields", "msg"),
    [
        ("model.layers.1.mlp.experts.6.up_proj.suh", {"shape": [2, 128]}, r"F16 \[2, 128\] differs from "
         r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.suh's F16 \[256\]; the VRAM cache needs one shape per column "
         r"\(up\.suh\)"),
        ("model.layers.0.mlp.experts.3.down_proj.trellis", {"dtype": "F16"}, r"F16 \[8, 16, 48\] differs from "
         r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.trellis's I16 \[8, 16, 48\]"),
    ],
)  # fmt: skip
def test_refuses_experts_of_different_shapes(demo_pack: Path, tmp_path: Path, tensor: str, fields: dict[str, object],
                                            msg: str) -> None:  # fmt: skip
    bad = tmp_path / "bad"
    shutil.copytree(demo_pack, bad)
    shards = sorted(bad.glob("*.safetensors"))
    shard = next(s for s in shards if tensor.encode() in s.read_bytes()[: 1 << 20])
    _rewrite_header(shard, {tensor: fields})
    with ExpertHome(bad) as h:
        with pytest.raises(ValueError, match=rf"{tensor.replace('.', '[.]')}: {msg}"):
            h.cache_home()
        ok = h.cache_home([1 - int(tensor.split(".")[2])])  # the other layer alone is fine
        assert len(ok.layer_ids) == 1


@pytest.mark.gpu
def test_registered_home_on_cuda(demo_pack: Path) -> None:
    """Registered with CUDA: the table holds GPU-mapped addresses; every pointer, read on the GPU, gives the
    expert's bytes (from the slot when resident, from the mapping otherwise)."""
    from dma_prefill._cudart import CudaArray

    with ExpertHome(demo_pack, register=True) as home:
        ch = home.cache_home()
        assert (ch.rows.kernel_addresses() == np.array([[[home.address(_name(home, lid, e, p), device=True)
                                                          for e in range(8)] for p in range(9)]
                                                        for lid in ch.layer_ids])).all()  # fmt: skip
        cache = ExpertCache(ch.cache_config(num_slots=6, replan_every=1, admit_limit=4), ch.rows, "cuda")
        for ids in ([[1, 2], [3, 2]], [[5, 6], [5, 7]], [[0, 1], [4, 1]]):
            cache.before_step(2)
            cache.observe_all(torch.tensor([ids, ids], device="cuda"))
            cache.after_step()
        cache.synchronize()
        assert len(cache.resident()) == 6
        tab = cache.pointer_table.cpu().numpy()
        for i, lid in enumerate(ch.layer_ids):
            for p, spec in enumerate(ch.projections):
                for e in range(8):
                    name = _name(home, lid, e, p)
                    got = torch.as_tensor(CudaArray(int(tab[i, p, e]), spec.nbytes, cache), device="cuda").cpu()
                    assert got.numpy().tobytes() == home.array(name).tobytes(), (name, int(cache.slot_of[i, e]))
        del cache
        torch.cuda.synchronize()
