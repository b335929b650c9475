"""CpuTierConfig validation: every bad field raises ValueError naming the field."""

from __future__ import annotations

import pytest

from cpu_tier import CpuTierConfig
from cpu_tier.config import usable_cpus


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threads": -1}, "threads"),
        ({"threads": 1.5}, "threads"),
        ({"threads": True}, "threads"),
        ({"cpus": (0, 0)}, "cpus"),
        ({"cpus": (10_000,)}, "cpus"),
        ({"cpus": "0,1"}, "cpus"),
        ({"isa": "sse"}, "isa"),
        ({"precision": "bf16"}, "precision"),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"swiglu_limit": float("inf")}, "swiglu_limit"),
        ({"swiglu_limit": "10"}, "swiglu_limit"),
        ({"spin_us": -5}, "spin_us"),
        ({"amx_min_tokens": 0}, "amx_min_tokens"),
        ({"amx_min_tokens": 10}, "amx_min_tokens"),
        ({"amx_min_tokens": True}, "amx_min_tokens"),
        ({"prefetch_blocks": -1}, "prefetch_blocks"),
        ({"prefetch_blocks": 5}, "prefetch_blocks"),
        ({"prefetch_blocks": 2.0}, "prefetch_blocks"),
    ],
)
def test_bad_fields(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        CpuTierConfig(**kwargs)


def test_defaults_and_resolution() -> None:
    c = CpuTierConfig()
    assert (c.threads, c.cpus, c.isa, c.precision, c.swiglu_limit, c.spin_us) == (0, (), "auto", "auto", 10.0, 50)
    assert c.resolved_threads() == len(usable_cpus())
    cores = usable_cpus()[:1]
    assert CpuTierConfig(cpus=list(cores)).cpus == cores  # lists are frozen into tuples
    assert CpuTierConfig(cpus=cores).resolved_threads() == 1
    assert CpuTierConfig(threads=3, cpus=cores).resolved_threads() == 3
    assert CpuTierConfig(swiglu_limit=None).swiglu_limit is None
    with pytest.raises(AttributeError):
        c.threads = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("precision", "dtype", "resolved"),
    [
        ("auto", "float32", "exact"),
        ("auto", "float64", "exact"),
        ("auto", "bfloat16", "fast"),
        ("auto", "torch.float16", "fast"),  # a torch.dtype's str
        ("exact", "bfloat16", "exact"),  # an explicit choice is kept whatever the activations
        ("fast", "float32", "fast"),
    ],
)
def test_resolved_precision(precision: str, dtype: str, resolved: str) -> None:
    assert CpuTierConfig(precision=precision).resolved_precision(dtype) == resolved  # type: ignore[arg-type]


def test_resolved_precision_names_a_bad_dtype() -> None:
    with pytest.raises(ValueError, match="^activation_dtype: .*'int8'"):
        CpuTierConfig().resolved_precision("int8")
