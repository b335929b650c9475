"""Every policy and the replan rule on small hand-computed traces (CacheController, no memory)."""

from __future__ import annotations

import numpy as np
import pytest

from expert_cache import (
    ArcConfig,
    CacheController,
    DecayedConfig,
    ExpertCacheConfig,
    HybridConfig,
    LfuConfig,
    LruConfig,
    Swap,
    save_profile,
)
from expert_cache.policies import ARCPolicy, HybridPolicy


def ctl_for(num_experts: int, num_slots: int, **kw: object) -> CacheController:
    cfg = ExpertCacheConfig(num_layers=1, num_experts=num_experts, slot_bytes=8, num_slots=num_slots, **kw)  # type: ignore[arg-type]
    return CacheController(cfg, num_slots)


def step(ctl: CacheController, picks: dict[int, int]) -> list[Swap]:
    """One decode step with the given pick counts, then a replan."""
    p = np.zeros(ctl.config.num_keys)
    for k, v in picks.items():
        p[k] = v
    ctl.observe([np.array(sorted(picks), np.int64)], p)
    return ctl.plan()


def res(ctl: CacheController) -> set[int]:
    return set(ctl.resident_keys().tolist())


def test_decayed_reference_rule() -> None:
    """score = score * decay + picks per replan; admit best non-residents of the top-N; evict with hysteresis."""
    c = ctl_for(4, 2, policy=DecayedConfig(decay=0.5), replan_every=1, admit_limit=1)
    assert step(c, {0: 3, 1: 1}) == [Swap(0, -1, 0)]  # score [3, 1, 0, 0]; admit limit 1
    np.testing.assert_allclose(c.policy.priorities(), [3, 1, 0, 0])
    assert step(c, {1: 2, 2: 4}) == [Swap(1, -1, 2)]  # score [1.5, 2.5, 4, 0]: want {2, 1}, 2 first
    np.testing.assert_allclose(c.policy.priorities(), [1.5, 2.5, 4, 0])
    assert step(c, {1: 2}) == [Swap(0, 0, 1)]  # score [0.75, 3.25, 2, 0]: 3.25 > 1.0 * 0.75 evicts 0
    assert res(c) == {1, 2}
    assert c.counters()["admits"] == 3 and c.counters()["evicts"] == 1


def test_decayed_hysteresis_blocks_a_close_swap() -> None:
    c = ctl_for(4, 2, policy=DecayedConfig(decay=0.5), replan_every=1, admit_limit=1, hysteresis=5.0)
    step(c, {0: 3, 1: 1})
    step(c, {1: 2, 2: 4})
    assert step(c, {1: 2}) == []  # 3.25 > 5 * 0.75 is false: the replan stops
    assert res(c) == {0, 2}


def test_decayed_counts_accumulate_between_replans_and_decay_once() -> None:
    c = ctl_for(3, 1, policy=DecayedConfig(decay=0.5), replan_every=2)
    p = np.array([1.0, 0, 0])
    c.observe([np.array([0])], p)
    c.observe([np.array([0])], p)  # two steps of one interval, one decay
    c.plan()
    np.testing.assert_allclose(c.policy.priorities(), [2, 0, 0])


def test_admission_limit_takes_the_best_first_and_ties_by_key() -> None:
    c = ctl_for(8, 6, policy=DecayedConfig(), admit_limit=2)
    sw = step(c, {5: 3, 1: 2, 6: 2, 2: 9, 7: 1})
    assert [s.new_key for s in sw] == [2, 5]
    sw = step(c, {})  # decayed scores keep their order: next best 1 and 6 tie (1.8), lower key first
    assert [s.new_key for s in sw] == [1, 6]


def test_keys_outside_the_top_n_or_without_score_are_not_admitted() -> None:
    c = ctl_for(6, 4, policy=DecayedConfig(), admit_limit=10)
    step(c, {0: 1, 1: 1})
    assert res(c) == {0, 1}  # two free slots stay free: no other key has a positive score


def test_lru_hand_trace() -> None:
    c = ctl_for(4, 2, policy=LruConfig(), replan_every=1, admit_limit=2)
    step(c, {0: 1})
    step(c, {1: 1})
    assert res(c) == {0, 1}
    assert step(c, {2: 1}) == [Swap(0, 0, 2)]  # last use [1, 2, 3]: 0 is least recent
    step(c, {1: 1})
    assert step(c, {3: 1}) == [Swap(0, 2, 3)]  # last use 0:1 1:4 2:3 3:5 -> want {3, 1}, evict 2
    assert res(c) == {1, 3}


def test_lru_batched_replan_sees_the_order_inside_the_interval() -> None:
    c = ctl_for(4, 2, policy=LruConfig(), replan_every=3, admit_limit=4)
    c.observe([np.array([0, 1]), np.array([2]), np.array([1])], np.array([1.0, 2, 1, 0]))
    c.plan()
    assert res(c) == {1, 2}  # last use 0:1 1:3 2:2


def test_lfu_with_aging_hand_trace() -> None:
    c = ctl_for(2, 1, policy=LfuConfig(halve_every=2), replan_every=1)
    step(c, {0: 5})  # counts steps, not picks: [1, 0]
    assert res(c) == {0}
    step(c, {0: 1})  # [2, 0] -> halved at step 2 -> [1, 0]
    np.testing.assert_allclose(c.policy.priorities(), [1, 0])
    step(c, {1: 1})  # [1, 1]: a tie keeps the resident (lower key wins the tie, and no swap on equal priority)
    assert res(c) == {0}
    step(c, {1: 1})  # [1, 2] -> halved -> [0.5, 1]
    np.testing.assert_allclose(c.policy.priorities(), [0.5, 1])
    assert res(c) == {1}


def test_arc_hand_trace() -> None:
    """ARC(c=2) on 1 2 1 3 2 1 (states worked out by hand from the paper's cases)."""
    a = ARCPolicy(8, 2)
    expect = [
        ([1], [], [], [], 0.0),
        ([1, 2], [], [], [], 0.0),
        ([2], [1], [], [], 0.0),
        ([3], [1], [2], [], 0.0),  # miss, |T1|+|B1| = 1 < c, total 2: REPLACE evicts T1's LRU (2) to B1
        ([3], [2], [], [1], 1.0),  # B1 hit: p = 1; |T1| = 1 is not > p, so T2's LRU (1) goes to B2
        ([], [2, 1], [3], [], 0.0),  # B2 hit: p = 0; T1's 3 goes to B1
    ]
    for x, (t1, t2, b1, b2, p) in zip([1, 2, 1, 3, 2, 1], expect, strict=True):
        a.access(x)
        assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p) == (t1, t2, b1, b2, p), f"after access {x}"


def test_arc_drives_the_residents() -> None:
    c = ctl_for(8, 2, policy=ArcConfig(), replan_every=1, admit_limit=2)
    want = [{1}, {1, 2}, {1, 2}, {1, 3}, {2, 3}, {1, 2}]
    for x, w in zip([1, 2, 1, 3, 2, 1], want, strict=True):
        step(c, {x: 1})
        assert res(c) == w


def test_arc_full_cache_invariants() -> None:
    rng = np.random.default_rng(0)
    a = ARCPolicy(50, 7)
    for x in rng.integers(0, 50, 3000).tolist():
        a.access(x)
        t = len(a.t1) + len(a.t2)
        assert t <= 7 and len(a.t1) + len(a.b1) <= 7 and t + len(a.b1) + len(a.b2) <= 14
        assert 0 <= a.p <= 7
        assert x in a.t1 or x in a.t2
    assert len(a.t1) + len(a.t2) == 7


def test_hybrid_hand_trace() -> None:
    c = ctl_for(3, 1, policy=HybridConfig(halflives=(1.0,), slow_halflife=1.0, slow_weight=0.0), replan_every=1)
    step(c, {0: 2})  # fast = 0.5 * 0 + 0.5 * 2 = [1, 0, 0]
    np.testing.assert_allclose(c.policy.priorities(), [1, 0, 0])
    assert res(c) == {0}
    step(c, {1: 4})  # fast = [0.5, 2, 0]
    np.testing.assert_allclose(c.policy.priorities(), [0.5, 2, 0])
    assert res(c) == {1}


def test_hybrid_hysteresis_and_slow_term() -> None:
    c = ctl_for(
        3, 1, policy=HybridConfig(halflives=(1.0,), slow_halflife=1e6, slow_weight=1.0), hysteresis=5.0, replan_every=1
    )
    step(c, {0: 2})
    step(c, {1: 4})
    assert res(c) == {0}  # 2 + tiny < 5 * (0.5 + tiny)
    pr = c.policy.priorities()
    ds = 0.5 ** (1 / 1e6)
    np.testing.assert_allclose(pr, [0.5 + 2 * (1 - ds) * ds, 2 + 4 * (1 - ds), 0], rtol=1e-9)


def test_hybrid_recency_bonus() -> None:
    c = ctl_for(3, 1, policy=HybridConfig(halflives=(1.0,), recency_bonus=10.0), replan_every=1)
    step(c, {0: 4})
    step(c, {1: 1})  # fast [1, 0.5, 0] but 1 was routed last: +10
    assert res(c) == {1}


def test_hybrid_picks_the_time_scale_that_hits() -> None:
    """Two candidate half-lives (1 and 1000 steps), one slot. While key 0 is routed both shadow caches hit and the
    long one (the middle candidate) leads; when routing moves to key 1 the short one hits and takes over, so the
    cache follows within a few steps; a fixed long half-life would hold key 0 for ~1000 steps."""
    hybrid = dict(slow_weight=0.0, score_halflife=64.0)
    c = ctl_for(2, 1, policy=HybridConfig(halflives=(1.0, 1000.0), **hybrid), replan_every=1)  # type: ignore[arg-type]
    fixed = ctl_for(2, 1, policy=HybridConfig(halflives=(1000.0,), **hybrid), replan_every=1)  # type: ignore[arg-type]
    for _ in range(50):
        step(c, {0: 1})
        step(fixed, {0: 1})
    assert c.policy.leader_halflife == 1000.0 and res(c) == {0}
    for i in range(20):  # noqa: B007 (i is read after the loop)
        step(c, {1: 1})
        step(fixed, {1: 1})
        if res(c) == {1}:
            break
    assert res(c) == {1} and i <= 3 and c.policy.leader_halflife == 1.0
    assert res(fixed) == {0}
    sc = c.policy.score
    assert sc[0] > sc[1]


def test_hybrid_profile_prior(tmp_path) -> None:
    path = tmp_path / "prof.npz"
    rates = np.zeros((2, 3))
    rates[1, 2] = 7.0
    save_profile(path, rates, 2, 3)
    cfg = ExpertCacheConfig(
        num_layers=2,
        num_experts=3,
        slot_bytes=8,
        num_slots=1,
        policy=HybridConfig(profile_path=str(path)),
        replan_every=1,
    )
    c = CacheController(cfg, 1)
    step(c, {0: 1})
    assert res(c) == {5}  # the profile's key (layer 1, expert 2) beats one observed pick
    bad = tmp_path / "bad.npz"
    np.savez(bad, rates=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="rates has shape"):
        CacheController(
            ExpertCacheConfig(
                num_layers=2, num_experts=3, slot_bytes=8, num_slots=1, policy=HybridConfig(profile_path=str(bad))
            ),
            1,
        )


def test_prefill_observation() -> None:
    c = ctl_for(
        4,
        1,
        policy=HybridConfig(halflives=(1.0,), slow_weight=0.0),
        observe_prefill=True,
        prefill_weight=2.0,
        replan_every=1,
    )
    step(c, {0: 1})  # fast [0.5, 0, 0, 0]
    pre = np.array([0.0, 0, 30, 0])
    c.observe([], np.zeros(4), pre, 10)  # rate 3 per token, weight 2 -> +6
    np.testing.assert_allclose(c.policy.priorities(), [0.5, 0, 6, 0])
    c.plan()
    assert res(c) == {2}
    off = ctl_for(4, 1, policy=HybridConfig(), observe_prefill=False)
    off.observe([], np.zeros(4), pre, 10)
    assert not off.policy.priorities().any()


def test_release_and_rewarm_sets() -> None:
    c = ctl_for(6, 3, policy=DecayedConfig(), elastic=True, prefill_tokens=10, rewarm_after=1, admit_limit=8)
    step(c, {0: 5, 1: 4, 2: 3})
    assert c.begin_step(11) == ("prefill", "release")
    evicted = c.release()
    assert sorted(evicted.tolist()) == [0, 1, 2] and res(c) == set()
    assert c.keep.tolist() == [0, 1, 2]
    assert c.begin_step(1) == ("decode", None)  # first decode step after the prefill
    c.observe([np.array([4])], np.array([0, 0, 0, 0, 50.0, 0]))
    assert c.begin_step(1) == ("decode", "rewarm")
    sw = c.rewarm()
    assert [s.new_key for s in sw] == [0, 1, 2]  # "kept": the old residents, best first
    c2 = ctl_for(
        6, 3, policy=DecayedConfig(), elastic=True, prefill_tokens=10, rewarm_after=0, admit_limit=8, rewarm_set="top"
    )
    step(c2, {0: 5, 1: 4, 2: 3})
    c2.begin_step(11)
    c2.release()
    c2.observe([np.array([4])], np.array([0, 0, 0, 0, 50.0, 0]))
    assert c2.begin_step(1) == ("decode", "rewarm")
    assert [s.new_key for s in c2.rewarm()] == [4, 0, 1]  # "top": current priorities (pending 50 counts)


def test_rewarm_limit_bounds_the_refill() -> None:
    """``rewarm_limit``: the re-warm admits the best kept keys only; the following replans fill the free slots,
    each at most ``admit_limit``, best first."""
    c = ctl_for(8, 5, policy=DecayedConfig(), elastic=True, prefill_tokens=10, rewarm_after=0, admit_limit=2,
                rewarm_limit=3, replan_every=1)  # fmt: skip
    step(c, {0: 9, 1: 8, 2: 7, 3: 6, 4: 5})
    c.plan()
    c.plan()
    c.plan()
    assert res(c) == {0, 1, 2, 3, 4}
    c.begin_step(11)
    c.release()
    assert c.begin_step(1) == ("decode", "rewarm")
    assert [s.new_key for s in c.rewarm()] == [0, 1, 2]  # the best 3 of the 5 kept
    assert [s.new_key for s in c.plan()] == [3, 4]  # the next replan fills free slots (admit_limit 2)
    assert res(c) == {0, 1, 2, 3, 4} and c.counters()["admits"] == 5 + 5


def test_hybrid_policy_rejects_a_wrong_profile_size() -> None:
    with pytest.raises(ValueError, match="profile_path: profile has 3 keys"):
        HybridPolicy(4, 1, profile=np.ones(3))


def test_async_observe_feeds_the_previous_snapshot() -> None:
    c = ctl_for(4, 1, policy=DecayedConfig(decay=0.5), replan_every=1, async_observe=True)
    calls = []

    def obs(k: int):
        def fetch():
            calls.append(k)
            p = np.zeros(4)
            p[k] = 1.0
            return [np.array([k])], p, None, 0

        return fetch

    c.submit(obs(0))
    assert calls == [] and c.plan() == []  # nothing fed yet: the snapshot is held
    c.submit(obs(1))
    assert calls == [0]
    assert [s.new_key for s in c.plan()] == [0]  # planned with step 0's data
    c.submit(obs(2), complete=True)  # a release/re-warm flush feeds everything
    assert calls == [0, 1, 2]
    c2 = ctl_for(4, 1, policy=DecayedConfig(), replan_every=1)
    c2.submit(obs(3))
    assert calls[-1] == 3 and [s.new_key for s in c2.plan()] == [3]
