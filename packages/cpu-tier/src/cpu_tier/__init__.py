"""cpu-tier: EXL3 expert weights on the CPU.

``cpu_tier.exl3`` is the pure-numpy reference of the EXL3 format; the native kernels are checked against it.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from . import exl3
from .exl3 import Exl3Tensor, random_tensor

__version__ = _version("cpu-tier")


def cpu_features() -> dict[str, bool]:
    """The x86 features the CPU has and the OS enables (CPUID + XGETBV), e.g. ``{"avx2": True, ...}``."""
    from ._cpu_features import cpu_features as _probe

    return dict(_probe())


__all__ = ["Exl3Tensor", "__version__", "cpu_features", "exl3", "random_tensor"]
