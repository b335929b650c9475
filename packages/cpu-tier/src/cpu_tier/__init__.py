"""cpu-tier: EXL3 expert weights on the CPU.

``cpu_tier.exl3`` is the pure-numpy reference of the EXL3 format; the native kernels (``exl3_matmul``,
``ExpertTier``) are checked against it. Native variants load lazily, on first use.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from . import exl3, geometry
from .config import CpuTierConfig
from .exl3 import Exl3Tensor, random_tensor
from .tier import ExpertTier, Job, Picks, StreamCall, StreamCounters, exl3_matmul, selected_isa

__version__ = _version("cpu-tier")


def cpu_features() -> dict[str, bool]:
    """The x86 features the CPU has and the OS enables (CPUID + XGETBV), e.g. ``{"avx2": True, ...}``.

    Where the CPU has AMX, probing also asks Linux to grant this process the AMX tile state (``os_amx``: granted);
    the grant only lets the process use AMX, nothing runs on the tile unit unless the "amx" variant is chosen."""
    from ._cpu_features import cpu_features as _probe

    return dict(_probe())


def runnable_isas() -> list[str]:
    """The native kernel variants this host can run, best first."""
    from ._loader import runnable_isas as _r

    return _r()


__all__ = [
    "CpuTierConfig",
    "ExpertTier",
    "Exl3Tensor",
    "Job",
    "StreamCall",
    "StreamCounters",
    "Picks",
    "__version__",
    "cpu_features",
    "exl3",
    "exl3_matmul",
    "geometry",
    "random_tensor",
    "runnable_isas",
    "selected_isa",
]
