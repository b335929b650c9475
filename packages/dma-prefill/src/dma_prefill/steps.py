"""The step-size rule from measured costs: which MoE path a step of T tokens should take on this machine.

``StepCostModel`` predicts one layer's routed-expert time on each path from rates measured on the machine
(the prefill benchmark's transfer and compute rates, the CPU tier's GB/s per tokens-per-expert, the VRAM cache's
hit rate), and ``derive_thresholds`` turns the crossovers into ``PrefillConfig.decode_max_tokens`` /
``hybrid_max_tokens``. It is a model: each term is a measured rate, but the paths were not timed end to end
together (the decode path is not composed in this package).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .config import V41_FLASH, StepPath
from .layout import ExpertLayout

__all__ = ["StepCostModel", "chunked_expert_seconds", "derive_thresholds"]


def chunked_expert_seconds(seconds: Mapping[int, float], tokens: float) -> float:
    """Seconds of one expert computed for ``tokens`` tokens by a tier measured at a few token counts.

    ``seconds`` maps tokens per expert (>= 1) to the measured seconds of one expert at that count. Between the
    measured points the time is interpolated linearly in the token count; beyond the largest one, M, the tier
    works in chunks of M tokens (``cpu_tier`` decodes an expert once per chunk of at most 8), so ``tokens`` cost
    ``(tokens // M)`` times M's plus the remainder's; below the smallest one, a lone expert costs that point's
    time (its weights are read whatever the count). With one point at m = 1 every token costs one expert's time.
    """
    if not seconds or any(not (m >= 1 and s >= 0) for m, s in seconds.items()):
        raise ValueError(f"chunked_expert_seconds: need entries tokens >= 1 -> seconds >= 0, got {dict(seconds)}")
    pts = sorted((float(m), float(s)) for m, s in seconds.items())
    big_m, big_t = pts[-1]
    full, rest = divmod(max(tokens, 0.0), big_m)
    if rest <= 0:
        return full * big_t
    if rest <= pts[0][0]:
        part = pts[0][1] * (rest / pts[0][0] if full else 1.0)  # a lone expert costs at least one token's time
    else:
        part = big_t
        for (m0, t0), (m1, t1) in zip(pts, pts[1:], strict=False):
            if rest <= m1:
                part = t0 + (t1 - t0) * (rest - m0) / (m1 - m0)
                break
    return full * big_t + part


@dataclasses.dataclass(frozen=True, slots=True)
class StepCostModel:
    """Per-layer seconds of each MoE path for a step of ``T`` scheduled tokens.

    Parameters
    ----------
    num_experts, top_k : the layer's routed experts and experts per token.
    expert_bytes : bytes of one routed expert record (what one expert costs to stream or read).
    h2d_gbps : pinned host-to-device rate (GB/s).
    gpu_expert_s : GPU seconds per streamed expert that do not depend on its rows (the EXL3 decode).
    gpu_row_s : GPU seconds per routed row (token x expert) of the staged compute (transforms + GEMMs).
    cpu_gbps : the CPU tier's trellis GB/s on all its cores by tokens per expert (e.g. ``{1: 52.4, 8: 22.4}``).
        Between the measured points the time per expert is interpolated linearly in the token count; beyond the
        largest one, M, the tier works in chunks of M tokens (``cpu_tier`` decodes an expert once per chunk of
        at most 8), so m tokens cost ``(m // M)`` times M's plus the remainder's.
    cache_hit_rate : fraction of the touched experts the VRAM cache holds on the decode path (their rows are
        computed on the GPU at ``gpu_row_s``; the misses go to the CPU tier).
    """

    num_experts: int
    top_k: int
    expert_bytes: int
    h2d_gbps: float
    gpu_expert_s: float
    gpu_row_s: float
    cpu_gbps: Mapping[int, float]
    cache_hit_rate: float

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"StepCostModel: need 1 <= top_k <= num_experts, got {self.top_k}, {self.num_experts}")
        for name in ("expert_bytes", "h2d_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StepCostModel.{name} must be > 0, got {getattr(self, name)}")
        for name in ("gpu_expert_s", "gpu_row_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"StepCostModel.{name} must be >= 0, got {getattr(self, name)}")
        if not self.cpu_gbps or any(not (m >= 1 and v > 0) for m, v in self.cpu_gbps.items()):
            raise ValueError(f"StepCostModel.cpu_gbps needs entries tokens >= 1 -> GB/s > 0, got {dict(self.cpu_gbps)}")
        if not 0.0 <= self.cache_hit_rate <= 1.0:
            raise ValueError(f"StepCostModel.cache_hit_rate must be in [0, 1], got {self.cache_hit_rate}")

    @classmethod
    def h200_session(cls) -> StepCostModel:
        """The rates measured on the H200 machine this project is tested on (2026-11-29): H2D 55.2 GB/s; the
        staged compute fitted to two measured layers with all 384 experts streamed (2k chunk: 42.3 ms of compute
        for 12,288 rows; 32k: 98.0 ms for 196,608 rows; packages/dma-prefill/results/h200-0d83cad-*): 100.5 us per
        expert (decode, per-batch launches) + 0.302 us per row; the CPU tier on the 16 host cores (run 3,
        packages/cpu-tier/results); the expert cache's hybrid policy hit rate on synthetic traces (~0.43)."""
        return cls(
            num_experts=V41_FLASH.num_experts,
            top_k=6,
            expert_bytes=ExpertLayout.build(V41_FLASH).stride,
            h2d_gbps=55.2,
            gpu_expert_s=100.5e-6,
            gpu_row_s=0.302e-6,
            cpu_gbps={1: 52.4, 2: 39.0, 4: 32.2, 8: 22.4},
            cache_hit_rate=0.43,
        )

    def touched(self, tokens: int) -> float:
        """Expected distinct experts routed by ``tokens`` tokens (uniform routing)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def cpu_expert_s(self, tokens: float) -> float:
        """CPU tier seconds for one expert with ``tokens`` tokens (see ``cpu_gbps``)."""
        return chunked_expert_seconds({m: self.expert_bytes / (v * 1e9) for m, v in self.cpu_gbps.items()}, tokens)

    def _cpu_s(self, experts: float, rows: float) -> float:
        if experts <= 0:
            return 0.0
        return experts * self.cpu_expert_s(rows / experts)

    def _stream_s(self, experts: float, rows: float) -> float:
        """Stream ``experts`` through the staging ring and compute ``rows`` on them: the copy and the GPU compute
        overlap; the slower bounds it."""
        return max(
            experts * self.expert_bytes / (self.h2d_gbps * 1e9), experts * self.gpu_expert_s + rows * self.gpu_row_s
        )

    def dma_s(self, tokens: int) -> float:
        """Every touched expert streamed."""
        return self._stream_s(self.touched(tokens), tokens * self.top_k)

    def decode_s(self, tokens: int) -> float:
        """Hits on the GPU from VRAM, misses on the CPU tier read in place, concurrently."""
        e = self.touched(tokens)
        rows = tokens * self.top_k
        gpu = self.cache_hit_rate * rows * self.gpu_row_s
        return max(gpu, self._cpu_s((1.0 - self.cache_hit_rate) * e, (1.0 - self.cache_hit_rate) * rows))

    def hybrid_s(self, tokens: int) -> tuple[float, float]:
        """Best split: the GPU streams a fraction ``1 - f`` of the touched experts while the CPU tier computes the
        fraction ``f`` (the trailing batches); returns ``(seconds, f)`` for the best ``f`` on a 1/64 grid."""
        e = self.touched(tokens)
        rows = tokens * self.top_k
        best = (math.inf, 0.0)
        for i in range(65):
            f = i / 64
            t = max(self._stream_s((1 - f) * e, (1 - f) * rows), self._cpu_s(f * e, f * rows))
            if t < best[0]:
                best = (t, f)
        return best

    def best_path(self, tokens: int, *, hybrid: bool = True) -> StepPath:
        """The path of least predicted time (ties go to the simpler path: decode, then dma); ``hybrid=False``
        leaves the hybrid path out (a runner without a CPU tail)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        d, s = self.decode_s(tokens), self.dma_s(tokens)
        h = self.hybrid_s(tokens)[0] if hybrid else math.inf
        if d <= min(s, h):
            return "decode"
        return "dma" if s <= h else "hybrid"


def derive_thresholds(model: StepCostModel, max_tokens: int = 65_536, *, hybrid: bool = True) -> tuple[int, int]:
    """``(decode_max_tokens, hybrid_max_tokens)`` for ``PrefillConfig``: the largest step size at which the decode
    path is still the best, and the largest at which the hybrid path beats streaming everything (equal to the
    first when hybrid never wins, or with ``hybrid=False``: decode against streaming only). Step sizes are scanned
    exactly up to 4096, then on a power-of-two grid."""
    sizes = list(range(1, min(max_tokens, 4096) + 1))
    t = 8192
    while t <= max_tokens:
        sizes.append(t)
        t *= 2
    decode_max = 0
    hybrid_max = 0
    for n in sizes:
        p = model.best_path(n, hybrid=hybrid)
        if p == "decode":
            decode_max = n
        elif p == "hybrid":
            hybrid_max = n
    return decode_max, max(decode_max, hybrid_max)
