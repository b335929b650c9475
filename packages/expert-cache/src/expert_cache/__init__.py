"""expert-cache: the elastic VRAM expert cache for MoE serving (slot pool, pointer tables, policies, trace simulator).

See README.md. Public API:

* :class:`ExpertCacheConfig`, :class:`ProjectionSpec` - the one frozen config, and the policy it chooses:
  :class:`DecayedConfig`, :class:`LruConfig`, :class:`LfuConfig`, :class:`ArcConfig`, :class:`HybridConfig`
  (:func:`policy_config` builds one from a name);
* :class:`ExpertCache` - the slot pool, per-layer ``slot_of`` maps and projection-major pointer tables on a device
  (:meth:`ExpertCache.lend` lends its coldest slots' memory out as a :class:`Loan`);
* :class:`ExpertRows` - an address-based home (rows anywhere in pinned or CUDA-registered host buffers;
  :meth:`ExpertRows.copy_expert` fills one slot), and :func:`slot_pool` - the aligned slot allocator (the cache's
  pool, a borrower's transient slots);
* :mod:`expert_cache.policies` - ``decayed`` (the reference), ``lru``, ``lfu``, ``arc``, ``hybrid``;
* :mod:`expert_cache.trace` - the trace format, :class:`TraceRecorder`, the synthetic generator;
* :mod:`expert_cache.sim` - :func:`simulate`, Belady's MIN, the CLI.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from .config import (
    DSV41_FLASH_EXL3_3BPW,
    MIN_SLOT_ALIGNMENT,
    POLICIES,
    ArcConfig,
    DecayedConfig,
    ExpertCacheConfig,
    HybridConfig,
    LfuConfig,
    LruConfig,
    PolicyConfig,
    ProjectionSpec,
    policy_config,
)
from .planner import CacheController, CacheStats, Swap
from .policies import Policy, load_profile, make_policy, save_profile

if TYPE_CHECKING:
    from .cache import ExpertCache, Loan, slot_pool
    from .home import ExpertRows
    from .sim import belady_hit_mask, belady_hit_rate, belady_hits, simulate, static_oracle_hit_rate
    from .trace import SyntheticTraceConfig, Trace, TraceRecorder, generate, load_trace, repeated_experts

# Loaded on first use: ExpertCache needs torch (the simulator and the trace tools do not), and the modules with a
# command line (``python -m expert_cache.sim`` / ``.trace``) must not be imported by the package itself.
_LAZY = {
    "ExpertCache": "cache",
    "Loan": "cache",
    "slot_pool": "cache",
    "ExpertRows": "home",
    "belady_hit_mask": "sim",
    "belady_hit_rate": "sim",
    "belady_hits": "sim",
    "simulate": "sim",
    "static_oracle_hit_rate": "sim",
    "SyntheticTraceConfig": "trace",
    "Trace": "trace",
    "TraceRecorder": "trace",
    "generate": "trace",
    "load_trace": "trace",
    "repeated_experts": "trace",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'expert_cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


try:
    __version__ = _version("expert-cache")
except PackageNotFoundError:  # imported from a source tree (e.g. PYTHONPATH=src on the GPU machine)
    __version__ = "0+src"

__all__ = [
    "DSV41_FLASH_EXL3_3BPW",
    "MIN_SLOT_ALIGNMENT",
    "POLICIES",
    "ArcConfig",
    "CacheController",
    "CacheStats",
    "DecayedConfig",
    "ExpertCache",
    "ExpertCacheConfig",
    "ExpertRows",
    "HybridConfig",
    "LfuConfig",
    "Loan",
    "slot_pool",
    "LruConfig",
    "Policy",
    "PolicyConfig",
    "ProjectionSpec",
    "Swap",
    "SyntheticTraceConfig",
    "Trace",
    "TraceRecorder",
    "__version__",
    "belady_hit_mask",
    "belady_hit_rate",
    "belady_hits",
    "generate",
    "load_profile",
    "load_trace",
    "repeated_experts",
    "make_policy",
    "policy_config",
    "save_profile",
    "simulate",
    "static_oracle_hit_rate",
]
