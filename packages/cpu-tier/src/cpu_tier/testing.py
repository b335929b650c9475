"""Reference computations for testing the native kernels (float64, built on cpu_tier.exl3)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import exl3


def ref_expert(
    x: np.ndarray, gate: exl3.Exl3Tensor, up: exl3.Exl3Tensor, down: exl3.Exl3Tensor, limit: float | None
) -> np.ndarray:
    """float64 ``down(silu(min(gate(x), L)) * clamp(up(x), -L, L))`` for rows x; limit None = no clamp."""
    g = gate.linear(x).astype(np.float64)
    u = up.linear(x).astype(np.float64)
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    a = g / (1.0 + np.exp(-g)) * u
    out = a @ down.reconstruct().astype(np.float64)
    if down.bias is not None:
        out = out + down.bias.astype(np.float64)
    return out


def ref_moe(
    x: np.ndarray, picks: Any, experts: tuple[list, list, list], limit: float | None, only: np.ndarray | None = None
) -> np.ndarray:
    """float64 sum over picks (or over the pick indices ``only``) of weight * expert(x[token])."""
    gate, up, down = experts
    out = np.zeros((x.shape[0], gate[0].k), dtype=np.float64)
    idx = range(len(picks.tokens)) if only is None else only
    for i in idx:
        t, e, w = int(picks.tokens[i]), int(picks.experts[i]), float(picks.weights[i])
        out[t] += w * ref_expert(x[t : t + 1], gate[e], up[e], down[e], limit)[0]
    return out


def rel_max(y: np.ndarray, ref: np.ndarray) -> float:
    """max |y - ref| / max |ref|."""
    return float(np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def rel_rms(y: np.ndarray, ref: np.ndarray) -> float:
    """||y - ref|| / ||ref||."""
    return float(np.sqrt(np.mean((y.astype(np.float64) - ref) ** 2) / np.mean(ref**2)))


def make_experts(n: int, hidden: int, inter: int, bits: float, codebook: str, seed: int) -> tuple[list, list, list]:
    """n random experts: gate/up (hidden -> inter), down (inter -> hidden)."""
    rng = np.random.default_rng(seed)
    gate = [exl3.random_tensor(hidden, inter, bits, codebook, seed=rng) for _ in range(n)]  # type: ignore[arg-type]
    up = [exl3.random_tensor(hidden, inter, bits, codebook, seed=rng) for _ in range(n)]  # type: ignore[arg-type]
    down = [exl3.random_tensor(inter, hidden, bits, codebook, seed=rng) for _ in range(n)]  # type: ignore[arg-type]
    return gate, up, down
