"""Frozen configuration of dma-prefill: the layer geometry, the host store and the prefill path.

No environment variable is read anywhere in this package: the caller builds these dataclasses.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cpu_tier.exl3 import CODEBOOKS, SUPPORTED_BITS, Codebook, trellis_shape
from cpu_tier.geometry import V41_FLASH as V41_FLASH_GEOMETRY
from cpu_tier.geometry import MoeGeometry

__all__ = [
    "PROJECTIONS",
    "TENSORS",
    "LayerSpec",
    "PrefillConfig",
    "ProjSpec",
    "Projection",
    "StepPath",
    "V41_FLASH",
    "StoreConfig",
    "choose_path",
]

Projection = Literal["gate", "up", "down"]
#: The three linears of a routed SwiGLU expert, in record order.
PROJECTIONS: tuple[Projection, ...] = ("gate", "up", "down")
#: The stored tensors of one EXL3 linear that the store keeps (the codebook marker is per layer and projection).
TENSORS: tuple[str, ...] = ("trellis", "suh", "svh")

StepPath = Literal["decode", "hybrid", "dma"]


@dataclasses.dataclass(frozen=True, slots=True)
class ProjSpec:
    """One projection of an expert: ``y = x @ W``, ``W`` of shape ``(k, n)``, ``bits`` per weight."""

    k: int
    n: int
    bits: float
    codebook: Codebook

    @property
    def trellis_shape(self) -> tuple[int, int, int]:
        return trellis_shape(self.k, self.n, self.bits)

    @property
    def trellis_bytes(self) -> int:
        a, b, c = self.trellis_shape
        return a * b * c * 2


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    """Geometry of one MoE layer's routed experts (all experts of a layer share it).

    Parameters
    ----------
    num_experts : routed experts in the layer (384 for DeepSeek-V4.1-Flash).
    hidden : model width H (gate/up ``k``, down ``n``); a multiple of 128.
    intermediate : expert width I (gate/up ``n``, down ``k``); a multiple of 128.
    bits : K of gate, up and down.
    codebooks : codebook of gate, up and down.
    """

    num_experts: int
    hidden: int
    intermediate: int
    bits: tuple[float, float, float] = (3, 3, 3)
    codebooks: tuple[Codebook, Codebook, Codebook] = ("mul1", "mul1", "mul1")

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise ValueError(f"LayerSpec.num_experts must be positive, got {self.num_experts}")
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v <= 0 or v % 128:
                raise ValueError(f"LayerSpec.{name} must be a positive multiple of 128, got {v}")
        if len(self.bits) != 3 or len(self.codebooks) != 3:
            raise ValueError("LayerSpec.bits and LayerSpec.codebooks need one entry per projection (gate, up, down)")
        for p, b, cb in zip(PROJECTIONS, self.bits, self.codebooks, strict=True):
            if cb not in CODEBOOKS:
                raise ValueError(f"LayerSpec.codebooks[{p}]: unknown codebook {cb!r}; expected one of {CODEBOOKS}")
            if b not in SUPPORTED_BITS[cb]:
                raise ValueError(f"LayerSpec.bits[{p}]: K={b} is not supported for {cb} ({SUPPORTED_BITS[cb]})")

    def proj(self, p: Projection) -> ProjSpec:
        i = PROJECTIONS.index(p)
        if p == "down":
            return ProjSpec(self.intermediate, self.hidden, self.bits[i], self.codebooks[i])
        return ProjSpec(self.hidden, self.intermediate, self.bits[i], self.codebooks[i])

    @classmethod
    def from_geometry(cls, g: MoeGeometry) -> LayerSpec:
        """One MoE layer of ``g`` (``cpu_tier.geometry``): its experts, widths, K and codebook."""
        return cls(g.num_experts, g.hidden, g.intermediate, (g.bits,) * 3, (g.codebook,) * 3)


#: One DeepSeek-V4.1-Flash MoE layer (``cpu_tier.geometry.V41_FLASH``: 384 experts, H 5120, I 2304, MUL1 K = 3).
V41_FLASH = LayerSpec.from_geometry(V41_FLASH_GEOMETRY)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreConfig:
    """How ``HostExpertStore`` lays out and registers host memory, and how it finds tensors in shards.

    Parameters
    ----------
    align : byte alignment of every tensor inside an expert record (a power of two, >= 16).
    tail_pad : zero bytes after each layer's last record, so a vectorised kernel never reads past the end.
    register : cudaHostRegister (portable + mapped) each layer when CUDA is available.
    key_template : safetensors key of one tensor; fields ``layer``, ``expert``, ``proj``, ``tensor``.
    proj_names : the checkpoint's names of gate, up and down (DeepSeek: w1, w3, w2).
    progress : show a tqdm bar while loading.
    """

    align: int = 256
    tail_pad: int = 4096
    register: bool = True
    key_template: str = "layers.{layer}.ffn.experts.{expert}.{proj}.{tensor}"
    proj_names: tuple[str, str, str] = ("w1", "w3", "w2")
    progress: bool = True

    def __post_init__(self) -> None:
        if self.align < 16 or self.align & (self.align - 1):
            raise ValueError(f"StoreConfig.align must be a power of two >= 16, got {self.align}")
        if self.tail_pad < 16:
            raise ValueError(f"StoreConfig.tail_pad must be >= 16 bytes, got {self.tail_pad}")
        for f in ("{layer}", "{expert}", "{proj}", "{tensor}"):
            if f not in self.key_template:
                raise ValueError(f"StoreConfig.key_template must contain {f}, got {self.key_template!r}")
        if len(self.proj_names) != 3:
            raise ValueError("StoreConfig.proj_names needs three names (gate, up, down)")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillConfig:
    """The staged-DMA prefill path.

    Parameters
    ----------
    num_slots : N, staging slots in VRAM (the copy engine runs at most N batches ahead of compute).
    experts_per_batch : B, experts per staging slot (one batch).
    prefetch_batches : first batches of the next layer copied while the current one finishes
        (cross-layer prefetch); at most ``num_slots``; 0 turns it off. ``None`` means ``num_slots``.
    cpu_tail_batches : k, trailing batches left to the CPU tier on hybrid steps.
    decode_max_tokens : steps of at most this many tokens stay on the decode path.
    hybrid_max_tokens : single-request steps up to this size take the hybrid path (GPU streams the first
        batches, the CPU tier computes the last ``cpu_tail_batches``).
    exact : split activations into fp16 hi + lo parts so the fp16 tensor-core GEMM keeps fp32 accuracy
        (two MMAs per weight tile); False runs one fp16 MMA (exllamav3-like ~1e-3 relative noise).
    swiglu_limit : DeepSeek clamp: ``silu(min(gate, L)) * clamp(up, -L, L)``; None for plain SwiGLU.
    backend : "triton" (GPU kernels), "torch" (pure torch, any device), "auto" (triton on CUDA).
    """

    num_slots: int = 8
    experts_per_batch: int = 8
    prefetch_batches: int | None = None
    cpu_tail_batches: int = 0
    decode_max_tokens: int = 512
    hybrid_max_tokens: int = 2048
    exact: bool = True
    swiglu_limit: float | None = None
    backend: Literal["auto", "triton", "torch"] = "auto"

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"PrefillConfig.num_slots must be >= 1, got {self.num_slots}")
        if self.experts_per_batch < 1:
            raise ValueError(f"PrefillConfig.experts_per_batch must be >= 1, got {self.experts_per_batch}")
        if self.prefetch_batches is not None and not 0 <= self.prefetch_batches <= self.num_slots:
            raise ValueError(
                f"PrefillConfig.prefetch_batches must be in [0, num_slots={self.num_slots}], "
                f"got {self.prefetch_batches}"
            )
        if self.cpu_tail_batches < 0:
            raise ValueError(f"PrefillConfig.cpu_tail_batches must be >= 0, got {self.cpu_tail_batches}")
        if not 0 <= self.decode_max_tokens <= self.hybrid_max_tokens:
            raise ValueError(
                "PrefillConfig: need 0 <= decode_max_tokens <= hybrid_max_tokens, got "
                f"{self.decode_max_tokens} and {self.hybrid_max_tokens}"
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"PrefillConfig.swiglu_limit must be positive or None, got {self.swiglu_limit}")
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"PrefillConfig.backend must be auto, triton or torch, got {self.backend!r}")

    @property
    def prefetch(self) -> int:
        return self.num_slots if self.prefetch_batches is None else self.prefetch_batches


def choose_path(num_tokens: int, num_requests: int, config: PrefillConfig) -> StepPath:
    """Which MoE path a step of ``num_tokens`` scheduled tokens from ``num_requests`` requests takes.

    * ``num_tokens <= decode_max_tokens``: "decode" (VRAM cache hits + zero-copy/CPU misses; not this package).
    * ``num_tokens <= hybrid_max_tokens`` and a single request: "hybrid" (stream all but the last
      ``cpu_tail_batches`` batches; the CPU tier computes those in parallel).
    * otherwise "dma": every routed expert streams through the staging ring.

    Below ``decode_max_tokens`` few experts are touched with few rows each, so reading them in place is
    cheaper than moving whole experts; above it nearly all experts are touched and the transfer is paid once
    per chunk whatever its length, so the chunk should be as long as memory allows.
    """
    if num_tokens < 0 or num_requests < 0:
        raise ValueError(f"num_tokens and num_requests must be >= 0, got {num_tokens}, {num_requests}")
    if num_tokens <= config.decode_max_tokens:
        return "decode"
    if num_tokens <= config.hybrid_max_tokens and num_requests <= 1 and config.cpu_tail_batches > 0:
        return "hybrid"
    return "dma"
