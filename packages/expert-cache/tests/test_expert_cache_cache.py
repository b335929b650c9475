"""ExpertCache on CPU tensors: pointer tables always read the right expert, the elastic cycle, stats, errors."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from expert_cache import (
    ArcConfig,
    DecayedConfig,
    ExpertCache,
    ExpertCacheConfig,
    HybridConfig,
    LfuConfig,
    LruConfig,
    ProjectionSpec,
    SyntheticTraceConfig,
    generate,
    policy_config,
    simulate,
)
from expert_cache.trace import Trace

PROJ = (
    ProjectionSpec("w13", (2, 3, 5), "int16"),
    ProjectionSpec("w2", (7,), "float32"),
    ProjectionSpec("s", (3,), "uint8"),
)


def small_cfg(**kw: object) -> ExpertCacheConfig:
    base: dict[str, object] = dict(
        num_layers=3, num_experts=8, projections=PROJ, num_slots=5, replan_every=2, admit_limit=3
    )
    base.update(kw)
    return ExpertCacheConfig(**base)  # type: ignore[arg-type]


def test_geometry_and_initial_tables(make_home, check_tables) -> None:
    cfg = small_cfg(slot_alignment=128)
    assert cfg.projection_offsets == (0, 128, 256)
    assert cfg.slot_stride == 384 and cfg.expert_bytes == 60 + 28 + 3
    home = make_home(cfg)
    cache = ExpertCache(cfg, home)
    assert cache.pointer_table.shape == (3, 3, 8) and cache.pointer_table.dtype == torch.int64
    assert cache.slot_of.shape == (3, 8) and cache.slot_of.dtype == torch.int32
    assert cache.pool is not None and tuple(cache.pool.shape) == (5, 384)
    assert cache.pool.data_ptr() % 128 == 0 and cache.pool.is_contiguous()
    assert check_tables(cache, home) == 0
    # Projection-major: one contiguous [E] address array per (layer, projection), what pointer-table kernels take.
    lp = cache.layer_pointers(1)
    assert lp.shape == (3, 8) and lp.is_contiguous() and lp[2].is_contiguous()
    assert lp.data_ptr() == cache.pointer_table.data_ptr() + 1 * 3 * 8 * 8  # a view, not a copy
    for p, spec in enumerate(PROJ):
        want = home[1][p].data_ptr() + np.arange(8) * spec.nbytes  # stacked home: consecutive rows
        assert lp[p].tolist() == want.tolist()


def test_check_tables_detects_corruption(make_home, check_tables) -> None:
    """The verifier used everywhere below can fail: corrupt a filled slot and a pointer."""
    cfg = small_cfg()
    home = make_home(cfg)
    cache = ExpertCache(cfg, home)
    cache.before_step(1)
    cache.observe(0, torch.tensor([[1, 2]]))
    cache.after_step()
    cache.replan()
    assert check_tables(cache, home) == 2
    slot = cache.resident()[1]
    cache.pool[slot, 0] ^= 0xFF  # type: ignore[index]
    with pytest.raises(AssertionError, match="wrong bytes"):
        check_tables(cache, home)
    cache.pool[slot, 0] ^= 0xFF  # type: ignore[index]
    check_tables(cache, home)
    cache.pointer_table[2, 1, 3] = cache.pointer_table[2, 1, 4]
    with pytest.raises(AssertionError, match=r"ptr\[2,3,w2\]"):
        check_tables(cache, home)


@pytest.mark.parametrize("policy", ["decayed", "lru", "lfu", "arc", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tables_right_after_random_operations(make_home, check_tables, policy: str, seed: int) -> None:
    """Random steps, observations, manual replans, releases and re-warms: after each, every pointer reads the
    right bytes and slot_of / pointers / planner agree."""
    rng = np.random.default_rng(seed)
    cfg = small_cfg(
        policy=policy_config(policy),
        elastic=True,
        prefill_tokens=6,
        rewarm_after=2,
        replan_every=3,
        observe_prefill=bool(seed),
    )
    home = make_home(cfg, seed)
    cache = ExpertCache(cfg, home)
    seen_res = set()
    for _ in range(120):
        op = rng.integers(10)
        if op < 7:
            tokens = int(rng.choice([1, 2, 3, 9])) if rng.random() < 0.9 else 20
            cache.before_step(tokens)
            for layer in range(cfg.num_layers):
                t = min(tokens, 4)
                hot = rng.random() < 0.7
                ids = np.stack([rng.choice(4 if hot else 8, size=2, replace=False) for _ in range(t)])
                cache.observe(layer, torch.from_numpy(ids).to(torch.int32))
            cache.after_step()
        elif op == 7:
            cache.replan()
        elif op == 8:
            cache.release()
            assert cache.pool is None and cache.released
        else:
            cache.rewarm()
        n = check_tables(cache, home)
        seen_res.add(n)
    assert max(seen_res) == cfg.num_slots, "the pool never filled up: the sequence did not exercise eviction"
    st = cache.stats()
    assert st.evicts > 0 and st.releases > 0 and st.rewarms > 0


def test_elastic_cycle(make_home, check_tables) -> None:
    cfg = small_cfg(elastic=True, prefill_tokens=4, rewarm_after=2, replan_every=1)
    home = make_home(cfg)
    cache = ExpertCache(cfg, home)

    def decode(ids: list[int]) -> None:
        cache.before_step(1)
        for layer in range(3):
            cache.observe(layer, torch.tensor([ids]))
        cache.after_step()

    decode([0, 1])
    decode([0, 2])
    res_before = cache.resident()
    assert len(res_before) == 5 and check_tables(cache, home) == 5
    st0 = cache.stats()
    cache.before_step(100)  # prefill: released before it runs
    assert cache.released and cache.pool is None
    assert check_tables(cache, home) == 0
    assert (cache.slot_of == -1).all()
    cache.after_step()
    decode([0, 1])  # decode step 1 after prefill: still released, all misses
    decode([0, 1])  # 2
    assert cache.released
    st1 = cache.stats()
    assert st1.hits == st0.hits and st1.accesses == st0.accesses + 2 * 6
    cache.before_step(1)  # third decode step: re-warm first
    assert not cache.released and cache.pool is not None
    assert set(cache.resident()) == set(res_before)
    assert check_tables(cache, home) == 5
    for layer in range(3):
        cache.observe(layer, torch.tensor([[0, 1]]))
    cache.after_step()
    st2 = cache.stats()
    assert st2.releases == 1 and st2.rewarms == 1 and st2.prefill_steps == 1
    assert st2.bytes_copied == st2.admits * cfg.expert_bytes
    assert st2.hits > st1.hits


def test_big_step_in_non_elastic_mode_keeps_pool(make_home) -> None:
    cfg = small_cfg(elastic=False, prefill_tokens=4)
    cache = ExpertCache(cfg, make_home(cfg))
    cache.before_step(50)
    cache.observe(0, torch.tensor([[1, 2]] * 50))  # ignored: prefill routing and observe_prefill off
    cache.after_step()
    assert not cache.released and cache.stats().prefill_steps == 1 and cache.stats().picks == 0


def _drive(cache: ExpertCache, trace: Trace) -> None:
    off = 0
    for s in range(trace.num_steps):
        r = int(trace.rows_per_step[s])
        ids = torch.from_numpy(trace.ids[off : off + r].astype(np.int64))
        off += r
        cache.before_step(int(trace.tokens_per_step[s]))
        if r:
            for layer in range(trace.num_layers):
                cache.observe(layer, ids[:, layer, :])
        cache.after_step()


@pytest.mark.parametrize(
    "kw",
    [
        dict(policy=DecayedConfig()),
        dict(policy=DecayedConfig(), elastic=True, rewarm_after=3),
        dict(policy=LruConfig(), replan_every=1, admit_limit=2),
        dict(policy=LfuConfig(halve_every=8)),
        dict(policy=ArcConfig(), replan_every=2),
        dict(
            policy=HybridConfig(),
            replan_every=1,
            admit_limit=2,
            hysteresis=1.2,
            elastic=True,
            observe_prefill=True,
            rewarm_set="top",
        ),
        dict(
            policy=HybridConfig(), replan_every=1, admit_limit=2, elastic=True, observe_prefill=True, async_observe=True
        ),
        dict(policy=DecayedConfig(), async_observe=True, elastic=True, rewarm_after=1),
    ],
)
def test_simulator_matches_the_cache(make_home, kw: dict[str, object]) -> None:
    """simulate() and ExpertCache run the same controller: identical counters on the same trace."""
    tr = generate(
        SyntheticTraceConfig(
            num_layers=3,
            num_experts=16,
            top_k=2,
            decode_steps=150,
            streams=2,
            mean_decode_tokens=40,
            mean_prompt_tokens=30,
            prefill_rows=5,
            seed=3,
        )
    )
    base: dict[str, object] = dict(
        num_layers=3, num_experts=16, slot_bytes=40, num_slots=10, prefill_tokens=8, replan_every=4, admit_limit=4
    )
    base.update(kw)
    cfg = ExpertCacheConfig(**base)  # type: ignore[arg-type]
    cache = ExpertCache(cfg, make_home(cfg))
    _drive(cache, tr)
    got = cache.stats()
    want = simulate(tr, cfg)
    assert got == want
    assert want.hits > 0 and want.admits > 0
    if cfg.elastic:
        assert want.releases > 0


def test_home_validation(make_home) -> None:
    cfg = small_cfg()
    home = make_home(cfg)
    with pytest.raises(ValueError, match="home: expected 3 layers"):
        ExpertCache(cfg, home[:2])
    bad = [list(r) for r in home]
    bad[1][0] = bad[1][0][:4]
    with pytest.raises(ValueError, match=r"home\[1\]\[0\] \(w13\): shape must be \(8, 2, 3, 5\)"):
        ExpertCache(cfg, bad)
    bad = [list(r) for r in home]
    bad[2][1] = bad[2][1].to(torch.float64)
    with pytest.raises(ValueError, match=r"home\[2\]\[1\] \(w2\): dtype must be float32"):
        ExpertCache(cfg, bad)
    bad = [list(r) for r in home]
    bad[0][2] = torch.zeros(3, 8, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match=r"home\[0\]\[2\] \(s\): must be contiguous"):
        ExpertCache(cfg, bad)
    bad = [list(r) for r in home]
    bad[0] = bad[0][:2]
    with pytest.raises(ValueError, match=r"home\[0\]: expected 3 projections"):
        ExpertCache(cfg, bad)
    with pytest.raises(ValueError, match="num_slots: is 0"):
        ExpertCache(dataclasses.replace(cfg, num_slots=0), home)


def test_budget_derived_slot_count(make_home) -> None:
    cfg = small_cfg(num_slots=0, vram_budget_bytes=4_000, margin_bytes=1_000, slot_alignment=128)
    assert cfg.resolve_num_slots() == 3000 // 384 == 7
    assert small_cfg(num_slots=0, vram_budget_bytes=10**9).resolve_num_slots() == 24  # never more than L * E
    assert small_cfg(num_slots=0, vram_budget_bytes=500, margin_bytes=1_000).resolve_num_slots() == 0
    cfg = small_cfg(num_slots=0, vram_budget_bytes=10_000, margin_bytes=1_000, slot_alignment=128, max_slots=5)
    cache = ExpertCache(cfg, make_home(cfg))
    assert cache.num_slots == 5 and tuple(cache.pool.shape) == (5, 384)  # type: ignore[union-attr]


def test_free_bytes_minus_margin(make_home) -> None:
    """What a server does: measure the memory left after weights, KV cache and buffers, pass it in; the pool takes
    it minus ``margin_bytes`` (``free_bytes`` wins over nothing, loses to an explicit budget or count)."""
    cfg = small_cfg(num_slots=0, margin_bytes=1_000, slot_alignment=128)
    cache = ExpertCache(cfg, make_home(cfg), free_bytes=1_000 + 6 * 384 + 383)
    assert cache.num_slots == 6 and cache.stats().num_slots == 6
    assert ExpertCache(cfg, make_home(cfg), free_bytes=999).num_slots == 0  # less than the margin: no pool
    budget = dataclasses.replace(cfg, vram_budget_bytes=1_000 + 2 * 384)
    assert ExpertCache(budget, make_home(cfg), free_bytes=10**9).num_slots == 2
    with pytest.raises(ValueError, match="num_slots: is 0 and vram_budget_bytes is 0"):
        ExpertCache(cfg, make_home(cfg))  # a CPU device has no free memory to ask


def test_step_protocol_errors(make_home) -> None:
    cfg = small_cfg()
    cache = ExpertCache(cfg, make_home(cfg))
    with pytest.raises(RuntimeError, match="observe: call before_step"):
        cache.observe(0, torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match="after_step: no step is open"):
        cache.after_step()
    cache.before_step(1)
    with pytest.raises(RuntimeError, match="before_step: the previous step"):
        cache.before_step(1)
    with pytest.raises(RuntimeError, match="replan: not allowed inside a step"):
        cache.replan()
    with pytest.raises(IndexError, match="layer: must be in"):
        cache.observe(3, torch.tensor([[1, 2]]))
    cache.after_step()
    with pytest.raises(ValueError, match="num_tokens"):
        cache.before_step(-1)


def test_pick_and_distinct_hit_counting(make_home) -> None:
    cfg = small_cfg(num_slots=2, replan_every=1, admit_limit=2)
    cache = ExpertCache(cfg, make_home(cfg))
    cache.before_step(2)
    cache.observe(0, torch.tensor([[1, 2], [1, 3]]))  # expert 1 picked twice
    cache.after_step()  # replan: admits (0,1) [2 picks] and one of the 1-pick keys
    assert set(cache.resident()) == {1, 2}
    cache.before_step(2)
    cache.observe(0, torch.tensor([[1, 2], [1, 3]]))
    cache.after_step()
    st = cache.stats()
    assert (st.accesses, st.hits) == (6, 2)  # second step: distinct {1,2,3}, hits {1,2}
    assert (st.picks, st.pick_hits) == (8, 3)  # second step: picks 1,2,1,3 -> hits 1,2,1


def test_observe_all_equals_per_layer_observe(make_home) -> None:
    cfg = small_cfg(replan_every=2, observe_prefill=True, prefill_tokens=5)
    a = ExpertCache(cfg, make_home(cfg))
    b = ExpertCache(cfg, make_home(cfg))
    rng = np.random.default_rng(3)
    for tokens in [1, 3, 2, 7, 2, 1, 4, 1]:
        ids = torch.from_numpy(np.stack([[rng.choice(8, 2, replace=False) for _ in range(tokens)] for _ in range(3)]))
        a.before_step(tokens)
        b.before_step(tokens)
        for layer in range(3):
            a.observe(layer, ids[layer].to(torch.int16))  # narrow ids: converted once
        b.observe_all(ids.to(torch.int32))
        a.after_step()
        b.after_step()
    assert a.stats() == b.stats() and a.resident() == b.resident() and a.stats().hits > 0
    with pytest.raises(ValueError, match=r"expert_ids: must be \[num_layers=3, tokens, top_k\]"):
        b.before_step(1)
        b.observe_all(torch.zeros((2, 1, 2), dtype=torch.int64))
    with pytest.raises(TypeError, match="expert_ids: must be an integer tensor"):
        b.observe(0, torch.zeros((1, 2)))


def test_observe_counts_is_what_observe_adds_to(make_home) -> None:
    """A caller counting in its own kernel (``observe_counts``: the layer's counts, +1 per real pick) leaves the cache
    as ``observe`` does; a prefill step without ``observe_prefill`` gives None (nothing to count)."""
    cfg = small_cfg(replan_every=2, prefill_tokens=5)
    a = ExpertCache(cfg, make_home(cfg))
    b = ExpertCache(cfg, make_home(cfg))
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for tokens in [1, 3, 2, 7, 2, 1, 4, 1, 2]:
        a.before_step(tokens)
        b.before_step(tokens)
        for layer in range(3):
            ids = torch.from_numpy(np.stack([rng.choice(8, 2, replace=False) for _ in range(tokens)]))
            ids[rng.random(ids.shape) < 0.2] = -1
            a.observe(layer, ids)
            target = b.observe_counts(layer, tokens)
            if tokens >= 5:
                assert target is None  # a prefill step, not observed
                continue
            assert target is not None and target.shape == (8,)
            real = ids[ids >= 0]
            target += torch.bincount(real, minlength=8).to(target.dtype)
        a.after_step()
        b.after_step()
    assert a.stats() == b.stats() and a.resident() == b.resident() and a.stats().hits > 0


def test_observe_is_one_device_op(make_home) -> None:
    """The hot path: observe() issues a fixed few device ops for int32/int64 ids (the padding mask, the clamped
    index, one index_add_), no copy of the ids and no host sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {
        "slice",
        "view",
        "reshape",
        "_reshape_alias",
        "alias",
        "select",
        "as_strided",
        "unsqueeze",
        "expand",
        "detach",
    }

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.__name__.split(".")[0]
            if name not in views:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    cfg = small_cfg()
    cache = ExpertCache(cfg, make_home(cfg))
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    cache.before_step(2)
    with Record() as r:
        cache.observe(1, ids)
    assert sorted(r.ops) == ["_to_copy", "clamp", "ge", "index_add_"], r.ops
    cache.after_step()


def test_negative_ids_are_not_counted(make_home) -> None:
    """vLLM marks the rows a CUDA graph pads a batch with by expert id -1: observe() and observe_all() skip them
    (no count lands on another expert or layer); the same picks without them plan the same cache."""
    cfg = small_cfg(replan_every=1)
    a, b, c = (ExpertCache(cfg, make_home(cfg)) for _ in range(3))
    ids = torch.tensor([[[1, 2], [-1, -1]], [[-1, 3], [4, 5]], [[0, -1], [7, 6]]], dtype=torch.int64)
    for _ in range(3):
        for cache in (a, b, c):
            cache.before_step(2)
        b.observe_all(ids)
        for layer in range(3):
            a.observe(layer, ids[layer])
            c.observe(layer, ids[layer][ids[layer] >= 0].view(-1, 1))  # only the real picks
        for cache in (a, b, c):
            cache.after_step()
    assert a.stats() == b.stats() == c.stats()
    assert a.resident() == b.resident() == c.resident() and len(a.resident()) > 0


def _in_region(cache: ExpertCache, loan) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Pointer-table entries that point into the lent slots."""
    lo = loan.buffer.data_ptr()
    hi = lo + loan.buffer.numel()
    ptrs = cache.pointer_table.cpu().numpy()
    return np.argwhere((ptrs >= lo) & (ptrs < hi))


def test_lend_evicts_the_coldest_and_hands_over_the_tail(make_home, check_tables) -> None:
    cfg = small_cfg(num_slots=6, replan_every=1, admit_limit=6, rewarm_limit=1, slot_alignment=128)
    home = make_home(cfg)
    cache = ExpertCache(cfg, home)
    # decode steps make keys 0..5 of layer 0 resident with distinct heat (expert e picked 6 - e times per step)
    for _ in range(3):
        cache.before_step(1)
        cache.observe(0, torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 5]]))
        cache.after_step()
    before = cache.resident()
    assert sorted(before) == [0, 1, 2, 3, 4, 5] and check_tables(cache, home) == 6
    prio = cache._ctl.policy.priorities()
    coldest = sorted(before, key=lambda k: (prio[k], -k))[:2]
    loan = cache.lend(cfg.slot_stride + 1)  # rounds up to two slots: the last two
    assert (loan.first_slot, loan.num_slots) == (4, 2) and loan.buffer.numel() == 2 * cfg.slot_stride
    assert loan.buffer.data_ptr() == cache.pool.data_ptr() + 4 * cfg.slot_stride  # type: ignore[union-attr]
    assert loan.ready is None and loan.evicted == 2  # CPU device: the moves are done at once
    after = cache.resident()
    assert set(after) == set(before) - set(coldest) and max(after.values()) < 4
    assert len(_in_region(cache, loan)) == 0  # nothing reads the lent slots any more
    assert check_tables(cache, home) == 4  # moved experts read their bytes from their new slots
    loan.buffer.fill_(0xEE)  # the borrower overwrites the region: no pointer reads it
    assert check_tables(cache, home) == 4
    # replans during the loan never hand out a lent slot
    cache.before_step(1)
    cache.observe(1, torch.tensor([[5, 5, 5, 6, 6, 6, 7, 7, 7] * 4]))
    cache.after_step()
    assert max(cache.resident().values()) < 4 and len(_in_region(cache, loan)) == 0
    loan.buffer.fill_(0x11)
    assert check_tables(cache, home) == len(cache.resident())
    with pytest.raises(RuntimeError, match="already lent"):
        cache.lend(1)
    with pytest.raises(RuntimeError, match="lent"):
        cache.release()
    with pytest.raises(ValueError, match="slots"):
        ExpertCache(cfg, home).lend(7 * cfg.slot_stride)
    # give back: the evicted experts come back at most rewarm_limit (1) per step, with the right bytes
    cache.give_back(loan)
    assert cache.loan is None
    with pytest.raises(RuntimeError, match="not the current loan"):
        cache.give_back(loan)
    waiting = []
    for _ in range(3):
        cache.before_step(1)
        cache.after_step()  # (the replan after the refill may evict the refilled again: the policy decides)
        waiting.append(cache._ctl.refill_keys.size)
        assert check_tables(cache, home) == len(cache.resident())
    assert waiting == [1, 0, 0]  # one re-admission per step
    assert max(cache.resident().values()) >= 4  # the region is in use again
    assert cache.stats().lends == 1


def test_lend_with_every_slot_free_and_the_whole_pool(make_home, check_tables) -> None:
    cfg = small_cfg(num_slots=4)
    home = make_home(cfg)
    cache = ExpertCache(cfg, home)
    loan = cache.lend(4 * cfg.slot_stride)
    assert (loan.first_slot, loan.num_slots, loan.evicted, loan.moved) == (0, 4, 0, 0)
    cache.before_step(1)
    cache.observe(2, torch.tensor([[1, 2, 3]]))
    cache.after_step()
    cache.replan()
    assert cache.resident() == {} and check_tables(cache, home) == 0  # nothing may be admitted while all is lent
    cache.give_back(loan)
    cache.replan()
    assert len(cache.resident()) == 3 and check_tables(cache, home) == 3
