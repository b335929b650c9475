"""Where routed experts run: the expert runtimes behind the plugin's fused-MoE method, and its custom op.

``ExpertRuntime`` is the seam between vLLM and our libraries. The fused-MoE method hands it each MoE layer's
experts once (``add_layer``, views of the pack's host home) and then, per forward, the layer's activations and
vLLM's routing decision (``forward_into``), which must write the weighted sum of the picked experts into a
caller-owned output buffer (the buffer a captured CUDA graph segment reads next). Runtimes:

* ``CpuExpertRuntime``: every routed expert in the host home, computed by ``cpu_tier.ExpertTier`` (on a GPU
  model: activations and routing copied to pinned host buffers, the result copied back; one host sync per
  layer, the CPU tier's own);
* ``TieredRuntime`` (``vllm_dsv41.tiered``): the hottest experts in a VRAM cache computed on the GPU, the misses
  on the CPU tier or read over PCIe by the GPU;
* ``AllInVramRuntime``: the oracle. Every routed expert dequantized on the model's device (``vllm_dsv41.dequant``:
  ``cpu_tier.exl3.reconstruct`` to float32 rounding) and computed by plain fp32 matmuls, so it differs from any tier
  only in where the experts run. A layer's experts are dequantized once and kept (``dequantize="load"``) or, where
  they would not fit (a real-size layer: 54 GB of fp32), each routed expert per call and freed ("per-call"); the two
  give the same output (bit for bit on the CPU; on CUDA to the float32 rounding of cuBLAS's GEMMs, which may pick
  other kernels for the kept weights than for those dequantized in the call).
* ``NoExpertsRuntime``: writes zeros (the routed experts switched off). For benchmarks only: it times the rest of
  a decode step (attention, router, shared expert, head, sampling); not a configurable runtime, so a server
  refuses it.

The forward goes through one ``torch.library`` custom op, ``dsv41::routed_experts_out`` (it mutates ``out``;
shape-only fake), so a ``torch.compile``-d model sees one opaque call; on CUDA the fused-MoE method calls it
as an eager break of vLLM's breakable CUDA graphs (see ``methods.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Literal, Protocol

import numpy as np
import torch

from . import metrics
from .config import Dsv41PluginConfig
from .home import LayerExperts

__all__ = [
    "AUTO_FREE_SHARE",
    "DEQUANTIZE",
    "AllInVramRuntime",
    "CpuExpertRuntime",
    "ExpertRuntime",
    "NoExpertsRuntime",
    "choose_dequantize",
    "free_device_bytes",
    "in_profile_run",
    "make_runtime",
    "register_runtime",
    "replace_runtime",
    "routed_experts",
    "routed_experts_out",
    "unregister_runtime",
]

logger = logging.getLogger("vllm.dsv41.experts")  # under "vllm": printed with vLLM's own log lines


class ExpertRuntime(Protocol):
    """Routed experts of every MoE layer of one model instance."""

    #: "cpu", "all-in-vram", ...
    name: str
    #: True when ``forward_into`` is pure device work (no host sync), so it may be captured in a CUDA graph.
    graph_safe: bool

    def add_layer(self, experts: LayerExperts, swiglu_limit: float | None) -> None:
        """Take one layer's experts (views of the host home; gate/up ``(H, I)``, down ``(I, H)``)."""
        ...

    def forward_into(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out[t] = sum_j topk_weights[t, j] * expert[topk_ids[t, j]](x[t])`` for ``t < T``; ``x`` ``[T, H]``,
        ``out`` ``[>= T, H]`` of ``x``'s dtype and device (rows past T untouched). A negative id is no pick: vLLM
        routes the rows a CUDA graph pads a batch with to expert -1 (``VLLM_MOE_SKIP_PADDING``)."""
        ...

    def close(self) -> None: ...


def _check_args(hidden: dict[int, int], layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                out: torch.Tensor) -> int:  # fmt: skip
    if layer not in hidden:
        raise KeyError(f"MoE layer {layer}: no experts were added to this runtime (layers {sorted(hidden)})")
    h = hidden[layer]
    if x.ndim != 2 or x.shape[1] != h:
        raise ValueError(f"MoE layer {layer}: activations must be [T, {h}], got {tuple(x.shape)}")
    t = x.shape[0]
    if ids.ndim != 2 or ids.shape[0] != t or w.shape != ids.shape:
        raise ValueError(f"MoE layer {layer}: topk ids {tuple(ids.shape)} / weights {tuple(w.shape)} do not match "
                         f"{t} tokens")  # fmt: skip
    if out.ndim != 2 or out.shape[0] < t or out.shape[1] != h or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"MoE layer {layer}: out must be [>= {t}, {h}] {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    return t


def _refuse_capture(name: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the {name!r} expert runtime syncs with the host, so it cannot be captured in a CUDA graph: serve "
            "with compilation_config cudagraph_mode 'PIECEWISE' (the expert op is then an eager break) or 'NONE'; "
            "FULL graphs would freeze the CPU work into the graph"
        )


class CpuExpertRuntime:
    """All routed experts in host memory (the pack's home), computed by ``cpu_tier.ExpertTier``.

    Parameters
    ----------
    config : the plugin configuration (its ``cpu`` field configures the tier).
    max_tokens : rows of the pinned staging buffers on a GPU model (grown on demand outside CUDA graphs).
    activation_dtype : the model's dtype: the tier's "auto" precision runs "fast" for bf16/fp16 activations,
        "exact" for float32 ones (``CpuTierConfig.resolved_precision``).
    """

    name = "cpu"
    graph_safe = False

    def __init__(self, config: Dsv41PluginConfig, max_tokens: int = 0,
                 activation_dtype: torch.dtype | str = torch.float32) -> None:  # fmt: skip
        from cpu_tier import ExpertTier, Picks

        self.config = config
        self._picks = Picks
        self._tier = ExpertTier(config.cpu, activation_dtype=str(activation_dtype))
        #: The kernel variant the tier runs (e.g. "avx2").
        self.isa: str = self._tier.isa
        #: The tier's arithmetic, "exact" or "fast" (``config.cpu.precision`` resolved for the activations).
        self.precision: str = self._tier.precision
        self._hidden: dict[int, int] = {}
        self._lock = threading.Lock()
        self._max_tokens = max_tokens
        self._staging: dict[tuple[torch.device, int, int], _Staging] = {}
        self._metrics = metrics.tier("cpu")
        #: vLLM's dummy forwards answered with zeros (``in_profile_run``): their inputs are unset memory.
        self.profile_calls = 0

    def add_layer(self, experts: LayerExperts, swiglu_limit: float | None) -> None:
        self._tier.add_layer(experts.layer, list(experts.gate), list(experts.up), list(experts.down),
                             swiglu_limit=swiglu_limit)  # fmt: skip
        self._hidden[experts.layer] = experts.hidden

    def _compute(self, layer: int, x32: np.ndarray, ids: np.ndarray, w: np.ndarray, out32: np.ndarray) -> None:
        with self._lock:  # one forward at a time: the tier owns one worker pool
            t0 = time.perf_counter()
            self._tier.forward(layer, x32, self._picks.from_topk(ids, w), out=out32)
            self._metrics.forward(time.perf_counter() - t0, picks=ids.size)

    def forward_into(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        t = _check_args(self._hidden, layer, x, topk_ids, topk_weights, out)
        if t == 0:
            return
        if in_profile_run():  # a dummy batch (up to max_num_batched_tokens): no host work, no staging grown for it
            out[:t].zero_()
            self.profile_calls += 1
            return
        if x.device.type == "cpu":
            xs = x.detach().to(torch.float32).contiguous()
            res = out[:t] if out.dtype == torch.float32 else torch.empty((t, x.shape[1]), dtype=torch.float32)
            ids = topk_ids.detach().to(torch.int32).contiguous().numpy()
            wts = topk_weights.detach().to(torch.float32).contiguous().numpy()
            self._compute(layer, xs.numpy(), ids, wts, res.numpy())
            if res.data_ptr() != out.data_ptr():
                out[:t].copy_(res)
            return
        _refuse_capture(self.name)
        st = self._staging_for(x.device, x.shape[1], topk_ids.shape[1], t)
        stream = torch.cuda.current_stream(x.device)
        # Casts on the GPU into persistent buffers, then one D2H each into pinned memory.
        st.dx[:t].copy_(x)
        st.dids[:t].copy_(topk_ids)
        st.dw[:t].copy_(topk_weights)
        st.hx[:t].copy_(st.dx[:t], non_blocking=True)
        st.hids[:t].copy_(st.dids[:t], non_blocking=True)
        st.hw[:t].copy_(st.dw[:t], non_blocking=True)
        st.inputs_ready.record(stream)
        st.inputs_ready.synchronize()  # the host waits for this layer's inputs only
        self._compute(layer, st.hx[:t].numpy(), st.hids[:t].numpy(), st.hw[:t].numpy(), st.hout[:t].numpy())
        # The next layer's host writes to hout happen only after its own inputs_ready, which the stream orders
        # after this copy: one set of pinned buffers is enough.
        st.dout[:t].copy_(st.hout[:t], non_blocking=True)
        out[:t].copy_(st.dout[:t])

    def _staging_for(self, device: torch.device, hidden: int, topk: int, t: int) -> _Staging:
        key = (device, hidden, topk)
        st = self._staging.get(key)
        if st is None or st.rows < t:
            st = _Staging(device, max(t, self._max_tokens, st.rows * 2 if st else 0), hidden, topk)
            self._staging[key] = st
        return st

    def close(self) -> None:
        self._tier.close()


class _Staging:
    """Pinned host buffers and device casts for moving one layer's MoE inputs and output across PCIe."""

    def __init__(self, device: torch.device, rows: int, hidden: int, topk: int) -> None:
        self.rows, self.topk = rows, topk
        f32, i32 = torch.float32, torch.int32
        self.dx = torch.empty((rows, hidden), device=device, dtype=f32)
        self.dout = torch.empty((rows, hidden), device=device, dtype=f32)
        self.dids = torch.empty((rows, self.topk), device=device, dtype=i32)
        self.dw = torch.empty((rows, self.topk), device=device, dtype=f32)
        self.hx = torch.empty((rows, hidden), pin_memory=True, dtype=f32)
        self.hout = torch.empty((rows, hidden), pin_memory=True, dtype=f32)
        self.hids = torch.empty((rows, self.topk), pin_memory=True, dtype=i32)
        self.hw = torch.empty((rows, self.topk), pin_memory=True, dtype=f32)
        self.inputs_ready = torch.cuda.Event()


Dequantize = Literal["load", "per-call", "auto"]
#: ``AllInVramRuntime``'s ``dequantize`` values.
DEQUANTIZE: tuple[Dequantize, ...] = ("load", "per-call", "auto")
#: "auto" dequantizes a layer per call when its dequantized experts would take more than this share of the memory
#: free on the device at ``add_layer`` (``free_device_bytes``), else at load: what stays free is the rest of the
#: layers', the next runtime's (the fidelity tool builds one while the other still holds its memory) and vLLM's.
AUTO_FREE_SHARE = 0.5


def choose_dequantize(nbytes: int, free_bytes: int) -> Literal["load", "per-call"]:
    """The mode "auto" gives a layer whose dequantized experts take ``nbytes`` with ``free_bytes`` free on the
    device: "per-call" above ``AUTO_FREE_SHARE`` of it, else "load"."""
    return "per-call" if nbytes > AUTO_FREE_SHARE * free_bytes else "load"


def free_device_bytes(device: torch.device | str) -> int:
    """Memory free for new tensors on ``device``. CUDA: the driver's free memory (``torch.cuda.mem_get_info``) plus
    what PyTorch's caching allocator holds unused (reserved minus allocated: a closed runtime's weights). CPU: the
    host's available memory (``MemAvailable`` of ``/proc/meminfo``; elsewhere the free physical pages)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class AllInVramRuntime:
    """The oracle: every routed expert dequantized on the model's device, computed in fp32 (no TF32).

    Parameters
    ----------
    device : where the experts are dequantized and computed (the model's device; "cpu" for the CPU demo).
    dtype : the compute (and storage) dtype: float32 (the oracle) or float64 (a diagnostic: the same experts with
        more exact sums, to measure how much of a runtime's difference is the model's sensitivity to the last bits).
        The experts are dequantized to float32 either way (``vllm_dsv41.dequant.reconstruct_torch``), then cast.
    dequantize : when. "load": every expert of a layer at ``add_layer``, kept on the device (``nbytes``: all of
        them). "per-call": ``add_layer`` keeps the layer's ``Exl3Tensor`` views of the host home (no copy) and
        ``forward_into`` dequantizes each routed expert the call uses (gate, up, down), computes it exactly as
        "load" does and frees it (``nbytes``: none of them); the outputs of the two are equal bit for bit on
        the CPU, to float32 rounding on CUDA (cuBLAS may pick other GEMM kernels: H200 run 8).
        "auto" (default): per layer, "per-call" when the layer's dequantized experts would take more than
        ``AUTO_FREE_SHARE`` of the memory free on the device (``choose_dequantize``, ``free_device_bytes``), else
        "load". Each layer's mode is logged once (``vllm.dsv41.experts``) and kept in ``modes``.
    vllm_share_bytes : vLLM's share of the device, when the runtime is built in vLLM's model load (the plugin passes
        it): experts kept at load are model weights there, inside the share, so "auto" counts as free at most what
        of the share PyTorch does not hold yet (a real-size layer then goes per call under ``--gpu-memory-gib 24``
        instead of overrunning the share).

    ``name``: "all-in-vram" (float32), "all-in-vram-f64" (float64), with "-per-call" when every layer is dequantized
    per call (``dequantize="per-call"``).
    """

    name = "all-in-vram"
    graph_safe = False  # data-dependent per-expert loops (host reads the routing)

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.float32,
                 dequantize: Dequantize = "auto", vllm_share_bytes: int | None = None) -> None:  # fmt: skip
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"AllInVramRuntime: dtype must be float32 or float64, got {dtype}")
        if dequantize not in DEQUANTIZE:
            raise ValueError(f"AllInVramRuntime: dequantize must be one of {DEQUANTIZE}, got {dequantize!r}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.dequantize: Dequantize = dequantize
        self._vllm_share = vllm_share_bytes
        if dtype == torch.float64:
            self.name = "all-in-vram-f64"
        if dequantize == "per-call":  # a diagnostic name (the fidelity tool switches runtimes by name)
            self.name += "-per-call"
        #: the layers dequantized at load: gate, up, down of every expert, on the device
        self._w: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        #: the layers dequantized per call: their views of the host home
        self._home: dict[int, LayerExperts] = {}
        #: the mode each layer took, "load" or "per-call"
        self.modes: dict[int, Literal["load", "per-call"]] = {}
        self._limit: dict[int, float | None] = {}
        self._hidden: dict[int, int] = {}

    def _dq(self, t: Any) -> torch.Tensor:
        from .dequant import reconstruct_torch

        return reconstruct_torch(t, self.device).to(self.dtype)

    def layer_nbytes(self, experts: LayerExperts) -> int:
        """Bytes of ``experts`` dequantized in this runtime's dtype (what "load" keeps on the device)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(t.k * t.n * size for proj in (experts.gate, experts.up, experts.down) for t in proj)

    def add_layer(self, experts: LayerExperts, swiglu_limit: float | None) -> None:
        lid = experts.layer
        nbytes = self.layer_nbytes(experts)
        mode: Literal["load", "per-call"]
        if self.dequantize == "auto":
            free = free_device_bytes(self.device)
            if self._vllm_share and self.device.type == "cuda":  # in vLLM's model load: inside its share
                free = min(free, max(0, self._vllm_share - torch.cuda.memory_reserved(self.device)))
            mode = choose_dequantize(nbytes, free)
            why = f"auto: {nbytes / 2**30:.3g} GiB dequantized, {free / 2**30:.3g} GiB free"
        else:
            mode, why = self.dequantize, "as asked"
        logger.info("dsv41 %s: MoE layer %d's %d experts dequantized %s on %s (%s)", self.name, lid,
                    experts.num_experts, "at load" if mode == "load" else "per call", self.device, why)  # fmt: skip
        self._w.pop(lid, None)
        self._home.pop(lid, None)
        if mode == "load":
            gate, up, down = ([self._dq(t) for t in proj] for proj in (experts.gate, experts.up, experts.down))
            self._w[lid] = (gate, up, down)
        else:
            self._home[lid] = experts
        self.modes[lid] = mode
        self._limit[lid] = swiglu_limit
        self._hidden[lid] = experts.hidden

    @property
    def nbytes(self) -> int:
        """Bytes of dequantized experts held on the device (the "load" layers'; a per-call expert only in its call)."""
        return sum(w.numel() * w.element_size() for layer in self._w.values() for proj in layer for w in proj)

    def _expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e``'s gate, up and down weights: the kept ones, or dequantized now."""
        kept = self._w.get(layer)
        if kept is not None:
            return kept[0][e], kept[1][e], kept[2][e]
        lx = self._home[layer]
        return self._dq(lx.gate[e]), self._dq(lx.up[e]), self._dq(lx.down[e])

    def forward_into(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        from dma_prefill.ops_torch import swiglu

        t = _check_args(self._hidden, layer, x, topk_ids, topk_weights, out)
        if t == 0:
            return
        _refuse_capture(self.name)
        limit = self._limit[layer]
        xs = x.to(self.dtype)
        acc = torch.zeros((t, x.shape[1]), dtype=self.dtype, device=x.device)
        ids = topk_ids.to(torch.int64)
        w = topk_weights.to(self.dtype)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            for e in torch.unique(ids).tolist():
                if e < 0:  # vLLM's padding rows (a CUDA graph's batch padded up): no pick
                    continue
                tok, slot = torch.nonzero(ids == e, as_tuple=True)
                gate, up, down = self._expert(layer, e)
                xe = xs[tok]
                y = swiglu(xe @ gate, xe @ up, limit) @ down
                acc.index_add_(0, tok, y * w[tok, slot, None])
                del gate, up, down  # (per call: freed before the next expert is dequantized)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        out[:t].copy_(acc)

    def close(self) -> None:
        """Drop the experts; on CUDA, give the kept ones' memory back to the driver, so that the next runtime's
        automatic sizing (the tiered cache, another oracle's "auto") sees it free."""
        held = bool(self._w)
        self._w.clear()
        self._home.clear()
        if held and self.device.type == "cuda":
            torch.cuda.empty_cache()


class NoExpertsRuntime:
    """The routed experts switched off: ``forward_into`` writes zeros (benchmarks: the time of everything else).

    Not a ``Dsv41PluginConfig.runtime`` value (a served model cannot select it); a benchmark puts it in a loaded
    model's runtime slot (``Exl3Config.set_runtime``). Graph safe (one device memset, no host sync). It also has the
    tiered runtime's two halves (``begin`` / ``finish``), so it can replace that runtime in a model compiled with it
    (whose graphs call the halves as two eager breaks).
    """

    name = "none"
    graph_safe = True

    def __init__(self) -> None:
        self._hidden: dict[int, int] = {}
        self._pending: tuple[int, int] | None = None

    def add_layer(self, experts: LayerExperts, swiglu_limit: float | None) -> None:
        self._hidden[experts.layer] = experts.hidden

    def forward_into(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        t = _check_args(self._hidden, layer, x, topk_ids, topk_weights, out)
        out[:t].zero_()

    def begin(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """First half (nothing to start): remembers the layer's token count for ``finish``."""
        self._pending = (layer, _check_args(self._hidden, layer, x, topk_ids, topk_weights, x))

    def finish(self, layer: int, out: torch.Tensor) -> None:
        """Second half: zeros into ``out[:T]``."""
        if self._pending is None or self._pending[0] != layer:
            raise RuntimeError(f"MoE layer {layer}: finish() without its begin()")
        t = self._pending[1]
        self._pending = None
        out[:t].zero_()

    def close(self) -> None:
        self._hidden.clear()


def call_path(runtime: Any, device: torch.device) -> str:
    """How a model on ``device`` built with ``runtime`` calls its expert runtime; fixed for the model's life, since
    torch.compile bakes the branch into the compiled code and CUDA graphs capture what the op launched:

    * "op": the custom op inline (a graph-safe runtime on CUDA: captured in the graphs; or any runtime on the CPU,
      where there are no graphs);
    * "eager": the op as one eager break of vLLM's breakable CUDA graphs (runs the current runtime every call);
    * "split": two eager breaks around the shared expert, ``begin`` / ``finish`` (a runtime that has them: the
      tiered one; any other runtime then runs whole in the first).
    """
    if device.type != "cuda" or runtime.graph_safe:
        return "op"
    return "split" if hasattr(runtime, "begin") else "eager"


def make_runtime(config: Dsv41PluginConfig, device: torch.device | str, max_tokens: int = 0,
                 home: Any = None, vllm_share_bytes: int | None = None,
                 activation_dtype: torch.dtype | str = torch.float32) -> ExpertRuntime:  # fmt: skip
    """The runtime ``config.runtime`` names, for a model on ``device``; ``home`` (the ``ExpertHome``, or a callable
    returning it) is needed by the tiered runtime, ``vllm_share_bytes`` (vLLM's share of the device) tells it what
    its automatic cache size must leave to vLLM, and the oracle what its "auto" dequantization may keep at load;
    ``activation_dtype`` (the model's dtype) resolves the CPU tier's "auto" precision."""
    if config.runtime == "cpu":
        return CpuExpertRuntime(config, max_tokens=max_tokens, activation_dtype=activation_dtype)
    if config.runtime == "all-in-vram":
        return AllInVramRuntime(device, vllm_share_bytes=vllm_share_bytes)
    if config.runtime == "tiered":
        if home is None:
            raise ValueError("runtime 'tiered': needs the host home of the experts")
        from .tiered import TieredRuntime

        return TieredRuntime(config, home, device, vllm_share_bytes=vllm_share_bytes,
                             activation_dtype=activation_dtype)  # fmt: skip
    raise ValueError(f"runtime: unknown expert runtime {config.runtime!r}")


# ------------------------------------------------------------------------------------------ custom op

_RUNTIMES: dict[int, ExpertRuntime] = {}
_NEXT_ID = itertools.count(1)


def register_runtime(runtime: ExpertRuntime) -> int:
    """Make ``runtime`` reachable from the custom op; returns its handle."""
    handle = next(_NEXT_ID)
    _RUNTIMES[handle] = runtime
    return handle


def replace_runtime(handle: int, runtime: ExpertRuntime) -> ExpertRuntime:
    """Put ``runtime`` under an existing handle; returns the runtime it held (not closed)."""
    old = get_runtime(handle)
    _RUNTIMES[handle] = runtime
    return old


def unregister_runtime(handle: int) -> None:
    runtime = _RUNTIMES.pop(handle, None)
    if runtime is not None:
        runtime.close()


def get_runtime(handle: int) -> ExpertRuntime:
    try:
        return _RUNTIMES[handle]
    except KeyError:
        raise KeyError(f"no expert runtime with handle {handle} in this process") from None


def in_profile_run() -> bool:
    """True inside one of vLLM's dummy forwards without attention metadata: its memory profiling and warm-up, and
    the warm-ups of a PIECEWISE graph capture (a real batch always carries metadata). Their batches reach
    ``max_num_batched_tokens`` and their attention outputs are unwritten memory (vLLM's backends return the buffer
    as it is), so the router's weights may be NaN: the runtimes that compute on the host answer them with zeros
    instead of minutes of CPU-tier work on garbage. Read only where vLLM has imported its forward context (importing it
    here would pull vLLM's compile stack into the op)."""
    fc = sys.modules.get("vllm.forward_context")
    return fc is not None and fc.is_forward_context_available() and fc.get_forward_context().attn_metadata is None


@torch.library.custom_op("dsv41::routed_experts_out", mutates_args=("out",))
def routed_experts_out(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, runtime: int, layer: int
) -> None:
    """Write MoE ``layer``'s routed-expert output into ``out[:T]`` (runtime ``runtime``; see ``ExpertRuntime``)."""
    get_runtime(runtime).forward_into(layer, x, topk_ids, topk_weights, out)


@routed_experts_out.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, runtime: int,
      layer: int) -> None:  # fmt: skip
    return None


def routed_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, runtime: int, layer: int
) -> torch.Tensor:
    """The functional form: a fresh output tensor (tests, benchmarks; the model uses the out= op)."""
    out = torch.empty_like(x)
    torch.ops.dsv41.routed_experts_out(x, topk_ids, topk_weights, out, runtime, layer)
    return out
