"""The address-based home (ExpertRows): the same cache behaviour as the stacked home, kernel addresses apart from
host addresses, and every validation error names the buffer or (layer, expert, projection) at fault."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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

PROJ = (
    ProjectionSpec("trellis", (2, 3, 8), "int16"),
    ProjectionSpec("suh", (5,), "float16"),
    ProjectionSpec("scale", (3,), "float32"),
    ProjectionSpec("flag", (1,), "uint8"),
)


def cfg_of(**kw: object) -> ExpertCacheConfig:
    base: dict[str, object] = dict(
        num_layers=3, num_experts=10, projections=PROJ, num_slots=7, replan_every=2, admit_limit=3
    )
    base.update(kw)
    return ExpertCacheConfig(**base)  # type: ignore[arg-type]


def _random_ops(
    caches: list[ExpertCache], rng: np.random.Generator, n: int, after: Callable[[], None] | None = None
) -> None:
    """The same random steps, observations, replans, releases and re-warms on every cache."""
    cfg = caches[0].config
    for _ in range(n):
        op = int(rng.integers(10))
        if op < 7:
            tokens = int(rng.choice([1, 2, 3, 9])) if rng.random() < 0.9 else 20
            ids = [
                torch.from_numpy(
                    np.stack(
                        [rng.choice(5 if rng.random() < 0.7 else cfg.num_experts, 2, replace=False) for _ in range(4)]
                    )[: min(tokens, 4)]
                )
                for _ in range(cfg.num_layers)
            ]
            for c in caches:
                c.before_step(tokens)
                for layer in range(cfg.num_layers):
                    c.observe(layer, ids[layer])
                c.after_step()
        else:
            for c in caches:
                (c.replan, c.release, c.rewarm)[op - 7]()
        if after is not None:
            after()


@pytest.mark.parametrize("policy", ["decayed", "lfu", "arc", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_home_behaves_like_stacked_home(make_home, make_rows, check_tables, policy: str, seed: int) -> None:
    """Fuzzed operation sequences on two caches, one per form of the same bytes: the same residents, slots and
    counters after every operation; every pointer reads the right bytes; the slots hold the same bytes; non-resident
    pointers are the rows' addresses."""
    cfg = cfg_of(
        policy=policy_config(policy), elastic=True, prefill_tokens=6, rewarm_after=2, observe_prefill=bool(seed % 2)
    )
    home = make_home(cfg, seed)
    rows = make_rows(cfg, home, seed)
    a = ExpertCache(cfg, home)
    b = ExpertCache(cfg, rows)
    kern = rows.kernel_addresses()
    assert b.home is rows and (np.diff(kern[0, 0]) != PROJ[0].nbytes).any(), "the rows are not scattered"
    filled = []

    def compare() -> None:
        assert a.resident() == b.resident()
        assert torch.equal(a.slot_of, b.slot_of)
        check_tables(a, home)
        filled.append(check_tables(b, home))
        tb, so = b.pointer_table.numpy(), b.slot_of.numpy()
        away = np.broadcast_to((so < 0)[:, None, :], tb.shape)
        assert (tb[away] == kern[away]).all()
        if a.pool is not None:
            assert b.pool is not None
            live = torch.from_numpy(so.reshape(-1)[so.reshape(-1) >= 0]).long()
            for o, spec in zip(cfg.projection_offsets, PROJ, strict=True):  # the columns (padding is never written)
                assert torch.equal(a.pool[live, o : o + spec.nbytes], b.pool[live, o : o + spec.nbytes])

    _random_ops([a, b], np.random.default_rng(seed), 100, compare)
    assert a.stats() == b.stats()
    assert max(filled) == cfg.num_slots and a.stats().evicts > 0 and a.stats().rewarms > 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(policy=policy_config("decayed"), elastic=True, rewarm_after=3),
        dict(policy=policy_config("hybrid"), replan_every=1, admit_limit=2, elastic=True, observe_prefill=True),
    ],
)
def test_rows_home_matches_the_simulator(make_home, make_rows, kw: dict[str, object]) -> None:
    tr = generate(
        SyntheticTraceConfig(
            num_layers=3, num_experts=10, top_k=2, decode_steps=120, streams=2, mean_decode_tokens=30,
            mean_prompt_tokens=30, prefill_rows=5, seed=5,
        )
    )  # fmt: skip
    cfg = cfg_of(**{"prefill_tokens": 8, "replan_every": 3, **kw})
    cache = ExpertCache(cfg, make_rows(cfg, make_home(cfg, 3), 3))
    off = 0
    for s in range(tr.num_steps):
        r = int(tr.rows_per_step[s])
        cache.before_step(int(tr.tokens_per_step[s]))
        if r:
            cache.observe_all(torch.from_numpy(tr.ids[off : off + r].astype(np.int64)).permute(1, 0, 2).contiguous())
        off += r
        cache.after_step()
    want = simulate(tr, cfg)
    assert cache.stats() == want and want.hits > 0 and want.admits > 0


def test_kernel_addresses_apart_from_host_addresses(make_home, make_rows) -> None:
    """A CUDA-registered mapping's GPU address differs from its host address: the table holds the kernel address
    of a non-resident row, the fill copies from the host view."""
    cfg = cfg_of(replan_every=1, admit_limit=4)
    home = make_home(cfg, 7)
    host = make_rows(cfg, home, 7)
    shift = 1 << 44
    rows = dataclasses.replace(host, kernel_bases=tuple(t.data_ptr() + shift for t in host.buffers))
    cache = ExpertCache(cfg, rows)
    assert (cache.pointer_table.numpy() == host.host_addresses() + shift).all()
    assert cache.home_pointer(2, 5, 1) == int(host.host_addresses()[2, 1, 5]) + shift
    cache.before_step(2)
    cache.observe(1, torch.tensor([[3, 4], [3, 9]]))
    cache.after_step()
    assert set(cache.resident()) == {13, 14, 19}
    tb = cache.pointer_table.numpy()
    pool = cache.pool
    assert pool is not None
    for key, slot in cache.resident().items():
        layer, e = divmod(key, cfg.num_experts)
        for p, spec in enumerate(PROJ):
            assert tb[layer, p, e] == pool.data_ptr() + slot * cfg.slot_stride + cfg.projection_offsets[p]
            got = pool[slot, cfg.projection_offsets[p] : cfg.projection_offsets[p] + spec.nbytes]
            assert torch.equal(got, home[layer][p][e].reshape(-1).view(torch.uint8)), (layer, e, spec.name)
    cache.release()
    assert (cache.pointer_table.numpy() == host.host_addresses() + shift).all()  # all home again: kernel addresses


@pytest.mark.parametrize("alignment", [128, 256, 4096])
def test_slot_pool_and_copy_expert(make_home, make_rows, alignment: int) -> None:
    """The one slot allocator is aligned for any slot_alignment, and ``copy_expert`` fills one slot with every
    projection of one expert at its offset, leaving the padding between columns untouched."""
    from expert_cache import slot_pool

    cfg = cfg_of(slot_alignment=alignment)
    home = make_home(cfg, 3)
    rows = make_rows(cfg, home, 3)
    pool = slot_pool(cfg, 4, "cpu")
    assert pool.shape == (4, cfg.slot_stride) and pool.dtype == torch.uint8
    assert pool.data_ptr() % alignment == 0 and cfg.slot_stride % alignment == 0
    pool.fill_(0xEE)
    assert rows.copy_expert(pool[2], 1, 7, cfg, non_blocking=False) == sum(s.nbytes for s in PROJ)
    assert (pool[[0, 1, 3]] == 0xEE).all()
    used = torch.zeros(cfg.slot_stride, dtype=torch.bool)
    for p, spec in enumerate(PROJ):
        o = cfg.projection_offsets[p]
        assert torch.equal(pool[2, o : o + spec.nbytes], home[1][p][7].reshape(-1).view(torch.uint8)), spec.name
        used[o : o + spec.nbytes] = True
    assert (pool[2][~used] == 0xEE).all()


def test_home_alignment(make_home) -> None:
    """The widest load a kernel may issue on a home pointer: the largest power of two dividing all of them."""
    cfg = cfg_of()
    L, E, P = cfg.num_layers, cfg.num_experts, len(PROJ)
    raw = torch.zeros(1 << 16, dtype=torch.uint8)
    base = raw[-raw.data_ptr() % 4096 :]  # 4096-aligned
    off = (np.arange(L * P * E, dtype=np.int64) * 128).reshape(L, P, E)
    rows = ExpertRows((base,), np.zeros((L, P, E), np.int32), off)
    assert ExpertCache(cfg, rows).home_alignment == 128
    off = off.copy()
    off[1, 2, 3] += 16
    assert ExpertCache(cfg, dataclasses.replace(rows, offset=off)).home_alignment == 16
    aligned = dataclasses.replace(rows, offset=(np.arange(L * P * E) * 8192).reshape(L, P, E))
    big = torch.zeros(L * P * E * 8192 + 4096, dtype=torch.uint8)
    aligned = dataclasses.replace(aligned, buffers=(big[-big.data_ptr() % 4096 :],))
    assert ExpertCache(cfg, aligned).home_alignment == 4096  # capped at a page
    assert ExpertCache(cfg, make_home(cfg)).home_alignment == 1  # stacked 1-byte "flag" rows: consecutive bytes


def test_rows_validation_names_the_row(make_home, make_rows) -> None:
    cfg = cfg_of()
    rows = make_rows(cfg, make_home(cfg))
    L, E, P = cfg.num_layers, cfg.num_experts, len(PROJ)

    def fails(exc: type[Exception], msg: str, **change: object) -> None:
        with pytest.raises(exc, match=msg):
            ExpertCache(cfg, dataclasses.replace(rows, **change))

    fails(TypeError, r"rows\.buffers: must be a non-empty tuple", buffers=())
    fails(TypeError, r"rows\.buffers: must be a non-empty tuple", buffers=list(rows.buffers))
    fails(TypeError, r"rows\.buffers\[1\]: must be a torch\.Tensor", buffers=(rows.buffers[0], b"x", rows.buffers[2]))
    fails(ValueError, r"rows\.buffers\[0\]: must be a 1-D contiguous uint8 tensor, got torch\.int16",
          buffers=(rows.buffers[0].view(torch.int16) if rows.buffers[0].numel() % 2 == 0 else
                   rows.buffers[0][:-1].view(torch.int16), *rows.buffers[1:]))  # fmt: skip
    fails(ValueError, r"rows\.kernel_bases: one address per buffer \(3\) or none, got 1", kernel_bases=(4096,))
    fails(ValueError, r"rows\.names: one name per buffer \(3\) or none, got 2", names=("a", "b"))
    two_d = (rows.buffers[0], rows.buffers[1][None], rows.buffers[2])
    fails(ValueError, r"shard b: must be a 1-D contiguous uint8 tensor", buffers=two_d, names=("a", "shard b", "c"))
    fails(ValueError, r"rows\.offset: shape must be \[num_layers, projections, experts\] = \(3, 4, 10\)",
          offset=rows.offset.transpose(0, 2, 1))  # fmt: skip
    fails(TypeError, r"rows\.buffer: must be an integer numpy array", buffer=rows.buffer.astype(np.float64))
    bad = rows.buffer.copy()
    bad[2, 1, 7] = 3
    fails(ValueError, r"rows\[layer 2, expert 7, projection suh\]: buffer index 3 is not in \[0, 3\)", buffer=bad)
    bad = rows.offset.copy()
    b = int(rows.buffer[1, 0, 4])
    bad[1, 0, 4] = rows.buffers[b].numel() - 10
    fails(ValueError, rf"rows\[layer 1, expert 4, projection trellis\]: bytes \[\d+, \d+\) are not inside buffer "
          rf"{b} of \d+ bytes", offset=bad)  # fmt: skip
    bad = rows.offset.copy()
    bad[0, 2, 9] = -4
    fails(ValueError, r"rows\[layer 0, expert 9, projection scale\]: bytes \[-4, 8\) are not inside", offset=bad)
    bad = rows.offset.copy()
    layer, e = (int(x) for x in np.argwhere(bad[:, 2, :] >= 4)[0])
    bad[layer, 2, e] -= 2
    fails(ValueError, rf"rows\[layer {layer}, expert {e}, projection scale\]: host address 0x[0-9a-f]+ is not a "
          r"multiple of the item size", offset=bad)  # fmt: skip
    fails(ValueError, r"rows\[layer 0, expert \d+, projection (trellis|suh|scale)\]: kernel address 0x[0-9a-f]+ is not "
          r"a multiple", kernel_bases=tuple(t.data_ptr() + 1 for t in rows.buffers))  # fmt: skip
    assert (L, P, E) == rows.offset.shape


def test_stacked_home_errors_unchanged(make_home) -> None:
    """The stacked form keeps its own messages (``home[layer][p] (name): ...``)."""
    cfg = cfg_of()
    home = make_home(cfg)
    bad = [list(r) for r in home]
    bad[1][3] = bad[1][3].to(torch.int8)
    with pytest.raises(ValueError, match=r"home\[1\]\[3\] \(flag\): dtype must be uint8"):
        ExpertCache(cfg, bad)
    bad = [list(r) for r in home]
    bad[2][0] = "not a tensor"  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"home\[2\]\[0\] \(trellis\): must be a torch\.Tensor"):
        ExpertCache(cfg, bad)
    # checks made on the rows (pinning, on a CUDA cache) name the stacked tensor too (home[l][p], p-major per layer);
    # the CPU check is the CUDA one minus the pinning, so call it with cuda=True here (these tensors are not pinned)
    rows = ExpertRows.from_stacked(home, cfg)
    assert rows.names[len(PROJ) + 2] == "home[1][2] (scale)"
    with pytest.raises(ValueError, match=r"home\[0\]\[0\] \(trellis\): must be page-locked"):
        rows.check(cfg, cuda=True)
