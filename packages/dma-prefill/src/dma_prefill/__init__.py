"""dma-prefill: the host expert store and staged copy-engine streaming of MoE experts for prefill.

``HostExpertStore`` holds every routed expert once, in page-locked, GPU-mapped host memory. For a prefill chunk,
``PrefillPlan`` sorts the routes by expert and cuts the experts into batches, ``StagingRing`` streams the batches
through N VRAM slots on a copy stream, and ``DmaPrefill`` computes each staged batch on the GPU (bit-exact EXL3
decode, fp32-accurate grouped GEMM) while the next batches are in flight.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .config import PROJECTIONS, V41_FLASH, LayerSpec, PrefillConfig, ProjSpec, StepPath, StoreConfig, choose_path
from .cpu_tail import CpuTail, CpuTierTail
from .device import CudaDevice, FakeDevice
from .external import ExternalExpertStore
from .layout import ExpertLayout
from .plan import PrefillPlan
from .prefill import DmaPrefill, PipelineStats
from .ring import Staged, StagingRing
from .steps import StepCostModel, chunked_expert_seconds, derive_thresholds
from .store import ExpertStore, HostExpertStore

try:
    __version__ = _version("dma-prefill")
except PackageNotFoundError:  # running from a source tree (e.g. PYTHONPATH on the GPU machine)
    __version__ = "0+unknown"

__all__ = [
    "PROJECTIONS",
    "CpuTail",
    "CpuTierTail",
    "CudaDevice",
    "DmaPrefill",
    "ExpertLayout",
    "ExpertStore",
    "ExternalExpertStore",
    "FakeDevice",
    "HostExpertStore",
    "LayerSpec",
    "PipelineStats",
    "PrefillConfig",
    "PrefillPlan",
    "ProjSpec",
    "Staged",
    "StagingRing",
    "StepCostModel",
    "StepPath",
    "StoreConfig",
    "V41_FLASH",
    "__version__",
    "choose_path",
    "chunked_expert_seconds",
    "derive_thresholds",
]
