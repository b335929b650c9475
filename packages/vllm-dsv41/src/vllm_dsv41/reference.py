"""Pure-numpy references the plugin is checked against (float64 inside, no vLLM, no native code).

* ``ReferenceExperts``: routed experts of one or more MoE layers from EXL3 tensors, via ``cpu_tier.exl3``;
  the same contract as ``cpu_tier.ExpertTier`` (``add_layer`` then a weighted sum over the picks).
* ``ReferenceDemoModel``: the full forward of the ``tiny-demo`` pack's architecture (Qwen3-MoE: RMSNorm,
  per-head q/k RMSNorm, NeoX RoPE, causal GQA attention, softmax top-k routing with renormalisation,
  SwiGLU experts), read straight from the pack's files. Its logits are what the served model must produce.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cpu_tier.exl3 import Exl3Tensor

__all__ = ["ReferenceDemoModel", "ReferenceExperts", "swiglu"]


def swiglu(g: np.ndarray, u: np.ndarray, limit: float | None) -> np.ndarray:
    """``silu(g) * u``; with a limit, DeepSeek's clamp first: ``g <= limit`` and ``-limit <= u <= limit``."""
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g / (1.0 + np.exp(-g)) * u


class ReferenceExperts:
    """Routed experts computed from dequantized EXL3 weights in float64.

    ``add_layer(layer, gate, up, down, swiglu_limit)`` takes one ``Exl3Tensor`` per expert and projection
    (gate/up: ``(H, I)``, down: ``(I, H)``, ``y = x @ W``); ``forward(layer, x, topk_ids, topk_weights)``
    returns ``sum_j w[t, j] * down(swiglu(gate(x_t), up(x_t)))`` over the picks ``j`` of token ``t``.
    """

    def __init__(self) -> None:
        self._layers: dict[int, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], float | None]] = {}

    def add_layer(
        self,
        layer: int,
        gate: Sequence[Exl3Tensor],
        up: Sequence[Exl3Tensor],
        down: Sequence[Exl3Tensor],
        swiglu_limit: float | None = None,
    ) -> None:
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ValueError(f"layer {layer}: need the same non-zero number of gate/up/down experts")
        w = [[t.reconstruct().astype(np.float64) for t in ts] for ts in (gate, up, down)]
        self._layers[layer] = (w[0], w[1], w[2], swiglu_limit)

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def forward(self, layer: int, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
        """``x`` ``[T, H]``, ``topk_ids`` int ``[T, k]``, ``topk_weights`` ``[T, k]`` -> float64 ``[T, H]``."""
        wg, wu, wd, limit = self._layers[layer]
        x = np.asarray(x, dtype=np.float64)
        ids = np.asarray(topk_ids)
        wts = np.asarray(topk_weights, dtype=np.float64)
        out = np.zeros((x.shape[0], wd[0].shape[1]), dtype=np.float64)
        for e in np.unique(ids[ids >= 0]):  # a negative id (vLLM's padding rows) is no pick
            rows, slots = np.nonzero(ids == e)
            xe = x[rows]
            h = swiglu(xe @ wg[e], xe @ wu[e], limit)
            np.add.at(out, rows, (h @ wd[e]) * wts[rows, slots][:, None])
        return out


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """NeoX-style rotary embedding over the last dimension of ``x`` ``[T, heads, D]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ReferenceDemoModel:
    """The ``tiny-demo`` pack's model (Qwen3-MoE layout, EXL3 attention and experts) in float64 numpy."""

    def __init__(self, pack_dir: str | Path) -> None:
        from safetensors.numpy import load_file

        pack_dir = Path(pack_dir)
        self.config: dict[str, Any] = json.loads((pack_dir / "config.json").read_text())
        c = self.config
        self.eps = float(c["rms_norm_eps"])
        self.theta = float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        self.heads, self.kv_heads = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
        self.head_dim = int(c.get("head_dim") or c["hidden_size"] // self.heads)
        self.top_k, self.renormalize = int(c["num_experts_per_tok"]), bool(c["norm_topk_prob"])
        raw = load_file(str(pack_dir / "model.safetensors"))
        self._t = {k: v.astype(np.float64) for k, v in raw.items() if v.dtype.kind == "f" and "." in k}
        self.experts = ReferenceExperts()
        self._attn: dict[tuple[int, str], np.ndarray] = {}
        for i in range(int(c["num_hidden_layers"])):
            p = f"model.layers.{i}"
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                self._attn[(i, name)] = self._linear_weight(raw, f"{p}.self_attn.{name}")
            n = int(c["num_experts"])
            gate, up, down = (
                [Exl3Tensor.from_safetensors(raw, f"{p}.mlp.experts.{e}.{proj}") for e in range(n)]
                for proj in ("gate_proj", "up_proj", "down_proj")
            )
            self.experts.add_layer(i, gate, up, down)

    @staticmethod
    def _linear_weight(raw: dict[str, np.ndarray], prefix: str) -> np.ndarray:
        """``W`` ``(in, out)`` of a linear stored as EXL3 or as a plain ``.weight`` ``(out, in)``."""
        if f"{prefix}.trellis" in raw:
            return Exl3Tensor.from_safetensors(raw, prefix).reconstruct().astype(np.float64)
        return raw[f"{prefix}.weight"].astype(np.float64).T

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float64 logits ``[T, vocab]`` of one causal sequence (position ``t`` predicts token ``t+1``)."""
        t = self._t
        ids = np.asarray(token_ids, dtype=np.int64)
        pos = np.arange(len(ids))
        h = t["model.embed_tokens.weight"][ids]
        group = self.heads // self.kv_heads
        mask = np.triu(np.full((len(ids), len(ids)), -np.inf), k=1)
        for i in range(int(self.config["num_hidden_layers"])):
            p = f"model.layers.{i}"
            x = _rms_norm(h, t[f"{p}.input_layernorm.weight"], self.eps)
            q = (x @ self._attn[(i, "q_proj")]).reshape(len(ids), self.heads, self.head_dim)
            k = (x @ self._attn[(i, "k_proj")]).reshape(len(ids), self.kv_heads, self.head_dim)
            v = (x @ self._attn[(i, "v_proj")]).reshape(len(ids), self.kv_heads, self.head_dim)
            q = _rope(_rms_norm(q, t[f"{p}.self_attn.q_norm.weight"], self.eps), pos, self.theta)
            k = _rope(_rms_norm(k, t[f"{p}.self_attn.k_norm.weight"], self.eps), pos, self.theta)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.head_dim) + mask[None]
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            a = np.einsum("hts,shd->thd", s / s.sum(axis=-1, keepdims=True), v).reshape(len(ids), -1)
            h = h + a @ self._attn[(i, "o_proj")]
            x = _rms_norm(h, t[f"{p}.post_attention_layernorm.weight"], self.eps)
            r = x @ t[f"{p}.mlp.gate.weight"].T
            probs = np.exp(r - r.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]
            w = np.take_along_axis(probs, top, axis=-1)
            if self.renormalize:
                w = w / w.sum(axis=-1, keepdims=True)
            h = h + self.experts.forward(i, x, top, w)
        h = _rms_norm(h, t["model.norm.weight"], self.eps)
        return h @ t["lm_head.weight"].T

    def logprobs(self, token_ids: Sequence[int]) -> np.ndarray:
        """log-softmax of :meth:`logits`, float64 ``[T, vocab]``."""
        z = self.logits(token_ids)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
