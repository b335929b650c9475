"""Dense EXL3 linears on the GPU: the tensors stay EXL3 in VRAM and every call decodes them in the kernel.

A V4.1-Flash pack's dense EXL3 part (attention projections, shared experts, Engram ``wkv``, the head) is about
7.7 GiB; dequantized to bf16 it would be ~40 GiB, so it is never dequantized. Two kernel backends compute
``y = x @ W`` for one EXL3 tensor (``Exl3Tensor``: ``H(H(x * suh) @ W_inner) * svh``):

* ``Exllamav3Kernel``: exllamav3's own CUDA kernels, driven exactly as exllamav3 drives them (its
  ``LinearEXL3``: the fused trellis GEMM up to its row threshold, reconstruct + fp16 GEMM above), with fp32
  output;
* ``TritonKernel`` (ours): dma-prefill's bit-exact Triton decode of the trellis to fp16 ``W_inner`` in a
  scratch buffer, the input Hadamard in fp32, an fp16 GEMM with fp32 accumulation, the output Hadamard in fp32.

``Exl3DenseLinear`` holds the parts of one vLLM linear (several for a fused one such as ``fused_wqa_wkv``:
each part is its own EXL3 tensor, with its own sign vectors, so they run one after the other) and returns the
concatenation in the activations' dtype. ``benches/bench_dense_exl3.py`` times both backends per V4.1 shape.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal, Protocol

import torch

from cpu_tier.exl3 import Exl3Tensor

__all__ = ["Exl3DenseLinear", "Exllamav3Kernel", "TritonKernel", "exllamav3_available", "make_kernel"]


class DenseKernel(Protocol):
    """One EXL3 tensor on the GPU, callable on fp32/bf16/fp16 ``[M, k]`` activations -> fp32 ``[M, n]``."""

    k: int
    n: int
    name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def _device_tensors(t: Exl3Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    out = {
        "trellis": torch.from_numpy(t.trellis).to(device),
        "suh": torch.from_numpy(t.suh).to(device),
        "svh": torch.from_numpy(t.svh).to(device),
    }
    if t.bias is not None:
        out["bias"] = torch.from_numpy(t.bias).to(device=device, dtype=torch.float32)
    return out


@functools.cache
def exllamav3_available() -> bool:
    """Whether exllamav3's CUDA extension imports here (prebuilt, or compiled on first import)."""
    if not torch.cuda.is_available():
        return False
    # Importing the exllamav3 package switches the process-wide CUDA caching allocator to expandable segments
    # (its __init__), under vLLM's memory pools and CUDA graphs; its own switch turns that off.
    os.environ.setdefault("EXL3_EXPANDABLE_SEGMENTS", "0")
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


class Exllamav3Kernel:
    """exllamav3's EXL3 kernels for one tensor (its ``LinearEXL3``; fp16 in, fp32 out)."""

    backend = "exllamav3"

    def __init__(self, t: Exl3Tensor, device: torch.device, name: str = "exl3") -> None:
        from exllamav3.modules.quant.exl3 import LinearEXL3

        d = _device_tensors(t, device)
        self.k, self.n, self.name = t.k, t.n, name
        self.bias = d.pop("bias", None)
        marker = torch.zeros((), dtype=torch.int32, device=device)
        self._lin = LinearEXL3(
            None, t.k, t.n, suh=d["suh"], svh=d["svh"], trellis=d["trellis"],
            mcg=marker if t.codebook == "mcg" else None, mul1=marker if t.codebook == "mul1" else None,
            out_dtype=torch.float32, key=name,
        )  # fmt: skip
        self.warm()

    #: Row counts that reach every launch configuration exllamav3's fused GEMM tunes: it keys its autotune on the
    #: rows rounded up to a power of two to 16 (at least 2), then to a multiple of 16 capped at 64.
    TUNED_ROWS = (2, 4, 8, 16, 32, 48, 64)

    def warm(self) -> None:
        """Tune exllamav3's fused GEMM for this tensor at every row bucket now, eagerly. Its autotuner times the
        candidates on the first call of a (rows bucket, shape), with stream syncs: inside a CUDA graph capture that
        invalidates the capture (vLLM's PIECEWISE graphs capture batch sizes that no eager warm-up ran at this
        layer). Tuned shapes are cached by exllamav3 in memory and on disk, so each shape tunes once."""
        dev = self._lin.trellis.device
        if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        for m in self.TUNED_ROWS:
            self(torch.zeros((m, self.k), dtype=torch.float16, device=dev))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from exllamav3.modules.quant.exl3 import AUTO_RECONSTRUCT_THRESHOLD

        # exllamav3's fused trellis GEMM writes fp32; its reconstruct + hgemm path (more rows) writes fp16.
        out = torch.float32 if x.shape[0] <= AUTO_RECONSTRUCT_THRESHOLD else torch.float16
        y = self._lin.forward(x.to(torch.float16).contiguous(), {}, out_dtype=out).float()
        return y if self.bias is None else y + self.bias

    @property
    def trellis_bytes(self) -> int:
        return int(self._lin.trellis.numel() * 2)


class TritonKernel:
    """Ours: Triton decode of the whole trellis to fp16 per call, fp32 Hadamards, fp16 GEMM (fp32 accumulate)."""

    backend = "triton"

    def __init__(self, t: Exl3Tensor, device: torch.device, name: str = "exl3") -> None:
        d = _device_tensors(t, device)
        self.k, self.n, self.name = t.k, t.n, name
        self.codebook = t.codebook
        self.trellis = d["trellis"]
        self.suh = d["suh"].float()
        self.svh = d["svh"].float()
        self.bias = d.get("bias")
        from dma_prefill.ops_torch import hadamard_pm1

        self.h128 = hadamard_pm1(torch.float32, device) * (1.0 / 128**0.5)

    def _had(self, v: torch.Tensor) -> torch.Tensor:
        """Blockwise orthonormal Hadamard-128 over the last dim (the matrix lives on the device: graph-capturable)."""
        return (v.reshape(*v.shape[:-1], v.shape[-1] // 128, 128) @ self.h128).reshape(v.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from dma_prefill.triton_ops import decode_triton

        w = decode_triton(self.trellis, self.codebook)  # fp16 W_inner (k, n)
        xh = self._had(x.float() * self.suh).to(torch.float16)
        y = _matmul_f32(xh, w)
        y = self._had(y) * self.svh
        return y if self.bias is None else y + self.bias

    @property
    def trellis_bytes(self) -> int:
        return int(self.trellis.numel() * 2)


def _has_out_dtype() -> bool:
    try:
        mm: Any = torch.matmul  # out_dtype is newer than torch's type stubs
        mm(torch.zeros(1, 1, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.float16), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


_HAS_OUT_DTYPE = _has_out_dtype()


def _matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 x fp16 with fp32 accumulation and an fp32 result (upcast when torch lacks ``out_dtype``)."""
    if _HAS_OUT_DTYPE:
        mm: Any = torch.matmul
        return mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


Backend = Literal["auto", "exllamav3", "triton"]


def make_kernel(t: Exl3Tensor, device: torch.device, backend: Backend, name: str = "exl3") -> DenseKernel:
    """The kernel for one EXL3 tensor: ``backend`` "auto" takes exllamav3's where it imports, else ours."""
    if backend == "auto":
        backend = "exllamav3" if exllamav3_available() else "triton"
    if backend == "exllamav3":
        if not exllamav3_available():
            raise RuntimeError(f"{name}: dense_kernel 'exllamav3' asked for, but exllamav3's CUDA extension "
                               "does not import here (pip install exllamav3, or dense_kernel 'triton')")  # fmt: skip
        return Exllamav3Kernel(t, device, name)
    if backend == "triton":
        return TritonKernel(t, device, name)
    raise ValueError(f"{name}: unknown dense kernel backend {backend!r}")


class Exl3DenseLinear:
    """A vLLM linear made of one or more EXL3 tensors (its output parts, in order) on the GPU.

    ``__call__(x)`` takes ``[..., k]`` activations and returns ``[..., sum(n)]`` in ``x.dtype``.
    """

    def __init__(self, parts: list[Exl3Tensor], device: torch.device, backend: Backend, names: list[str]) -> None:
        if not parts:
            raise ValueError("Exl3DenseLinear needs at least one EXL3 tensor")
        k = parts[0].k
        for t, n in zip(parts, names, strict=True):
            if t.k != k:
                raise ValueError(f"{n}: input size {t.k} differs from the first part's {k}")
        self.k = k
        self.n = sum(t.n for t in parts)
        self.kernels = [make_kernel(t, device, backend, n) for t, n in zip(parts, names, strict=True)]
        self.backend = self.kernels[0].backend  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.k)
        ys = [kern(x2) for kern in self.kernels]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y.to(x.dtype).reshape(*shape[:-1], self.n)

    @property
    def trellis_bytes(self) -> int:
        return sum(k.trellis_bytes for k in self.kernels)  # type: ignore[attr-defined]
