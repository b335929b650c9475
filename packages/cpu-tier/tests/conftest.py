"""Fixtures of the cpu-tier tests (helpers live in cpu_tier.testing)."""

from __future__ import annotations

import pytest

from cpu_tier.testing import make_experts


@pytest.fixture(scope="session")
def small_experts() -> tuple[list, list, list]:
    """6 MUL1 K=3 experts, H = 256, I = 384 (I not a multiple of 256)."""
    return make_experts(6, 256, 384, 3, "mul1", seed=7)
