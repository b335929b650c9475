"""Routing traces: the ``.npz`` format, a recorder for servers, and a synthetic generator.

Format (version 1), one ``.npz`` file:

==================  ============================  ==========================================================
array               dtype / shape                 meaning
==================  ============================  ==========================================================
``format``          str                           ``"expert-cache-trace"``
``version``         int64 scalar                  1
``num_experts``     int64 scalar                  routed experts per layer (E)
``ids``             int16 ``[N, L, K]``           routed expert ids of N recorded tokens, L MoE layers, top-K
``rows_per_step``   int32 ``[S]``                 how many of ``ids``' rows belong to each engine step (in order)
``tokens_per_step`` int32 ``[S]``                 tokens scheduled in each step (>= rows; a recorder may keep
                                                  only a sample of a prefill step's rows, or none)
``meta_json``       str                           JSON: ``source`` ("synthetic" or e.g. "server"), free-form
                                                  details (generator parameters, model, date)
==================  ============================  ==========================================================

Steps with more than ``prefill_tokens`` scheduled tokens are prefill steps for the cache; their rows (if any) can
feed the policy (``observe_prefill``). A server records a real trace with :class:`TraceRecorder`: call
``record_step(num_tokens, ids)`` once per engine step with the router's top-k ids stacked over the MoE layers.

Synthetic traces are **not** real routing: :func:`generate` draws them from a model with knobs for global skew,
per-request skew, token-to-token locality and drift (see :class:`SyntheticTraceConfig`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from cpu_tier.geometry import V41_FLASH

__all__ = ["SyntheticTraceConfig", "Trace", "TraceRecorder", "generate", "load_trace", "repeated_experts"]

FORMAT = "expert-cache-trace"
VERSION = 1


def repeated_experts(ids: np.ndarray) -> np.ndarray:
    """bool ``[N, L]``: where row ``n`` routes some expert twice in layer ``l`` (``ids`` ``[N, L, K]``). A trace
    refuses such rows (:meth:`Trace.create`); a recorder of live routing can leave them out with this mask."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"ids must be [N, L, K], got shape {ids.shape}")
    srt = np.sort(ids, axis=2)
    return np.any(srt[:, :, 1:] == srt[:, :, :-1], axis=2)


@dataclasses.dataclass(frozen=True)
class Trace:
    """A routing trace (see the module docstring for the arrays). Construct with validation via :meth:`create`."""

    ids: np.ndarray
    rows_per_step: np.ndarray
    tokens_per_step: np.ndarray
    num_experts: int
    meta: dict[str, Any]

    @classmethod
    def create(
        cls,
        ids: np.ndarray,
        rows_per_step: np.ndarray,
        tokens_per_step: np.ndarray,
        num_experts: int,
        meta: dict[str, Any] | None = None,
        where: str = "trace",
    ) -> Trace:
        """Validate and build a trace; errors name ``where`` and the offending array."""
        ids = np.asarray(ids)
        rows = np.asarray(rows_per_step)
        toks = np.asarray(tokens_per_step)
        if ids.ndim != 3:
            raise ValueError(f"{where}: ids must be [N, L, K], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{where}: ids must be integers, got {ids.dtype}")
        if rows.ndim != 1 or toks.ndim != 1 or rows.shape != toks.shape:
            raise ValueError(
                f"{where}: rows_per_step and tokens_per_step must be 1-D of equal length, "
                f"got {rows.shape} and {toks.shape}"
            )
        if not np.issubdtype(rows.dtype, np.integer) or not np.issubdtype(toks.dtype, np.integer):
            raise ValueError(f"{where}: rows_per_step and tokens_per_step must be integers")
        if rows.size and (rows.min() < 0 or toks.min() < 0):
            raise ValueError(f"{where}: rows_per_step and tokens_per_step must be >= 0")
        if np.any(rows > toks):
            s = int(np.flatnonzero(rows > toks)[0])
            raise ValueError(f"{where}: rows_per_step[{s}] = {rows[s]} exceeds tokens_per_step[{s}] = {toks[s]}")
        if int(rows.sum()) != ids.shape[0]:
            raise ValueError(f"{where}: rows_per_step sums to {int(rows.sum())}, ids has {ids.shape[0]} rows")
        if not isinstance(num_experts, (int, np.integer)) or num_experts < 1 or num_experts > 32767:
            raise ValueError(f"{where}: num_experts must be in [1, 32767], got {num_experts}")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_experts:
                raise ValueError(f"{where}: ids must be in [0, {num_experts}), found values in [{lo}, {hi}]")
            if ids.shape[2] > 1:
                dup = repeated_experts(ids)
                if dup.any():
                    r, layer = (int(v[0]) for v in np.nonzero(dup))
                    raise ValueError(
                        f"{where}: ids row {r} layer {layer} routes the same expert twice: {ids[r, layer].tolist()}"
                    )
        return cls(
            ids.astype(np.int16, copy=False),
            rows.astype(np.int32, copy=False),
            toks.astype(np.int32, copy=False),
            int(num_experts),
            dict(meta or {}),
        )

    @property
    def num_layers(self) -> int:
        """MoE layers (L)."""
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        """Experts routed per token and layer (K)."""
        return int(self.ids.shape[2])

    @property
    def num_steps(self) -> int:
        """Engine steps (S)."""
        return int(self.rows_per_step.shape[0])

    def step_ids(self, step: int) -> np.ndarray:
        """int16 ``[rows, L, K]``: the recorded routing of one step."""
        off = self._offsets()
        return self.ids[off[step] : off[step + 1]]

    def _offsets(self) -> np.ndarray:
        off = np.zeros(self.num_steps + 1, np.int64)
        np.cumsum(self.rows_per_step, out=off[1:])
        return off

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the ``.npz`` file (uncompressed)."""
        np.savez(
            path,
            format=np.array(FORMAT),
            version=np.int64(VERSION),
            num_experts=np.int64(self.num_experts),
            ids=self.ids,
            rows_per_step=self.rows_per_step,
            tokens_per_step=self.tokens_per_step,
            meta_json=np.array(json.dumps(self.meta, sort_keys=True)),
        )


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file; errors name the file and the array."""
    where = os.fspath(path)
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a readable .npz file ({e})") from e
    with z:
        need = ("format", "version", "num_experts", "ids", "rows_per_step", "tokens_per_step")
        missing = [k for k in need if k not in z.files]
        if missing:
            raise ValueError(f"{where}: missing array(s) {missing}; is this an expert-cache trace?")
        if str(z["format"]) != FORMAT:
            raise ValueError(f"{where}: format is {str(z['format'])!r}, expected {FORMAT!r}")
        if int(z["version"]) != VERSION:
            raise ValueError(f"{where}: version {int(z['version'])} is not supported (this reader knows {VERSION})")
        meta = json.loads(str(z["meta_json"])) if "meta_json" in z.files else {}
        return Trace.create(z["ids"], z["rows_per_step"], z["tokens_per_step"], int(z["num_experts"]), meta, where)


class TraceRecorder:
    """Collects a trace step by step (for a server: one call per engine step).

    Parameters
    ----------
    num_layers, num_experts, top_k
        Routing geometry.
    max_rows_per_step
        Keep at most this many token rows of a step (evenly spaced); 0 keeps all.
    meta
        Stored as ``meta_json`` (``source`` defaults to ``"server"``).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        max_rows_per_step: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.shape = (int(num_layers), int(top_k))
        self.num_experts = int(num_experts)
        self.max_rows = int(max_rows_per_step)
        self.meta = {"source": "server", **(meta or {})}
        self._ids: list[np.ndarray] = []
        self._rows: list[int] = []
        self._toks: list[int] = []

    def record_step(self, num_tokens: int, ids: np.ndarray | None) -> None:
        """Record one step: ``ids`` int ``[rows, L, K]`` (rows <= num_tokens), or None to record no routing."""
        if ids is None:
            ids = np.zeros((0, *self.shape), np.int16)
        ids = np.asarray(ids)
        if ids.ndim != 3 or ids.shape[1:] != self.shape:
            raise ValueError(f"ids: expected [rows, {self.shape[0]}, {self.shape[1]}], got {ids.shape}")
        if ids.shape[0] > num_tokens:
            raise ValueError(f"ids: {ids.shape[0]} rows for a step of {num_tokens} tokens")
        if self.max_rows and ids.shape[0] > self.max_rows:
            ids = ids[np.linspace(0, ids.shape[0] - 1, self.max_rows).round().astype(np.int64)]
        self._ids.append(ids.astype(np.int16))
        self._rows.append(ids.shape[0])
        self._toks.append(int(num_tokens))

    def trace(self) -> Trace:
        """The validated trace recorded so far."""
        ids = np.concatenate(self._ids) if self._ids else np.zeros((0, *self.shape), np.int16)
        return Trace.create(
            ids, np.array(self._rows, np.int32), np.array(self._toks, np.int32), self.num_experts, self.meta, "recorder"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticTraceConfig:
    """Parameters of the synthetic routing model (a model, not a measurement).

    Each of ``streams`` concurrent streams serves requests one after another. A request has a prompt of
    ~``mean_prompt_tokens`` tokens (one prefill step; ``prefill_rows`` of its token rows are recorded) and
    ~``mean_decode_tokens`` decode tokens (both geometric); a prompt of at most ``full_rows_below`` tokens has all
    its rows recorded (it is a decode-path step for a cache whose ``prefill_tokens`` is that value). A decode step
    routes one token per active stream. Every
    token picks ``top_k`` distinct experts per layer by Gumbel-top-k sampling from the logits

        ``-zipf_global * log(rank_global[l, e]) - zipf_request * log(rank_request[l, e]) + locality * prev[l, e]``

    where ``rank_global`` is a fixed random ranking per layer (1 = most popular), ``rank_request`` a fresh random
    ranking per layer and request, and ``prev`` marks the experts the stream's previous token picked in that
    layer. ``drift``: per layer and 100 decode steps, the expected number of times a random expert of a request's
    top 32 swaps rank with a random expert. ``prompt_match``: the probability that a prompt token is drawn from
    the request's decode distribution rather than from a prompt-only ranking (how much prefill routing predicts
    decode routing; unknown for real models).
    """

    num_layers: int = V41_FLASH.num_layers
    num_experts: int = V41_FLASH.num_experts
    top_k: int = V41_FLASH.top_k
    decode_steps: int = 4000
    streams: int = 1
    zipf_global: float = 0.3
    zipf_request: float = 1.0
    locality: float = 1.0
    drift: float = 0.0
    mean_decode_tokens: float = 1500.0
    mean_prompt_tokens: float = 2000.0
    prefill_rows: int = 256
    full_rows_below: int = 512
    prompt_match: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_experts", "top_k", "decode_steps", "streams"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: must be an int >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: must be <= num_experts ({self.num_experts}), got {self.top_k}")
        if self.num_experts > 32767:
            raise ValueError(f"num_experts: must be <= 32767, got {self.num_experts}")
        for f in ("zipf_global", "zipf_request", "locality", "drift"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0 <= v < 1e6):
                raise ValueError(f"{f}: must be a number >= 0, got {v!r}")
        for f in ("mean_decode_tokens", "mean_prompt_tokens"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v >= 1):
                raise ValueError(f"{f}: must be >= 1, got {v!r}")
        if not isinstance(self.prefill_rows, int) or self.prefill_rows < 0:
            raise ValueError(f"prefill_rows: must be an int >= 0, got {self.prefill_rows!r}")
        if not isinstance(self.full_rows_below, int) or self.full_rows_below < 0:
            raise ValueError(f"full_rows_below: must be an int >= 0, got {self.full_rows_below!r}")
        if not (isinstance(self.prompt_match, (int, float)) and 0 <= self.prompt_match <= 1):
            raise ValueError(f"prompt_match: must be in [0, 1], got {self.prompt_match!r}")


def _rank_logits(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    """``-s * log(rank)`` with an independent random ranking per layer: float64 ``[L, E]``."""
    ranks = np.argsort(rng.random((layers, experts)), axis=1).argsort(axis=1) + 1
    return (-s * np.log(ranks)).astype(np.float32)


def _topk_sample(rng: np.random.Generator, logits: np.ndarray, k: int) -> np.ndarray:
    """Gumbel-top-k: ``k`` distinct indices per row of ``logits[..., E]`` drawn without replacement."""
    u = rng.random(logits.shape, dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)
    g = np.log(u)
    np.negative(g, out=g)
    np.log(g, out=g)  # log(-log u) = -Gumbel
    g -= logits  # -(logits + Gumbel)
    return np.argpartition(g, k - 1, axis=-1)[..., :k]


def generate(cfg: SyntheticTraceConfig) -> Trace:
    """Draw a synthetic trace (see :class:`SyntheticTraceConfig`). Deterministic for a given config."""
    rng = np.random.default_rng(cfg.seed)
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    glog = _rank_logits(rng, L, E, cfg.zipf_global)
    p_end = 1.0 / cfg.mean_decode_tokens
    req = np.zeros((cfg.streams, L, E), np.float32)
    prev = np.zeros((cfg.streams, L, E), np.float32)
    left = np.zeros(cfg.streams, np.int64)  # decode tokens left in the stream's request
    ids: list[np.ndarray] = []
    rows: list[int] = []
    toks: list[int] = []
    decode_done = 0
    lidx = np.arange(L)[:, None]
    while decode_done < cfg.decode_steps:
        for s in np.flatnonzero(left == 0).tolist():  # new requests: one prefill step each
            req[s] = _rank_logits(rng, L, E, cfg.zipf_request)
            prev[s] = 0.0
            left[s] = rng.geometric(p_end)
            n_prompt = max(1, int(rng.geometric(1.0 / cfg.mean_prompt_tokens)))
            r = n_prompt if n_prompt <= cfg.full_rows_below else min(cfg.prefill_rows, n_prompt)
            if r:
                other = _rank_logits(rng, L, E, cfg.zipf_request)
                match = rng.random(r) < cfg.prompt_match
                lg = np.where(match[:, None, None], (glog + req[s])[None], (glog + other)[None])
                ids.append(_topk_sample(rng, lg, K).astype(np.int16))
            rows.append(r)
            toks.append(n_prompt)
        lg = glog[None] + req + np.float32(cfg.locality) * prev
        pick = _topk_sample(rng, lg, K)  # [streams, L, K]
        prev[:] = 0.0
        for s in range(cfg.streams):
            prev[s][lidx, pick[s]] = 1.0
        ids.append(pick.astype(np.int16))
        rows.append(cfg.streams)
        toks.append(cfg.streams)
        left -= 1
        decode_done += 1
        if cfg.drift:
            n = rng.poisson(cfg.drift / 100.0 * L * cfg.streams)
            for _ in range(int(n)):
                s, layer = int(rng.integers(cfg.streams)), int(rng.integers(L))
                row = req[s, layer]
                top = np.argpartition(-row, 31)[:32] if E > 32 else np.arange(E)
                a, b = int(rng.choice(top)), int(rng.integers(E))
                row[a], row[b] = row[b], row[a]
    meta = {"source": "synthetic", "generator": dataclasses.asdict(cfg)}
    return Trace.create(np.concatenate(ids), np.array(rows, np.int32), np.array(toks, np.int32), E, meta, "generate")


def main(argv: list[str] | None = None) -> int:
    """``python -m expert_cache.trace --out T.npz [--streams 4 --drift 5 ...]``: write a synthetic trace."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m expert_cache.trace", description="Write a synthetic routing trace (.npz)."
    )
    ap.add_argument("--out", required=True)
    for f in dataclasses.fields(SyntheticTraceConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    try:
        cfg = SyntheticTraceConfig(**a)
    except ValueError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2
    tr = generate(cfg)
    tr.save(out)
    print(
        f"{out}: {tr.num_steps} steps ({int((tr.tokens_per_step > cfg.full_rows_below).sum())} prefill), "
        f"{tr.ids.shape[0]} rows, L={tr.num_layers} E={tr.num_experts} K={tr.top_k}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
