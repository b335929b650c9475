"""Pick and load the native kernel variant: the best one the host runs (CPUID + XGETBV), or the one asked for.

A variant's module is imported only after the feature probe (``_cpu_features``, built without ISA flags) says the
host executes its instructions, so a variant the host cannot run is never loaded.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx512vbmi")
#: Features (as named by ``cpu_features()``) each variant needs. "amx" is the avx512 module with its AMX-INT8
#: kernel for the MUL1 integer path (``os_amx``: the OS saves the tile state and granted it to this process).
REQUIRED: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": _AVX512,
    "amx": (*_AVX512, "amx_tile", "amx_int8", "os_amx"),
}
#: The native module each variant runs on.
MODULE: dict[str, str] = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}
#: "auto" order ("amx" runs the avx512 kernels except for chunks of ``CpuTierConfig.amx_min_tokens`` or more
#: tokens per expert, where its AMX kernel is measured faster).
PREFERENCE: tuple[str, ...] = ("amx", "avx512", "avx2", "scalar")

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def missing_features(isa: str) -> list[str]:
    """Features ``isa`` needs that this host lacks (CPU or OS support; for "amx" also a build of the avx512 module
    with its AMX kernels, which compilers without AMX support leave out)."""
    from . import cpu_features

    if isa not in REQUIRED:
        raise ValueError(f"isa: unknown kernel variant {isa!r}; expected one of {('auto', *REQUIRED)}")
    feats = cpu_features()
    missing = [f for f in REQUIRED[isa] if not feats.get(f, False)]
    if isa == "amx" and not missing and not load("avx512").has_amx_kernels():
        missing.append("amx kernels (this build of the avx512 module has none)")
    return missing


def runnable_isas() -> list[str]:
    """The variants this host can run, best first."""
    return [isa for isa in PREFERENCE if not missing_features(isa)]


def resolve_isa(isa: str = "auto") -> str:
    """``isa`` itself if the host runs it (else ValueError naming the missing features); "auto" = the best."""
    if isa == "auto":
        return runnable_isas()[0]
    missing = missing_features(isa)
    if missing:
        raise ValueError(
            f"isa: this host cannot run the {isa!r} kernels (missing CPU/OS features: {', '.join(missing)}); "
            f"runnable: {runnable_isas()}"
        )
    return isa


def load(isa: str = "auto") -> ModuleType:
    """The native module of a runnable variant (imported once; "amx" shares the avx512 module, whose runtimes take
    ``amx=True``)."""
    name = MODULE[resolve_isa(isa)]
    with _lock:
        mod = _modules.get(name)
        if mod is None:
            mod = importlib.import_module(f"cpu_tier._native_{name}")
            if mod.isa() != name:
                raise RuntimeError(f"cpu_tier._native_{name} reports ISA {mod.isa()!r}")
            _modules[name] = mod
    return mod


def load_emulated() -> ModuleType | None:
    """Test-only: the avx512 variant's kernels with emulated AVX-512 intrinsics (``_native_avx512emu``, built for
    AVX2 hosts), or None when it is not built or the host lacks AVX2. Never used for computing."""
    if missing_features("avx2"):
        return None
    with _lock:
        mod = _modules.get("avx512emu")
        if mod is None:
            try:
                mod = importlib.import_module("cpu_tier._native_avx512emu")
            except ImportError:
                return None
            _modules["avx512emu"] = mod
    return mod
