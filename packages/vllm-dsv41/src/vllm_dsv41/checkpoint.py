"""Which modules of a checkpoint are EXL3, and collecting their tensors while vLLM streams the weights.

An EXL3 linear is stored as ``<module>.trellis``/``.suh``/``.svh`` (plus an optional codebook marker and bias)
in place of ``<module>.weight`` (exllamav3's rule: the presence of ``.trellis`` makes a module EXL3). Which
modules those are is read from the safetensors index, or from the safetensors headers when there is no
index, before the model is built, so every vLLM layer gets the right method at construction time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from cpu_tier.exl3 import Exl3Tensor
from engram_mmap.safetensors_header import parse_header

__all__ = ["EXL3_SUFFIXES", "TensorStore", "exl3_modules", "tensor_names"]

#: Every tensor suffix an EXL3 linear may have (``bias`` is loaded by the vLLM layer's own parameter).
EXL3_SUFFIXES: dict[str, torch.dtype] = {
    "trellis": torch.int16,
    "suh": torch.float16,
    "svh": torch.float16,
    "su": torch.int16,
    "sv": torch.int16,
    "mcg": torch.int32,
    "mul1": torch.int32,
}


def tensor_names(model_dir: str | Path) -> list[str]:
    """All tensor names of a local checkpoint directory (from the index if present, else the headers)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: the EXL3 plugin needs a local model directory (a pack)")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
        return list(weight_map)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    return [name for f in files for name in parse_header(f).tensors]


def exl3_modules(names: Iterable[str]) -> frozenset[str]:
    """Module prefixes that carry a ``.trellis`` tensor."""
    return frozenset(n[: -len(".trellis")] for n in names if n.endswith(".trellis"))


class TensorStore:
    """EXL3 tensors of one vLLM layer, gathered from vLLM's weight iterator, keyed by a part.

    A part is a shard of a fused linear (``0``, ``1``, ... in vLLM's output order) or an (expert, projection)
    pair of a MoE layer. ``build`` turns a part's tensors into a validated ``Exl3Tensor``.
    """

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self._parts: dict[object, dict[str, np.ndarray]] = {}

    def put(self, part: object, suffix: str, tensor: torch.Tensor) -> None:
        if suffix not in EXL3_SUFFIXES:
            raise ValueError(f"{self.layer_name}: unexpected EXL3 tensor suffix {suffix!r}")
        tensors = self._parts.setdefault(part, {})
        if suffix in tensors:
            raise ValueError(f"{self.layer_name} {part}: tensor {suffix!r} loaded twice")
        tensors[suffix] = tensor.detach().to("cpu").numpy().copy()

    def __contains__(self, part: object) -> bool:
        return part in self._parts

    def parts(self) -> list[object]:
        return list(self._parts)

    def build(self, part: object, name: str) -> Exl3Tensor:
        """The part's ``Exl3Tensor``; ``name`` is used in errors (e.g. the checkpoint module name)."""
        tensors = self._parts.get(part)
        if not tensors:
            raise ValueError(
                f"{name}: no EXL3 tensors were loaded for this module (is the checkpoint complete? "
                "load_format 'dummy' cannot produce EXL3 weights)"
            )
        return Exl3Tensor.from_safetensors({f"{name}.{s}": a for s, a in tensors.items()}, name)

    def clear(self) -> None:
        self._parts.clear()
