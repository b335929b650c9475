"""The routed-expert geometry of the MoE models this project serves, stored in EXL3: one home for the numbers.

Every package that sizes, synthesizes or benchmarks real-shaped experts imports :data:`V41_FLASH` from here
(expert-cache's slot sizes and trace defaults, dma-prefill's layer spec, pack-tools' ``flash-layer`` preset,
cpu-tier's benchmark) instead of writing 384 / 5120 / 2304 / K=3 again. It lives in cpu-tier because cpu-tier is
the lowest package that needs it and the home of the EXL3 format rules the byte counts follow
(:func:`cpu_tier.exl3.trellis_shape`). Pure Python: importing it loads no native code.

A routed SwiGLU expert has three linears, ``y = x @ W`` with ``W`` of shape ``(in, out)``: gate and up
``(hidden, intermediate)``, down ``(intermediate, hidden)``, each an EXL3 trellis of ``bits`` per weight.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cpu_tier.exl3 import SUPPORTED_BITS, Codebook, trellis_shape

__all__ = ["V41_FLASH", "MoeGeometry"]

Projection = Literal["gate", "up", "down"]


@dataclasses.dataclass(frozen=True, slots=True)
class MoeGeometry:
    """The routed experts of one MoE model in EXL3.

    Attributes
    ----------
    name : what it is, for logs and benchmark headers.
    num_layers : MoE layers that hold routed experts.
    num_experts : routed experts per layer.
    top_k : experts each token is routed to, per layer.
    hidden : model width H (the experts' input and output size).
    intermediate : expert width I (``moe_intermediate_size``).
    bits : EXL3 bits per weight K of the routed experts (one K for gate, up and down).
    codebook : their EXL3 codebook.
    shared_bits : K of the shared expert's EXL3 linears.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    bits: float
    codebook: Codebook
    shared_bits: float

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_experts", "top_k", "hidden", "intermediate"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MoeGeometry.{f}: must be an int >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeGeometry.top_k: {self.top_k} exceeds num_experts {self.num_experts}")
        for f in ("hidden", "intermediate"):
            if getattr(self, f) % 128:
                raise ValueError(
                    f"MoeGeometry.{f}: must be a multiple of 128 (Hadamard-128 blocks), got {getattr(self, f)}"
                )
        if self.codebook not in SUPPORTED_BITS or self.bits not in SUPPORTED_BITS[self.codebook]:
            raise ValueError(f"MoeGeometry.bits: K={self.bits} is not supported for codebook {self.codebook!r}")

    def linear_shape(self, proj: Projection) -> tuple[int, int]:
        """``(in, out)`` of one projection: gate/up ``(hidden, intermediate)``, down ``(intermediate, hidden)``."""
        if proj in ("gate", "up"):
            return (self.hidden, self.intermediate)
        if proj == "down":
            return (self.intermediate, self.hidden)
        raise ValueError(f"unknown projection {proj!r}; expected 'gate', 'up' or 'down'")

    def trellis_shape(self, proj: Projection) -> tuple[int, int, int]:
        """The int16 trellis shape of one projection, ``(in/16, out/16, 16*K)``."""
        return trellis_shape(*self.linear_shape(proj), self.bits)

    @property
    def projection_trellis_bytes(self) -> int:
        """Bytes of one projection's trellis (gate, up and down hold the same count of weights)."""
        a, b, c = self.trellis_shape("gate")
        return a * b * c * 2

    @property
    def expert_trellis_bytes(self) -> int:
        """Bytes of one routed expert's three trellises (without the fp16 ``suh`` / ``svh`` vectors)."""
        return 3 * self.projection_trellis_bytes


#: DeepSeek-V4.1-Flash as the pinned EXL3 3.0 bpw checkpoint stores it (../shared/reference/reference-system.md):
#: 40 MoE layers x 384 routed experts, top-6, H = 5120, I = 2304, MUL1 K = 3 (13,271,040 B of trellis per
#: expert), shared expert K = 4.
V41_FLASH = MoeGeometry(
    name="DeepSeek-V4.1-Flash EXL3 3.0bpw",
    num_layers=40,
    num_experts=384,
    top_k=6,
    hidden=5120,
    intermediate=2304,
    bits=3,
    codebook="mul1",
    shared_bits=4,
)
