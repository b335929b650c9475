"""The one configuration object of cpu_tier (frozen; validated on construction)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

ISAS: tuple[str, ...] = ("auto", "scalar", "avx2", "avx512", "amx")
PRECISIONS: tuple[str, ...] = ("auto", "exact", "fast")
#: Activation dtypes whose own rounding (bf16 2^-9, fp16 2^-12 relative, half an ulp) is at or above "fast"'s
#: error per linear (~2e-4 relative RMS, README "Precision and error model"): with them "auto" is "fast".
SIXTEEN_BIT_FLOATS: tuple[str, ...] = ("bfloat16", "float16")
#: Activation dtypes "auto" computes "exact" for.
WIDE_FLOATS: tuple[str, ...] = ("float32", "float64")


def usable_cpus() -> tuple[int, ...]:
    """The cores this process may run on (``os.sched_getaffinity``)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuTierConfig:
    """Configuration of the CPU expert tier.

    Attributes
    ----------
    threads : worker threads; 0 = one per core in ``cpus``, or per usable core when ``cpus`` is empty.
    cpus : cores to pin the workers to (worker w -> ``cpus[w % len(cpus)]``); () = no pinning. Pin only to cores
        that nothing else runs on: a pinned worker cannot leave a core another process is using, and every phase
        of a job waits for its unit (on a shared machine pinned jobs ran at half speed and in long stalls; README).
    isa : kernel variant: "auto" (the best the host runs), "scalar", "avx2", "avx512" or "amx" (the avx512 kernels,
        plus the AMX-INT8 kernel for MUL1 "fast", K <= 4, on chunks of ``amx_min_tokens`` or more tokens per expert;
        Sapphire Rapids and newer, where Linux grants the tile state).
    amx_min_tokens : with isa "amx": the fewest tokens per expert chunk (1..8; 9 = never) that run the AMX kernel.
        Default 6: on Emerald Rapids the AMX kernel is as fast or faster at 8 tokens (1.0-2.5x on 1 core, 1.0-1.3x
        on 16 cores), slower at 1-2, even at 4.
    prefetch_blocks : the kernels' software prefetch distance, in 128-row blocks of the weights (0..4; 0 = none,
        the hardware prefetchers alone): the trellis rows of block b + D are requested while block b is computed
        (the row-at-a-time kernels: 8 D - 2 tile rows ahead). A tuning knob for the memory latency of the host;
        results do not depend on it. Default 1: on the H200 host 2 was 10-20% slower at 8 and 16 cores in the
        interleaved A/B runs (README).
    precision : "exact" (fp32 activations, exact fp16 codebook values; max relative error <= 1e-5 against
        ``cpu_tier.exl3.linear``), "fast" (MUL1: int16 activations and the integer byte-sum path; MCG/3INST:
        no fp16 rounding of the codebook value; relative RMS error <= 5e-3, see the README's error model) or
        "auto" (the default): "fast" when the caller's activations are bf16/fp16 (their own rounding is at or
        above fast's error), "exact" when they are float32 (``resolved_precision``; ``ExpertTier`` takes the
        dtype as ``activation_dtype``, float32 unless told).
    swiglu_limit : default SwiGLU clamp of ``ExpertTier.add_layer`` (10.0 for DeepSeek-V4.1's routed experts);
        None = no clamp (shared experts).
    spin_us : microseconds an idle worker spins before it parks.
    slab_blocks : work split of ``ExpertTier``'s GEMVs. 0 = one unit per 128-column band over all rows (each unit
        reads 32*K bytes x 8 tiles of every tile row: a strided stream); S > 0 = one unit per S 128-row blocks over
        all columns (each unit reads whole contiguous rows, which the hardware prefetchers stream), partial sums
        added afterwards (scratch per expert: 4 bytes x tokens x (2 I ceil(H/128/S) + H ceil(I/128/S))).
    """

    threads: int = 0
    cpus: tuple[int, ...] = ()
    isa: Literal["auto", "scalar", "avx2", "avx512", "amx"] = "auto"
    precision: Literal["auto", "exact", "fast"] = "auto"
    swiglu_limit: float | None = 10.0
    spin_us: int = 50
    slab_blocks: int = 0
    amx_min_tokens: int = 6
    prefetch_blocks: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"threads: must be an int >= 0 (0 = all usable cores), got {self.threads!r}")
        if self.threads > 1024:
            raise ValueError(f"threads: {self.threads} is more than 1024")
        cpus = self.cpus
        if isinstance(cpus, (list, range)):
            cpus = tuple(cpus)
            object.__setattr__(self, "cpus", cpus)
        if not isinstance(cpus, tuple) or any(isinstance(c, bool) or not isinstance(c, int) for c in cpus):
            raise ValueError(f"cpus: must be a tuple of core numbers, got {self.cpus!r}")
        if len(set(cpus)) != len(cpus):
            raise ValueError(f"cpus: duplicate cores in {cpus}")
        usable = set(usable_cpus())
        bad = [c for c in cpus if c not in usable]
        if bad:
            raise ValueError(f"cpus: cores {bad} are not usable by this process (usable: {sorted(usable)})")
        if self.isa not in ISAS:
            raise ValueError(f"isa: must be one of {ISAS}, got {self.isa!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: must be one of {PRECISIONS}, got {self.precision!r}")
        lim = self.swiglu_limit
        if lim is not None:
            if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not math.isfinite(lim) or lim <= 0:
                raise ValueError(f"swiglu_limit: must be a finite number > 0 or None, got {lim!r}")
        if isinstance(self.spin_us, bool) or not isinstance(self.spin_us, int) or not 0 <= self.spin_us <= 10_000_000:
            raise ValueError(f"spin_us: must be an int in [0, 10000000], got {self.spin_us!r}")

        amt = self.amx_min_tokens
        if isinstance(amt, bool) or not isinstance(amt, int) or not 1 <= amt <= 9:
            raise ValueError(f"amx_min_tokens: must be an int in [1, 9] (9 = never), got {amt!r}")
        pfb = self.prefetch_blocks
        if isinstance(pfb, bool) or not isinstance(pfb, int) or not 0 <= pfb <= 4:
            raise ValueError(f"prefetch_blocks: must be an int in [0, 4] (0 = none), got {pfb!r}")
        if (
            isinstance(self.slab_blocks, bool)
            or not isinstance(self.slab_blocks, int)
            or not 0 <= self.slab_blocks <= 1024
        ):
            raise ValueError(f"slab_blocks: must be an int in [0, 1024] (0 = band split), got {self.slab_blocks!r}")

    def resolved_precision(self, activation_dtype: str = "float32") -> Literal["exact", "fast"]:
        """The arithmetic the tier runs for activations computed in ``activation_dtype`` ("float32", "float64",
        "bfloat16" or "float16"; a ``torch.dtype``'s name with or without its ``torch.`` prefix)."""
        name = str(activation_dtype).removeprefix("torch.")
        if name not in SIXTEEN_BIT_FLOATS + WIDE_FLOATS:
            raise ValueError(
                f"activation_dtype: expected one of {SIXTEEN_BIT_FLOATS + WIDE_FLOATS}, got {activation_dtype!r}"
            )
        if self.precision == "auto":
            return "fast" if name in SIXTEEN_BIT_FLOATS else "exact"
        return "fast" if self.precision == "fast" else "exact"

    def resolved_threads(self) -> int:
        """The number of worker threads this configuration starts."""
        if self.threads:
            return self.threads
        return len(self.cpus) if self.cpus else len(usable_cpus())
