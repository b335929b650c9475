"""ExpertCacheConfig: derived geometry and every error names its field."""

from __future__ import annotations

import pytest

from expert_cache import (
    DSV41_FLASH_EXL3_3BPW,
    DecayedConfig,
    ExpertCacheConfig,
    HybridConfig,
    LfuConfig,
    LruConfig,
    ProjectionSpec,
    policy_config,
)


def cfg(**kw: object) -> ExpertCacheConfig:
    base: dict[str, object] = dict(num_layers=2, num_experts=4, slot_bytes=100, num_slots=3)
    base.update(kw)
    return ExpertCacheConfig(**base)  # type: ignore[arg-type]


def test_reference_geometry() -> None:
    c = ExpertCacheConfig(num_layers=40, num_experts=384, projections=DSV41_FLASH_EXL3_3BPW, num_slots=392)
    assert c.expert_bytes == 13_271_040 and c.slot_stride == 13_271_040  # both rows are multiples of 256
    assert c.projection_offsets == (0, 8_847_360)
    assert c.num_keys == 15_360
    # The reference's allocation rule: (free - margin) // per-slot bytes.
    free = 900 * 2**20 + 392 * 13_271_040 + 5
    assert (
        ExpertCacheConfig(num_layers=40, num_experts=384, projections=DSV41_FLASH_EXL3_3BPW).resolve_num_slots(free)
        == 392
    )


def test_defaults_are_the_reference() -> None:
    c = cfg()
    assert (c.policy, c.replan_every, c.admit_limit, c.hysteresis) == (DecayedConfig(decay=0.9), 16, 48, 1.0)
    assert (c.prefill_tokens, c.rewarm_after, c.margin_bytes) == (512, 4, 900 * 2**20)


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        cfg().num_slots = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "exc", "msg"),
    [
        (dict(num_layers=0), ValueError, "num_layers: must be >= 1, got 0"),
        (dict(num_experts=2.5), TypeError, "num_experts: must be an int"),
        (dict(slot_bytes=0), ValueError, "slot_bytes: one of projections or slot_bytes"),
        (
            dict(projections=(ProjectionSpec("a", (4,)),)),
            ValueError,
            "slot_bytes: give either projections or slot_bytes",
        ),
        (dict(slot_bytes=0, projections=[ProjectionSpec("a", (4,))]), TypeError, "projections: must be a tuple"),
        (
            dict(slot_bytes=0, projections=(ProjectionSpec("a", (4,)), ProjectionSpec("a", (2,)))),
            ValueError,
            "projections: names must be unique",
        ),
        (dict(num_slots=-1), ValueError, "num_slots: must be >= 0"),
        (dict(num_slots=9), ValueError, "num_slots: must be <= num_layers \\* num_experts = 8"),
        (dict(policy="decayed"), TypeError, "policy: must be one of DecayedConfig, .*policy_config"),
        (dict(replan_every=0), ValueError, "replan_every: must be in \\[1, 1024\\]"),
        (dict(admit_limit=0), ValueError, "admit_limit: must be >= 1"),
        (dict(hysteresis=0.5), ValueError, "hysteresis: must be in"),
        (dict(hysteresis=2.0, policy=LruConfig()), ValueError, "hysteresis: policy 'lru' ranks by recency"),
        (dict(elastic=1), TypeError, "elastic: must be a bool"),
        (dict(prefill_tokens=0), ValueError, "prefill_tokens: must be >= 1"),
        (dict(rewarm_after=-1), ValueError, "rewarm_after: must be >= 0"),
        (dict(rewarm_set="all"), ValueError, "rewarm_set: must be 'kept' or 'top'"),
        (dict(rewarm_limit=-1), ValueError, "rewarm_limit: must be >= 0"),
        (dict(observe_prefill="yes"), TypeError, "observe_prefill: must be a bool"),
        (dict(slot_alignment=3), ValueError, "slot_alignment: must be a power of two >= 128, got 3"),
        (dict(slot_alignment=64), ValueError, "slot_alignment: must be a power of two >= 128, got 64"),
        (dict(margin_bytes=-5), ValueError, "margin_bytes: must be >= 0"),
        (dict(async_fill=None), TypeError, "async_fill: must be a bool"),
    ],
)
def test_errors_name_the_field(kw: dict[str, object], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        cfg(**kw)


@pytest.mark.parametrize(
    ("make", "exc", "msg"),
    [
        (lambda: DecayedConfig(decay=0.0), ValueError, "DecayedConfig.decay: must be in \\(0.0, 1.0\\]"),
        (lambda: DecayedConfig(decay=float("nan")), ValueError, "DecayedConfig.decay: must be in"),
        (lambda: LfuConfig(halve_every=0), ValueError, "LfuConfig.halve_every: must be >= 1"),
        (lambda: HybridConfig(halflives=(4.0, 100.0), slow_halflife=10.0), ValueError,
         "HybridConfig.slow_halflife: must be >= max\\(halflives\\)"),
        (lambda: HybridConfig(halflives=()), ValueError, "HybridConfig.halflives: must be a non-empty tuple"),
        (lambda: HybridConfig(halflives=(4.0, -1.0)), ValueError, "HybridConfig.halflives\\[1\\]: must be in"),
        (lambda: HybridConfig(profile_path=""), ValueError, "HybridConfig.profile_path: must be None or a non-empty"),
        (lambda: policy_config("fifo"), ValueError, "policy: must be one of \\['decayed', 'lru', 'lfu', 'arc', 'hybrid'\\]"),  # noqa: E501
        (lambda: policy_config("lfu", profile_path="p.npz"), ValueError,
         "LfuConfig.profile_path: the 'lfu' policy has no such knob \\(it has \\['halve_every'\\]\\)"),
        (lambda: policy_config("lru", decay=0.5), ValueError, "LruConfig.decay: the 'lru' policy has no such knob \\(it has none\\)"),  # noqa: E501
    ],
)  # fmt: skip
def test_policy_config_errors_name_the_field(make: object, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        make()  # type: ignore[operator]


def test_policy_config_by_name() -> None:
    assert policy_config("hybrid", slow_weight=0.5) == HybridConfig(slow_weight=0.5)
    assert policy_config("lfu").name == "lfu" and cfg(policy=policy_config("arc")).policy.name == "arc"


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(name="", shape=(1,)), "projections.name"),
        (dict(name="w", shape=()), r"projections\[w\].shape"),
        (dict(name="w", shape=(2, 0)), r"projections\[w\].shape: every dimension"),
        (dict(name="w", shape=(2,), dtype="float64"), r"projections\[w\].dtype"),
    ],
)
def test_projection_errors(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ProjectionSpec(**kw)  # type: ignore[arg-type]


def test_resolve_needs_a_size_on_cpu() -> None:
    with pytest.raises(ValueError, match="num_slots: is 0 and vram_budget_bytes is 0"):
        cfg(num_slots=0).resolve_num_slots()
    assert cfg(num_slots=0).resolve_num_slots(free_bytes=900 * 2**20 + 2 * 256 + 5) == 2  # slots are 256-byte aligned
