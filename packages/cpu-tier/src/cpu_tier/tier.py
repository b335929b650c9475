"""The public compute API: one EXL3 linear (``exl3_matmul``) and MoE layers of EXL3 experts (``ExpertTier``).

Arrays are numpy or torch CPU tensors (converted through DLPack without copies). Every compute runs in the native
worker pool with the GIL released; ``ExpertTier.submit`` returns at once with a ``Job``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from . import _loader
from .config import CpuTierConfig
from .exl3 import Exl3Tensor

__all__ = ["ExpertTier", "Job", "Picks", "StreamCall", "StreamCounters", "exl3_matmul", "selected_isa"]

_CODEBOOK_ID = {"3inst": 0, "mcg": 1, "mul1": 2}
_WAVE_CHUNKS = 64  # expert chunks (<= 8 tokens each) whose scratch is live at once


def selected_isa(config: CpuTierConfig | None = None) -> str:
    """The kernel variant ``config`` runs on this host: "scalar", "avx2", "avx512" or "amx".

    Raises ValueError when ``config.isa`` names a variant the host cannot run.
    """
    return _loader.resolve_isa((config or CpuTierConfig()).isa)


# --------------------------------------------------------------------------------------- array plumbing


def _as_numpy(a: Any, name: str) -> np.ndarray:
    """numpy array or torch CPU tensor -> numpy array sharing its memory."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__dlpack__"):
        dev = getattr(a, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            raise ValueError(f"{name}: must be on the CPU, got a tensor on {dev}")
        if hasattr(a, "detach"):
            a = a.detach()
        try:
            return np.from_dlpack(a)
        except (RuntimeError, BufferError, TypeError) as e:
            raise ValueError(f"{name}: cannot view {getattr(a, 'dtype', type(a))} as a numpy array ({e})") from None
    raise ValueError(f"{name}: expected a numpy array or a torch CPU tensor, got {type(a).__name__}")


def _f32_matrix(a: Any, name: str, cols: int, rows: int | None = None, writable: bool = False) -> np.ndarray:
    arr = _as_numpy(a, name)
    if arr.dtype != np.float32:
        raise ValueError(f"{name}: dtype must be float32, got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != cols or (rows is not None and arr.shape[0] != rows):
        want = f"({rows if rows is not None else 'T'}, {cols})"
        raise ValueError(f"{name}: shape must be {want}, got {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (row-major, no strides); use np.ascontiguousarray")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: must be writable")
    return arr


def _tensor_arrays(t: Exl3Tensor, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """The arrays the native kernels read, as views (no copy): trellis int16, suh/svh/bias as uint16."""
    if not isinstance(t, Exl3Tensor):
        raise ValueError(f"{name}: expected an Exl3Tensor, got {type(t).__name__}")
    t.validate(name)
    for field in ("trellis", "suh", "svh", "bias"):
        a = getattr(t, field)
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"{name}.{field}: must be C-contiguous (the tier references it without copying)")
    bias = None if t.bias is None else t.bias.view(np.uint16)
    return t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), bias, _CODEBOOK_ID[t.codebook]


# ------------------------------------------------------------------------------------------ runtimes

_runtimes: dict[tuple[Any, ...], Any] = {}
_runtimes_lock = threading.Lock()


def _shared_runtime(config: CpuTierConfig) -> Any:
    """A worker pool per (isa, threads, cpus, spin, AMX threshold, prefetch distance) for exl3_matmul, created on first use."""
    isa = _loader.resolve_isa(config.isa)
    key = (
        isa,
        config.resolved_threads(),
        config.cpus,
        config.spin_us,
        config.amx_min_tokens if isa == "amx" else 0,
        config.prefetch_blocks,
    )
    with _runtimes_lock:
        rt = _runtimes.get(key)
        if rt is None:
            rt = _loader.load(isa).Runtime(
                config.resolved_threads(),
                list(config.cpus),
                config.spin_us,
                amx=isa == "amx",
                amx_min_tokens=config.amx_min_tokens,
                prefetch_blocks=config.prefetch_blocks,
            )
            _runtimes[key] = rt
    return rt


def exl3_matmul(
    x: Any,
    tensor: Exl3Tensor,
    *,
    precision: Literal["exact", "fast"] = "exact",
    config: CpuTierConfig | None = None,
) -> np.ndarray:
    """``y = x @ W (+ bias)`` for one EXL3 linear through the native kernels.

    Parameters
    ----------
    x : float32 ``(m, k)``, C-contiguous (numpy or torch CPU tensor).
    tensor : the EXL3 linear (``k`` inputs, ``n`` outputs).
    precision : "exact" or "fast" (see ``CpuTierConfig.precision``).
    config : threads / cores / ISA (default ``CpuTierConfig()``).

    Returns
    -------
    float32 ``(m, n)``.
    """
    if precision not in ("exact", "fast"):
        raise ValueError(f"precision: must be 'exact' or 'fast', got {precision!r}")
    config = config or CpuTierConfig()
    trellis, suh, svh, bias, cb = _tensor_arrays(tensor, "tensor")
    xa = _f32_matrix(x, "x", tensor.k)
    out = np.empty((xa.shape[0], tensor.n), dtype=np.float32)
    if xa.shape[0] == 0:
        return out
    _shared_runtime(config).matmul(xa, trellis, suh, svh, bias, cb, precision == "fast", out)
    return out


# ----------------------------------------------------------------------------------------------- MoE


class Picks(NamedTuple):
    """One layer's routed picks: pick i sends row ``tokens[i]`` of x to expert ``experts[i]`` with routing
    weight ``weights[i]``."""

    tokens: np.ndarray  # int32 [P]
    experts: np.ndarray  # int32 [P]
    weights: np.ndarray  # float32 [P]

    @staticmethod
    def from_topk(topk_ids: Any, topk_weights: Any) -> Picks:
        """Flatten a router's top-k output, ``[T, k]`` expert ids and weights (numpy or torch CPU), row-major.

        A negative id is no pick: routers mark padding tokens with -1 (vLLM does, for the rows a CUDA graph pads a
        batch with); those picks are left out, so their rows of the output stay zero.
        """
        ids = _as_numpy(topk_ids, "topk_ids")
        w = _as_numpy(topk_weights, "topk_weights")
        if ids.ndim != 2 or w.shape != ids.shape:
            raise ValueError(f"topk_ids and topk_weights must both be [T, k], got {ids.shape} and {w.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"topk_ids: must be an integer array, got {ids.dtype}")
        if w.dtype.kind != "f":
            raise ValueError(f"topk_weights: must be a floating-point array, got {w.dtype}")
        t, k = ids.shape
        if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
            raise ValueError("topk_ids: expert ids do not fit in int32")
        tokens = np.repeat(np.arange(t, dtype=np.int32), k)
        experts = ids.reshape(-1)
        weights = w.reshape(-1)
        if experts.size and experts.min() < 0:
            keep = experts >= 0
            tokens, experts, weights = tokens[keep], experts[keep], weights[keep]
        return Picks(
            tokens=tokens,
            experts=np.ascontiguousarray(experts, dtype=np.int32),
            weights=np.ascontiguousarray(weights, dtype=np.float32),
        )


class Job:
    """An asynchronous MoE layer computation (``ExpertTier.submit``).

    After a timeout the job keeps running; ``cancel()`` stops it as soon as possible (picks whose expert work
    is complete stay in the output, the others are listed by ``missing()``).
    """

    def __init__(self, native: Any, out: np.ndarray, keep: tuple[Any, ...], num_picks: int) -> None:
        self._native = native
        self._out = out
        self._keep = keep  # the arrays the native job reads, alive until it is done
        self._num_picks = num_picks

    def done(self) -> bool:
        """True once the job has finished (completely, or after a cancel)."""
        return bool(self._native.done())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finishes or ``timeout`` seconds pass; True when finished."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0):
            raise ValueError(f"timeout: must be a number >= 0 or None, got {timeout!r}")
        ok = bool(self._native.wait(-1.0 if timeout is None else float(timeout)))
        if ok:
            self._keep = ()
        return ok

    def cancel(self) -> None:
        """Ask the workers to stop as soon as possible (returns at once; ``wait()``/``missing()`` block until the
        job has stopped)."""
        self._native.cancel()

    @property
    def out(self) -> np.ndarray:
        """The output buffer ``[T, H]``: after a cancel, the weighted sum of the computed picks only."""
        return self._out

    @property
    def elapsed_s(self) -> float:
        """Seconds the pool ran this job (its first phase's start to its end; 0.0 until it is done). Against the
        caller's submit-to-wait time it tells the job's own time from its wait in the queue and the wake-up."""
        return float(self._native.elapsed_s())

    def _check_error(self) -> None:
        err = self._native.error()
        if err:
            raise RuntimeError(f"cpu_tier job failed: {err}")

    def missing(self) -> np.ndarray:
        """int64 indices into the picks that are NOT in ``out``: empty after a complete run. On an unfinished job
        this cancels it first and waits for it to stop, so the caller can compute the rest elsewhere."""
        if not self.done():
            self.cancel()
            self.wait()
        self._check_error()
        return np.flatnonzero(self._native.computed() == 0).astype(np.int64)

    def result(self) -> np.ndarray:
        """The output buffer, when every pick was computed; raises otherwise."""
        if not self.done():
            raise RuntimeError("job is not complete: wait() for it first")
        self._check_error()
        miss = self.missing()
        if miss.size:
            raise RuntimeError(
                f"job was cancelled with {miss.size} of {self._num_picks} picks not computed: "
                "see missing(); out holds the weighted sum of the others"
            )
        return self._out


class StreamCounters(NamedTuple):
    """A ``StreamCall``'s totals since it was made (seconds are wall time on the host)."""

    calls: int  # submits
    picks: int  # picks given to the CPU tier
    deadline_misses: int  # jobs cancelled at their deadline
    missed_picks: int  # picks listed in ``missing`` (deadline, error, closed tier)
    errors: int  # failed submits or jobs (see ``StreamCall.last_error``)
    run_s: float  # the pool's own run time of the jobs
    wait_s: float  # time the stream's host thread spent in the waits
    submit_s: float  # time in the submits (building the picks)
    span_s: float  # the job's hand-off to the workers to the wait's end, summed (>= run_s)
    predicted_s: float  # the deadline model's predictions, summed


class StreamCall:
    """One MoE layer's call, driven by a device stream (``ExpertTier.stream_call``): queue, in stream order, the
    copies of the inputs into its buffers, ``cuLaunchHostFunc(stream, submit_fn, address)``, other device work,
    ``cuLaunchHostFunc(stream, wait_fn, address)``, then the copies of ``out`` and ``missing`` back. The host
    functions never raise: failures are counted and their picks listed in ``missing``. ``submit()`` / ``wait()``
    run them on the calling thread (a CPU device, tests). Keep this object alive while the stream may run them."""

    def __init__(self, native: Any, functions: Sequence[int], keep: tuple[Any, ...]) -> None:
        self._native = native
        self.submit_fn, self.wait_fn = int(functions[0]), int(functions[1])
        self._keep = keep

    @property
    def address(self) -> int:
        """The host functions' argument (the native call's address)."""
        return int(self._native.address)

    def submit(self) -> None:
        """Build the picks from the buffers and start the job (what ``submit_fn`` does)."""
        self._native.submit()

    def wait(self) -> None:
        """Wait for the job up to its deadline; fill ``missing`` (what ``wait_fn`` does)."""
        self._native.wait()

    def counters(self) -> StreamCounters:
        c = self._native.counters()
        return StreamCounters(int(c[0]), int(c[1]), int(c[2]), int(c[3]), int(c[4]), *c[5:])

    @property
    def last_error(self) -> str:
        """The last failure's message ("" if none)."""
        return str(self._native.last_error())


@dataclass
class _Layer:
    native: Any
    hidden: int
    intermediate: int
    num_experts: int
    tensors: tuple[tuple[Exl3Tensor, ...], ...]  # kept alive: the native layer points into their arrays


class ExpertTier:
    """MoE layers of EXL3 experts computed on the CPU.

    ``add_layer`` references the experts' arrays (no copy; the tier keeps them alive). ``forward`` computes
    ``out[t] = sum over picks p with tokens[p] == t of weights[p] * expert_{experts[p]}(x[t])`` with
    ``expert(x) = down(silu(min(gate(x), L)) * clamp(up(x), -L, L))``; rows with no pick are zero.
    """

    def __init__(self, config: CpuTierConfig, activation_dtype: str = "float32") -> None:
        if not isinstance(config, CpuTierConfig):
            raise ValueError(f"config: expected a CpuTierConfig, got {type(config).__name__}")
        self.config = config
        #: The arithmetic this tier runs: ``config.resolved_precision(activation_dtype)``, where
        #: ``activation_dtype`` is the dtype the caller's activations were computed in (they reach ``forward`` as
        #: float32 either way).
        self.precision: Literal["exact", "fast"] = config.resolved_precision(activation_dtype)
        self.isa = _loader.resolve_isa(config.isa)
        self._mod = _loader.load(self.isa)
        self._rt = self._mod.Runtime(
            config.resolved_threads(),
            list(config.cpus),
            config.spin_us,
            amx=self.isa == "amx",
            amx_min_tokens=config.amx_min_tokens,
            prefetch_blocks=config.prefetch_blocks,
        )
        self._layers: dict[int, _Layer] = {}
        self._pending: list[Job] = []
        self._closed = False

    # -- setup
    def add_layer(
        self,
        layer: int,
        gate: Sequence[Exl3Tensor],
        up: Sequence[Exl3Tensor],
        down: Sequence[Exl3Tensor],
        *,
        swiglu_limit: float | None | Literal["config"] = "config",
    ) -> None:
        """Register one MoE layer's experts: ``gate[e]``/``up[e]`` (k = H, n = I) and ``down[e]`` (k = I, n = H).

        ``swiglu_limit``: "config" = ``config.swiglu_limit``; None = no clamp (shared experts).
        """
        self._check_open()
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer: must be an int >= 0, got {layer!r}")
        if layer in self._layers:
            raise ValueError(f"layer {layer}: already added")
        projs = {"gate": list(gate), "up": list(up), "down": list(down)}
        n = len(projs["gate"])
        if n == 0:
            raise ValueError(f"layer {layer}: no experts")
        for p, ts in projs.items():
            if len(ts) != n:
                raise ValueError(f"layer {layer}: {p} has {len(ts)} experts, gate has {n}")
        first = projs["gate"][0]
        if not isinstance(first, Exl3Tensor):
            raise ValueError(f"layer {layer} expert 0 gate: expected an Exl3Tensor, got {type(first).__name__}")
        hidden, inter = first.k, first.n
        want = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
        limit = self.config.swiglu_limit if swiglu_limit == "config" else swiglu_limit
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0
        ):
            raise ValueError(f"swiglu_limit: must be a finite number > 0, None or 'config', got {swiglu_limit!r}")
        native = self._mod.Layer(hidden, inter, float("nan") if limit is None else float(limit))
        for e in range(n):
            args: list[Any] = []
            for p in ("gate", "up", "down"):
                t = projs[p][e]
                name = f"layer {layer} expert {e} {p}"
                arrays = _tensor_arrays(t, name)
                if (t.k, t.n) != want[p]:
                    raise ValueError(
                        f"{name}: shape (k, n) = ({t.k}, {t.n}), expected {want[p]} (H = {hidden}, I = {inter})"
                    )
                args.extend(arrays)
            native.add_expert(*args)
        self._layers[layer] = _Layer(
            native, hidden, inter, n, (tuple(projs["gate"]), tuple(projs["up"]), tuple(projs["down"]))
        )

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._layers))

    @property
    def chunk_tokens(self) -> int:
        """Tokens of one expert the kernels decode its weights once for (a job's chunk; more take more chunks)."""
        return int(self._mod.max_tokens_per_chunk())

    # -- compute
    def submit(
        self,
        layer: int,
        x: Any,
        picks: Picks | tuple[Any, Any, Any],
        out: Any | None = None,
        *,
        _test_cancel_after_chunks: int = -1,
    ) -> Job:
        """Start computing one layer's picks; returns at once. See ``forward`` for the arguments.

        The job reads ``x`` and writes ``out`` in place while it runs (the Job keeps them alive): leave ``x``
        unchanged and do not read ``out`` until ``done()``. Jobs run in submission order.
        (``_test_cancel_after_chunks`` is a test hook: cancel once that many expert chunks are complete.)
        """
        lay = self._open_layer(layer)
        xa = _f32_matrix(x, "x", lay.hidden)
        t = xa.shape[0]
        if out is None:
            oa = np.empty((t, lay.hidden), dtype=np.float32)
        else:
            oa = _f32_matrix(out, "out", lay.hidden, rows=t, writable=True)
            if np.shares_memory(oa, xa):
                raise ValueError("out: must not overlap x")
        tokens, experts, weights = self._check_picks(picks, t, lay, layer)
        native = self._rt.submit_moe(
            lay.native,
            xa,
            tokens,
            experts,
            weights,
            oa,
            self.precision == "fast",
            _WAVE_CHUNKS,
            self.config.slab_blocks,
            _test_cancel_after_chunks,
        )
        job = Job(native, oa, (xa, oa, tokens, experts, weights, x, out, lay), int(tokens.shape[0]))
        self._pending = [j for j in self._pending if not j.done()]
        self._pending.append(job)
        return job

    def stream_call(
        self,
        layer: int,
        x: Any,
        ids: Any,
        weights: Any,
        hit: Any,
        xrows: Any,
        out: Any,
        missing: Any,
        *,
        deadline_factor: float = 0.0,
        deadline_floor_s: float = 0.0,
        fixed_s: float = 0.0,
        expert_s: Sequence[float] = (),
        _test_cancel_after_chunks: int = -1,
    ) -> StreamCall:
        """A call of ``layer`` that a device stream drives with no caller thread in the loop (see ``StreamCall``).

        Buffers (numpy arrays or torch CPU tensors, C-contiguous; pinned memory when a GPU copies them; read and
        written by the host functions, so keep their contents until the stream is past the call's wait):
        ``x`` float32 ``[T, H]``, ``ids`` int32 ``[T, K]`` (< 0: no pick), ``weights`` float32 ``[T, K]``, ``hit``
        bool/uint8 ``[T, K]`` (non-zero: not the CPU tier's pick), ``xrows`` float32 ``[T * K, H]`` (scratch),
        ``out`` float32 ``[T * K, H]`` (row ``t * K + j``: pick ``(t, j)``'s weighted output if the CPU tier
        computed it, else zeros), ``missing`` int32 ``[T, K]`` (the expert of each CPU pick not computed, -1
        elsewhere).

        Deadline: the wait gives the job ``deadline_factor * (fixed_s + sum over its distinct experts of
        expert_s[min(m, 8) - 1]) + deadline_floor_s`` seconds from its submit (``m``: the expert's picks), then
        cancels it; the picks it did not finish are listed in ``missing``. ``deadline_factor = 0``: no deadline.
        (``_test_cancel_after_chunks``: a test hook, as ``submit``'s: each job cancels itself after that many chunks.)
        """
        lay = self._open_layer(layer)
        xa = _f32_matrix(x, "x", lay.hidden)
        t = xa.shape[0]
        ia = _as_numpy(ids, "ids")
        if ia.dtype != np.int32 or ia.ndim != 2 or ia.shape[0] != t or not ia.flags.c_contiguous:
            raise ValueError(f"ids: must be C-contiguous int32 [T={t}, K], got {ia.dtype} {tuple(ia.shape)}")
        k = ia.shape[1]
        wa = _as_numpy(weights, "weights")
        if wa.dtype != np.float32 or wa.shape != (t, k) or not wa.flags.c_contiguous:
            raise ValueError(f"weights: must be C-contiguous float32 [{t}, {k}], got {wa.dtype} {tuple(wa.shape)}")
        ha = _as_numpy(hit, "hit")
        if ha.dtype not in (np.bool_, np.uint8) or ha.shape != (t, k) or not ha.flags.c_contiguous:
            raise ValueError(f"hit: must be C-contiguous bool or uint8 [{t}, {k}], got {ha.dtype} {tuple(ha.shape)}")
        xr = _f32_matrix(xrows, "xrows", lay.hidden, rows=t * k, writable=True)
        oa = _f32_matrix(out, "out", lay.hidden, rows=t * k, writable=True)
        ma = _as_numpy(missing, "missing")
        if ma.dtype != np.int32 or ma.shape != (t, k) or not ma.flags.c_contiguous or not ma.flags.writeable:
            raise ValueError(
                f"missing: must be writable C-contiguous int32 [{t}, {k}], got {ma.dtype} {tuple(ma.shape)}"
            )
        for name, a in (("xrows", xr), ("out", oa), ("missing", ma)):
            for other_name, other in (("x", xa), ("ids", ia), ("weights", wa), ("hit", ha)):
                if np.shares_memory(a, other):
                    raise ValueError(f"{name}: must not overlap {other_name}")
        if np.shares_memory(xr, oa):
            raise ValueError("out: must not overlap xrows")
        m = self.chunk_tokens
        es = [float(v) for v in expert_s] if len(expert_s) else [0.0] * m
        if len(es) != m or not all(math.isfinite(v) and v >= 0 for v in es):
            raise ValueError(f"expert_s: {m} finite seconds >= 0 (token counts 1..{m}), got {expert_s!r}")
        for name, v in (
            ("deadline_factor", deadline_factor),
            ("deadline_floor_s", deadline_floor_s),
            ("fixed_s", fixed_s),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        native = self._mod.StreamCall(
            self._rt, lay.native, xa, ia, wa, ha.view(np.uint8), xr, oa, ma,
            self.precision == "fast", _WAVE_CHUNKS, self.config.slab_blocks,
            float(deadline_factor), float(deadline_floor_s), float(fixed_s), es, int(_test_cancel_after_chunks),
        )  # fmt: skip
        return StreamCall(native, self._mod.stream_call_functions(), (x, ids, weights, hit, xrows, out, missing))

    def forward(self, layer: int, x: Any, picks: Picks | tuple[Any, Any, Any], out: Any | None = None) -> np.ndarray:
        """Compute one layer's routed picks (blocking).

        Parameters
        ----------
        layer : a layer added with ``add_layer``.
        x : float32 ``[T, H]`` hidden states, C-contiguous (numpy or torch CPU tensor).
        picks : ``Picks`` (tokens int32 [P] rows of x, experts int32 [P], weights float32 [P]).
        out : optional caller-owned float32 ``[T, H]`` buffer (e.g. pinned memory), overwritten.

        Returns
        -------
        ``out`` (or a new array): the routing-weighted sum of the picked experts' outputs per row.
        """
        job = self.submit(layer, x, picks, out)
        job.wait()
        return job.result()

    @staticmethod
    def _check_picks(picks: Any, t: int, lay: _Layer, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(picks, tuple) or len(picks) != 3:
            raise ValueError("picks: expected a Picks (tokens, experts, weights)")
        arrs = []
        for field, a in zip(("tokens", "experts", "weights"), picks, strict=True):
            v = _as_numpy(a, f"picks.{field}")
            if v.ndim != 1:
                raise ValueError(f"picks.{field}: must be 1-D, got shape {tuple(v.shape)}")
            if field == "weights":
                if v.dtype.kind != "f":
                    raise ValueError(f"picks.weights: must be floating point, got {v.dtype}")
                v = np.ascontiguousarray(v, dtype=np.float32)
            elif v.dtype.kind not in "iu":
                raise ValueError(f"picks.{field}: must be an integer array, got {v.dtype}")
            arrs.append(v)
        tokens, experts, weights = arrs
        if not (tokens.shape == experts.shape == weights.shape):
            raise ValueError(
                f"picks: tokens, experts and weights must have one length, got "
                f"{tokens.shape[0]}, {experts.shape[0]}, {weights.shape[0]}"
            )
        checked = []
        for field, v, hi in (("tokens", tokens, t), ("experts", experts, lay.num_experts)):
            # the range on the array as given (min / max: a decode call's few picks cost ~1 us; the first bad pick
            # is looked for only when there is one), then int32 (a copy only when given another type)
            if v.size and (int(v.min()) < 0 or int(v.max()) >= hi):
                i = int(np.flatnonzero((v < 0) | (v >= hi))[0])
                what = f"x has {t} rows" if field == "tokens" else f"layer {layer} has {hi} experts"
                raise ValueError(f"picks.{field}[{i}] = {int(v[i])} is out of range ({what})")
            checked.append(np.ascontiguousarray(v, dtype=np.int32))
        if weights.size and not np.isfinite(weights).all():
            raise ValueError("picks.weights: must be finite")
        return checked[0], checked[1], weights

    # -- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ExpertTier is closed")

    def _open_layer(self, layer: int) -> _Layer:
        """The added layer ``layer`` of an open tier; the error names the layers added."""
        self._check_open()
        lay = self._layers.get(layer) if isinstance(layer, int) else None
        if lay is None:
            raise ValueError(f"layer {layer!r}: not added (added: {list(self.layers)})")
        return lay

    def close(self) -> None:
        """Cancel unfinished jobs, wait for them to stop, and stop the worker threads."""
        if self._closed:
            return
        for job in self._pending:
            if not job.done():
                job.cancel()
        for job in self._pending:
            job.wait()
        self._pending = []
        self._rt.close()
        self._closed = True

    def __enter__(self) -> ExpertTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
