"""``PrefillPlan``: what one MoE layer of a prefill chunk routes, and in which batches it streams.

Experts are cut into fixed batches of B consecutive ids (batch b = experts ``[b*B, (b+1)*B)``), so a batch is
one contiguous range of host records (one DMA) and the first batches of the next layer can be copied before
its routing is known (cross-layer prefetch). Routes are sorted by expert (stable), so the rows of one expert,
and of one batch, are contiguous in the sorted order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["PrefillPlan"]


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillPlan:
    """Routing of one layer for one chunk.

    Attributes
    ----------
    num_tokens, top_k, num_experts, experts_per_batch : sizes.
    counts : int64 ``[E]`` (host): rows routed to each expert.
    offsets : int64 ``[E+1]`` (host): start of each expert's rows in the sorted route order.
    sorted_tokens : int64 ``[T*top_k]`` (device of the routing): token of each route, sorted by expert.
    sorted_experts : int64 ``[T*top_k]``: expert of each sorted route.
    sorted_weights : float32 ``[T*top_k]``: routing weight of each sorted route.
    gpu_batches : batches streamed and computed on the GPU, in stream order.
    cpu_batches : trailing batches left to the CPU tier (hybrid steps).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    experts_per_batch: int
    counts: np.ndarray
    offsets: np.ndarray
    sorted_tokens: torch.Tensor
    sorted_experts: torch.Tensor
    sorted_weights: torch.Tensor
    gpu_batches: tuple[int, ...]
    cpu_batches: tuple[int, ...]

    @classmethod
    def build(
        cls,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        experts_per_batch: int,
        cpu_tail_batches: int = 0,
    ) -> PrefillPlan:
        """Sort routes by expert and choose the batches.

        Parameters
        ----------
        topk_ids : integer ``[T, top_k]``, expert ids in ``[0, num_experts)``; a negative id is no route (vLLM
            marks the rows a CUDA graph pads a batch with by -1): it is sorted before every expert's rows and no
            batch reads it.
        topk_weights : float ``[T, top_k]``, same device.
        num_experts : E of the layer.
        experts_per_batch : B.
        cpu_tail_batches : the last k batches that route anything go to the CPU tier.

        One device-to-host transfer (the counts) synchronises with the routing's stream.
        """
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights shape {tuple(topk_weights.shape)} differs from topk_ids {tuple(topk_ids.shape)}"
            )
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        if topk_weights.device != topk_ids.device:
            raise ValueError(f"topk_weights on {topk_weights.device}, topk_ids on {topk_ids.device}")
        if num_experts <= 0 or experts_per_batch <= 0 or cpu_tail_batches < 0:
            raise ValueError(
                f"need num_experts > 0, experts_per_batch > 0, cpu_tail_batches >= 0; got "
                f"{num_experts}, {experts_per_batch}, {cpu_tail_batches}"
            )
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        bad = (flat >= num_experts).sum().view(1)
        skipped = (flat < 0).sum().view(1)
        clamped = flat.clamp(0, num_experts - 1)
        counts_dev = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts_dev.index_add_(0, clamped, (flat >= 0).to(torch.int64))
        host = torch.cat([counts_dev, skipped, bad]).cpu().numpy()
        if host[-1]:
            lo, hi = int(flat.min()), int(flat.max())
            raise ValueError(f"topk_ids: {int(host[-1])} expert ids outside [0, {num_experts}) (min {lo}, max {hi})")
        counts = host[:-2].astype(np.int64)
        sorted_experts, order = torch.sort(flat, stable=True)  # the negative ids (no route) first
        offsets = np.full(num_experts + 1, int(host[-2]), dtype=np.int64)
        offsets[1:] += np.cumsum(counts)
        nb = -(-num_experts // experts_per_batch)
        per_batch = np.add.reduceat(counts, np.arange(0, num_experts, experts_per_batch))
        busy = [b for b in range(nb) if per_batch[b] > 0]
        n_cpu = min(cpu_tail_batches, len(busy))
        return cls(
            num_tokens=T,
            top_k=k,
            num_experts=num_experts,
            experts_per_batch=experts_per_batch,
            counts=counts,
            offsets=offsets,
            sorted_tokens=torch.div(order, k, rounding_mode="floor"),
            sorted_experts=sorted_experts,
            sorted_weights=topk_weights.reshape(-1)[order].to(torch.float32),
            gpu_batches=tuple(busy[: len(busy) - n_cpu]),
            cpu_batches=tuple(busy[len(busy) - n_cpu :]),
        )

    @property
    def num_batches(self) -> int:
        return -(-self.num_experts // self.experts_per_batch)

    def batch_range(self, b: int) -> tuple[int, int]:
        """Expert ids ``[e0, e1)`` of batch ``b``."""
        if not 0 <= b < self.num_batches:
            raise IndexError(f"batch {b} out of range [0, {self.num_batches})")
        e0 = b * self.experts_per_batch
        return e0, min(self.num_experts, e0 + self.experts_per_batch)

    def routed(self, b: int) -> np.ndarray:
        """Experts of batch ``b`` with at least one routed row."""
        e0, e1 = self.batch_range(b)
        return np.nonzero(self.counts[e0:e1])[0] + e0

    def runs(self, b: int) -> list[tuple[int, int]]:
        """Maximal runs ``[e0, e1)`` of consecutive routed experts in batch ``b`` (one DMA each)."""
        out: list[tuple[int, int]] = []
        for e in self.routed(b).tolist():
            if out and out[-1][1] == e:
                out[-1] = (out[-1][0], e + 1)
            else:
                out.append((e, e + 1))
        return out

    def rows(self, e: int) -> tuple[int, int]:
        """Sorted-route rows ``[r0, r1)`` of expert ``e``."""
        return int(self.offsets[e]), int(self.offsets[e + 1])

    def batch_rows(self, b: int) -> tuple[int, int]:
        e0, e1 = self.batch_range(b)
        return int(self.offsets[e0]), int(self.offsets[e1])

    @property
    def cpu_experts(self) -> np.ndarray:
        """Routed experts of the CPU-tail batches."""
        parts = [self.routed(b) for b in self.cpu_batches]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def gpu_experts(self) -> np.ndarray:
        parts = [self.routed(b) for b in self.gpu_batches]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
