"""DeepSeek-V4.1's Engram tables served from the pack's files (engram-mmap) inside vLLM's V4.1 model.

Upstream vLLM 0.32 pins each Engram table whole in host memory (two tables, 189 GiB for V4.1-Flash) and its
lookup kernel reads the rows over PCIe. With ``engram="mmap"`` (``Dsv41PluginConfig``, the default) the tables
stay in the pack's safetensors shards, memory-mapped by engram-mmap: never read whole, never pinned whole; host
RAM holds only what the page cache keeps. vLLM's weight reader never reads them (the model reports them as
unused checkpoint weights, which the ``dsv41`` loader skips unread).

One step, as data sees it:

1. Upstream's model hashes the step's token ids on the GPU (``NgramHashState``, unchanged) before the first decoder
   layer and calls each Engram layer's ``prepare_embeddings``, which calls ``_start_prefetch``: on the Engram
   prefetch stream, after the hash kernel, the layer's row ids ``int32 [T, 24]`` are copied into a pinned host
   buffer; a worker thread (one per table) waits for them, gathers the rows from the mapped shards into pinned
   staging buffers (engram-mmap's native gather, GIL released; the page cache or the disk) and copies them to
   device staging buffers on the prefetch stream.
2. Meanwhile the main thread launches, and the GPU runs, the layers before the Engram layer.
3. Where the rows are used (``Engram.forward`` -> ``_ready_rows`` -> ``_finish_prefetch``), the main thread joins
   the worker (an error names the file), the current stream waits for the copies, and upstream's own lookup kernel
   dequantizes the staged rows into upstream's ``staged_rows`` (fp8 E4M3 x E8M0 -> bf16), so the rows served are
   bit for bit those of upstream's pinned-table lookup.

CUDA graphs: ``_start_prefetch`` and ``_finish_prefetch`` are eager breaks of vLLM's breakable CUDA graphs (as
upstream's are), so both run on every replay; everything they touch lives in persistent buffers. While a graph is
being captured nothing is gathered (the hash kernel's segment is recorded, not run, so its ids are unset memory;
a gather would page in random table rows): the breaks run for real at every replay. FULL graphs would capture the
host work and are refused. (Under vLLM's V1 model runner, PIECEWISE capture runs without attention metadata and
upstream's model skips Engram in what it captures; the V2 runner builds metadata for it. A review's finding,
unchecked on a GPU: see the package README.)

The hook (``engram_construction``): while the plugin's ``Dsv41ForCausalLM`` builds upstream's model, the name
``Engram`` that upstream's decoder layer instantiates is bound to our subclass, whose ``_create_embedding`` returns
:class:`MmapEngramEmbedding` instead of upstream's ``ParallelEngramEmbedding`` (which would allocate the pinned
tables). No vLLM file is edited; the binding is restored when construction ends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engram_mmap import EngramConfig, EngramTable, TableConfig, table_tensor_layer

from . import metrics
from .config import ENGRAM_MODES

__all__ = [
    "ENGRAM_MODES",
    "EngramRowGather",
    "GatherStep",
    "MmapEngramEmbedding",
    "check_layout",
    "dequantize_rows",
    "engram_construction",
    "engram_gathers",
    "is_engram_table_tensor",
    "mmap_engram_class",
    "open_engram_tables",
]


def is_engram_table_tensor(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is an Engram table (``layers.N.engram.embed.{weight,scale}``)."""
    return table_tensor_layer(name) is not None


def open_engram_tables(
    pack: str | Path, config: EngramConfig | None = None, table_config: TableConfig | None = None
) -> dict[int, EngramTable]:
    """Map every Engram table of a pack (layer -> table), checking shapes against the pack's ``config.json``.

    Missing or truncated shards raise ``FileNotFoundError`` / ``EngramFormatError`` naming the file.
    """
    pack = Path(pack)
    config = config or EngramConfig.from_hf_config(pack)
    tables: dict[int, EngramTable] = {}
    try:
        for layer in config.layer_ids:
            tables[layer] = EngramTable.open_layer(pack, config, layer, config=table_config)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    return tables


# ------------------------------------------------------------------------------------------------- dequantize


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                    arange: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Dequantize gathered Engram rows exactly as vLLM's V4.1 lookup does: ``bf16(f32(e4m3(byte)) * 2^(s - 127))``.

    The scale is built as upstream builds it, the E8M0 byte shifted into the fp32 exponent field, so byte 0 gives
    0.0 (not 2^-127) and byte 255 gives +inf (not NaN).

    Parameters
    ----------
    rows : torch.Tensor
        uint8 (or fp8) ``[N, D]``: raw fp8 E4M3 bytes.
    scales : torch.Tensor
        uint8 ``[N, D // 32]``: raw E8M0 bytes.
    out : torch.Tensor
        bfloat16 ``[N, D]`` on the same device; written.
    arange : torch.Tensor, optional
        CUDA only: an int32 tensor holding ``0, 1, ...`` (at least N values), reused across calls.

    Returns
    -------
    torch.Tensor
        ``out``. On CUDA the values come from upstream's own Triton lookup kernel run over the staged rows (the
        row ids 0..N-1), on other devices from the same arithmetic in torch (tested equal on fresh data).
    """
    n, d = rows.shape
    if scales.shape[0] != n or scales.shape[1] == 0 or d % scales.shape[1] or out.shape != (n, d):
        raise ValueError(f"rows {tuple(rows.shape)}, scales {tuple(scales.shape)} and out {tuple(out.shape)} "
                         "do not agree")  # fmt: skip
    if out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bfloat16, got {out.dtype}")
    if n == 0:
        return out
    block = d // scales.shape[1]
    if rows.device.type == "cuda":
        _upstream_lookup(rows, scales, out, block, arange)
        return out
    values = rows.view(torch.float8_e4m3fn).to(torch.float32).view(n, d // block, block)
    scale = (scales.to(torch.int32) << 23).view(torch.float32)
    out.copy_((values * scale[..., None]).view(n, d))
    return out


def _upstream_lookup(rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int,
                     arange: torch.Tensor | None) -> None:  # fmt: skip
    """vLLM's ``_engram_lookup_kernel`` over a compact table (the staged rows) with the ids 0..N-1."""
    from vllm.models.deepseek_v41.common.engram import _engram_lookup_kernel

    n, d = rows.shape
    if arange is None or arange.numel() < n:
        arange = torch.arange(n, dtype=torch.int32, device=rows.device)
    ids = arange[:n].view(n, 1)
    tiles = -(-n // 16)
    grid = min(tiles, _sm_count(rows.device))
    _engram_lookup_kernel[(grid,)](
        rows.view(torch.float8_e4m3fn), scales, ids, ids, out, 0, n, n, ids.stride(0), ids.stride(1),
        HEAD_START=0, LOCAL_HEADS=1, TOTAL_HEADS=1, DIM=d, QUANT_BLOCK=block, BLOCK_R=16, GRID=grid, SORTED=False,
        PACKED=False, OUT_STRIDE=out.stride(0),
    )  # fmt: skip


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


# ------------------------------------------------------------------------------------------------------ gather


@dataclasses.dataclass
class GatherStep:
    """What one step's gather of one table cost (host clocks, ``time.perf_counter``)."""

    tokens: int
    rows: int
    unique_rows: int
    started: float  # start(): the main thread asked for the rows
    ids_ready: float  # the worker had the row ids on the host (the GPU had hashed the step)
    gathered: float  # the rows were in pinned host memory
    enqueued: float  # their copy to the device was enqueued
    joined: float = 0.0  # finish(): the main thread had the worker's result (it waited joined - finish_called)
    finish_called: float = 0.0
    events: tuple[Any, ...] = ()  # with trace_events: CUDA events (start, before the wait, after the dequant)


class EngramRowGather:
    """One Engram table's rows for the device, one step at a time: mapped table -> pinned host -> device.

    Parameters
    ----------
    table : EngramTable
        The mapped table (engram-mmap).
    max_tokens : int
        The most tokens of one step (vLLM's ``max_num_batched_tokens``): the staging buffers' size.
    n_cols : int
        Row ids per token (``n_orders * n_heads``, 24 in V4.1).
    device : torch.device
        Where the rows are served. On a CUDA device the host buffers are pinned and the copies asynchronous; any
        other device (the CPU: a "fake device" for tests) takes the same path with plain host buffers.
    name : str
        For thread names and messages (e.g. ``"layer 1"``).

    Notes
    -----
    ``start`` and ``finish`` alternate; ``start`` returns at once (unless ``inline``), ``finish`` returns once the
    rows are in ``out`` in stream order (on CUDA: the current stream waits for the copies). Buffers are reused
    step after step; the prefetch stream orders a step's copies before the next step's row ids, so a worker never
    overwrites host buffers a pending copy still reads.
    """

    def __init__(self, table: EngramTable, max_tokens: int, n_cols: int, device: torch.device | str,
                 name: str = "table") -> None:  # fmt: skip
        if max_tokens < 1 or n_cols < 1:
            raise ValueError(f"max_tokens and n_cols must be positive, got {max_tokens}, {n_cols}")
        self.table = table
        self.name = name
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" = the current device, named here: the
            self.device = torch.device("cuda", torch.cuda.current_device())  # worker thread sets it by index
        self.max_tokens = max_tokens
        self.n_cols = n_cols
        self.dim = table.head_dim
        self.scale_cols = table.scale_cols
        self.cuda = self.device.type == "cuda"
        pin = self.cuda  # model construction may run inside a CUDA device context: name the host explicitly
        self._ids_host = torch.empty((max_tokens, n_cols), dtype=torch.int32, device="cpu", pin_memory=pin)
        self._rows_host = torch.empty((max_tokens, n_cols, self.dim), dtype=torch.uint8, device="cpu", pin_memory=pin)
        self._scales_host = torch.empty((max_tokens, n_cols, self.scale_cols), dtype=torch.uint8, device="cpu",
                                        pin_memory=pin)  # fmt: skip
        if self.cuda:
            self._rows_dev = torch.empty_like(self._rows_host, device=self.device)
            self._scales_dev = torch.empty_like(self._scales_host, device=self.device)
            self._arange: torch.Tensor | None = torch.arange(max_tokens * n_cols, dtype=torch.int32, device=self.device)
            self._ids_ready = torch.cuda.Event()
            self._copied = torch.cuda.Event()
        else:
            self._rows_dev, self._scales_dev, self._arange = self._rows_host, self._scales_host, None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"dsv41-engram-{name.replace(' ', '')}", initializer=self._init_worker
        )
        self._pending: tuple[int, torch.Tensor, concurrent.futures.Future[GatherStep] | None, GatherStep | None,
                             tuple[Any, ...]] | None = None  # fmt: skip
        #: The last finished step; ``trace`` (a list) collects every step when set, ``trace_events`` adds CUDA
        #: events (benchmarks; off by default).
        self.last: GatherStep | None = None
        self.trace: list[GatherStep] | None = None
        self.trace_events = False

    def _init_worker(self) -> None:
        if self.cuda:  # the CUDA current device is per thread (torch.cuda.set_device needs the index)
            torch.cuda.set_device(self.device.index)

    @property
    def host_bytes(self) -> int:
        """Pinned (on CUDA) host staging bytes."""
        return sum(t.numel() * t.element_size() for t in (self._ids_host, self._rows_host, self._scales_host))

    @property
    def device_bytes(self) -> int:
        """Device staging bytes (0 on the CPU)."""
        if not self.cuda:
            return 0
        assert self._arange is not None
        return sum(t.numel() * t.element_size() for t in (self._rows_dev, self._scales_dev, self._arange))

    def start(self, hash_ids: torch.Tensor, out: torch.Tensor, stream: Any = None, *, inline: bool = False) -> None:
        """Start gathering the rows of ``hash_ids`` (``[T, n_cols]`` table row ids, on the device) for ``out``.

        ``stream`` (CUDA): where the row ids are read and the rows copied; it must already be ordered after the
        kernel that wrote ``hash_ids``. ``inline``: do the host work now, on the calling thread (used while a CUDA
        graph is captured).
        """
        if self._pending is not None:
            self.finish()  # a previous step that was never finished (an aborted forward): settle it first
        t = int(hash_ids.shape[0])
        if hash_ids.ndim != 2 or hash_ids.shape[1] != self.n_cols:
            raise ValueError(f"dsv41 Engram {self.name}: row ids must be [tokens, {self.n_cols}], got "
                             f"{tuple(hash_ids.shape)}")  # fmt: skip
        if t > self.max_tokens:
            raise ValueError(f"dsv41 Engram {self.name}: {t} tokens in one step, the staging holds "
                             f"max_num_batched_tokens={self.max_tokens}")  # fmt: skip
        if out.shape[0] < t or tuple(out.shape[1:]) != (self.n_cols, self.dim) or out.dtype != torch.bfloat16:
            raise ValueError(f"dsv41 Engram {self.name}: out must be bfloat16 [>= {t}, {self.n_cols}, {self.dim}], "
                             f"got {out.dtype} {tuple(out.shape)}")  # fmt: skip
        started = time.perf_counter()
        events: tuple[Any, ...] = ()
        if t == 0:
            self._pending = (0, out, None, None, events)
            return
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "dsv41: Engram rows from disk cannot be gathered inside a captured CUDA graph (FULL graphs "
                    "capture host work): serve with compilation_config={'cudagraph_mode': 'PIECEWISE'} and "
                    "VLLM_USE_BREAKABLE_CUDAGRAPH=1, or enforce_eager=True"
                )
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            if self.trace_events:
                events = (torch.cuda.Event(enable_timing=True),)
                events[0].record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._ids_host[:t].copy_(hash_ids, non_blocking=True)
                self._ids_ready.record(stream)
        else:
            self._ids_host[:t].copy_(hash_ids)
        if inline:
            self._pending = (t, out, None, self._work(t, stream, started), events)
        else:
            self._pending = (t, out, self._pool.submit(self._work, t, stream, started), None, events)

    def _work(self, t: int, stream: Any, started: float) -> GatherStep:
        """The host half (worker thread): wait for the row ids, gather, copy to the device."""
        if self.cuda:
            self._ids_ready.synchronize()
        ids_ready = time.perf_counter()
        ids = self._ids_host[:t].numpy()
        rows, scales = self._rows_host[:t], self._scales_host[:t]
        self.table.gather(ids, rows, scales, invalid="zero")
        gathered = time.perf_counter()
        if self.cuda:
            with torch.cuda.stream(stream):
                self._rows_dev[:t].copy_(rows, non_blocking=True)
                self._scales_dev[:t].copy_(scales, non_blocking=True)
                self._copied.record(stream)
        enqueued = time.perf_counter()
        metrics.engram_gather(gathered - ids_ready)
        return GatherStep(tokens=t, rows=t * self.n_cols, unique_rows=self.table.last_unique_rows or 0,
                          started=started, ids_ready=ids_ready, gathered=gathered, enqueued=enqueued)  # fmt: skip

    def finish(self) -> None:
        """Wait for the started step's rows and dequantize them into its ``out`` (in stream order on CUDA)."""
        if self._pending is None:
            return
        t, out, future, step, events = self._pending
        self._pending = None
        called = time.perf_counter()
        if future is not None:
            step = future.result()  # re-raises the worker's error (a shard that vanished names its file)
        if t == 0 or step is None:
            return
        step.finish_called, step.joined = called, time.perf_counter()
        n = t * self.n_cols
        rows = self._rows_dev[:t].view(n, self.dim)
        scales = self._scales_dev[:t].view(n, self.scale_cols)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            if events:
                before = torch.cuda.Event(enable_timing=True)
                before.record(current)
                events = (*events, before)
            current.wait_event(self._copied)
        dequantize_rows(rows, scales, out[:t].view(n, self.dim), self._arange)
        if self.cuda and events:
            after = torch.cuda.Event(enable_timing=True)
            after.record(torch.cuda.current_stream(self.device))
            events = (*events, after)
        step.events = events
        self.last = step
        if self.trace is not None:
            self.trace.append(step)

    def lookup(self, hash_ids: torch.Tensor, out: torch.Tensor) -> None:
        """``start`` inline, then ``finish``: the rows of ``hash_ids`` in ``out`` (in stream order)."""
        self.start(hash_ids, out, inline=True)
        self.finish()

    def close(self) -> None:
        """Settle a pending step and stop the worker (the table stays open: its owner closes it)."""
        try:
            self.finish()
        finally:
            self._pool.shutdown(wait=True)


class MmapEngramEmbedding(torch.nn.Module):
    """A drop-in for upstream's ``ParallelEngramEmbedding`` on one GPU whose table stays in the pack's files.

    It has the attributes upstream's ``Engram`` reads (one shard: no tensor or data parallel split) and no
    parameters: the table is an :class:`engram_mmap.EngramTable`, its rows served by :class:`EngramRowGather`.
    """

    def __init__(self, table: EngramTable, n_hash_cols: int, max_tokens: int, device: torch.device | str,
                 layer: int) -> None:  # fmt: skip
        super().__init__()
        self.table = table
        self.layer = layer
        self.num_embeddings = self.part_num_embeddings = table.rows
        self.dim = table.head_dim
        self.block_size = table.head_dim // table.scale_cols
        self.n_hash_cols = self.part_n_hash_cols = n_hash_cols
        self.tp_size = self.dp_size = 1
        self.head_start = self.vocab_start_idx = 0
        self.vocab_end_idx = table.rows
        # Upstream's Engram gives an offloaded table a prefetch stream and a done event; its prefetch calls are
        # then the eager breaks our subclass overrides.
        self.cpu_offload = True
        self.dp_shared_memory = self.use_thp = False
        self.rows = EngramRowGather(table, max_tokens, n_hash_cols, device, name=f"layer {layer}")

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """Upstream's signature: the rows of ``indices`` ``[T, n_hash_cols]`` dequantized into ``out`` (bf16)."""
        del background  # the gather runs on the host; nothing to leave SMs for
        self.rows.lookup(indices, out)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        out = torch.empty((indices.shape[0], self.n_hash_cols, self.dim), dtype=torch.bfloat16, device=indices.device)
        self.lookup(indices, out)
        return out

    def collapse_huge_pages(self) -> None:
        """Upstream's hook for its huge-page tables; nothing to do for mapped files."""

    def extra_repr(self) -> str:
        return f"layer={self.layer}, {self.table!r}"


# ---------------------------------------------------------------------------------------------- the model hook

_ENGRAM_CLASSES: dict[bool, type] = {}


def mmap_engram_class() -> type:
    """Upstream's ``Engram`` with the table in the pack's files (created on first use: vLLM's eager-break decorator
    decides when it is applied whether breakable CUDA graphs are on, so the class is made per that state)."""
    from vllm.compilation.breakable_cudagraph import (
        BreakableCUDAGraphCapture,
        eager_break_during_capture,
        is_breakable_cudagraph_enabled,
    )
    from vllm.models.deepseek_v41.common.engram import Engram

    breakable = bool(is_breakable_cudagraph_enabled())
    if breakable in _ENGRAM_CLASSES:
        return _ENGRAM_CLASSES[breakable]

    class MmapEngram(Engram):
        """vLLM's V4.1 ``Engram`` whose rows come from the pack's files (``vllm_dsv41.engram``)."""

        def _create_embedding(self, layout: Any, layer_hash_index: int) -> MmapEngramEmbedding:
            return _build_embedding(layout, layer_hash_index)

        @eager_break_during_capture
        def _start_prefetch(self, hash_ids: torch.Tensor, rows: torch.Tensor) -> None:
            if BreakableCUDAGraphCapture.current() is not None:
                # While a graph is captured, the hash kernel's segment is recorded, not run: its ids are unset
                # memory, and gathering their rows would page in random rows of the tables for nothing. This break
                # runs at every replay, where the ids are real; finish() has nothing pending until then.
                return
            stream = self._prefetch_stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream())
            hash_ids.record_stream(stream)  # the hash buffer is read on the prefetch stream
            self.embed_tokens.rows.start(hash_ids, rows, stream)

        @eager_break_during_capture
        def _finish_prefetch(self, event: Any) -> None:
            del event  # upstream's done event; ours are the gather's
            self.embed_tokens.rows.finish()

    _ENGRAM_CLASSES[breakable] = MmapEngram
    return MmapEngram


def _build_embedding(layout: Any, layer_hash_index: int) -> MmapEngramEmbedding:
    """The embedding of one Engram layer of the model vLLM is building (its pack is ``model_config.model``)."""
    from vllm.config import get_current_vllm_config
    from vllm.logger import init_logger

    from .config import Dsv41PluginConfig

    vcfg = get_current_vllm_config()
    pack = Path(vcfg.model_config.model)
    plugin = Dsv41PluginConfig.from_vllm_config(vcfg)
    config = EngramConfig.from_hf_config(pack)
    layer = int(layout.layer_ids[layer_hash_index])
    check_layout(layout, config)
    table = EngramTable.open_layer(pack, config, layer, config=plugin.engram_table)
    device = torch.get_default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    emb = MmapEngramEmbedding(table, config.n_cols, vcfg.scheduler_config.max_num_batched_tokens, device, layer)
    init_logger("vllm.dsv41").info(
        "dsv41: Engram layer %d served from the pack's files: %s, %.2f GiB mapped (not read); staging %.1f MiB "
        "pinned + %.1f MiB on %s", layer, table, table.rows * (table.head_dim + table.scale_cols) / 2**30,
        emb.rows.host_bytes / 2**20, emb.rows.device_bytes / 2**20, device,
    )  # fmt: skip
    return emb


def check_layout(layout: Any, config: EngramConfig) -> None:
    """Raise unless upstream's Engram layout (hash primes per layer) is engram-mmap's: the row ids the model hashes
    must address the rows the tables hold."""
    if tuple(layout.layer_ids) != config.layer_ids:
        raise ValueError(f"dsv41 Engram: vLLM's layout has layers {tuple(layout.layer_ids)}, the pack's config "
                         f"{config.layer_ids}")  # fmt: skip
    for i, layer in enumerate(config.layer_ids):
        ours = config.primes(layer).tolist()
        theirs = [list(order) for order in layout.primes[i]]
        if ours != theirs:
            raise ValueError(f"dsv41 Engram: layer {layer}'s hash primes differ between vLLM ({theirs}) and "
                             f"engram-mmap ({ours}); the row ids would not address the table's rows")  # fmt: skip
        if int(layout.num_embeddings[i]) != config.table_rows(layer):
            raise ValueError(f"dsv41 Engram: layer {layer} has {layout.num_embeddings[i]} rows in vLLM's layout, "
                             f"{config.table_rows(layer)} in the pack's")  # fmt: skip


@contextlib.contextmanager
def engram_construction(vllm_config: Any, plugin_engram: str) -> Iterator[bool]:
    """While upstream's V4.1 model is built: bind upstream's ``Engram`` to the mapped-table subclass when the plugin
    serves the tables from disk (``plugin_engram == "mmap"`` and the model has Engram layers). Yields whether it
    does; restores the binding afterwards."""
    if plugin_engram not in ENGRAM_MODES:
        raise ValueError(f"engram: expected one of {ENGRAM_MODES}, got {plugin_engram!r}")
    hf = vllm_config.model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    if plugin_engram != "mmap" or not getattr(text, "engram_layer_ids", None):
        yield False
        return
    from vllm.models.deepseek_v41.nvidia import model as nvidia_model

    mode = _v1_runner_graphs(vllm_config)
    if mode:
        logging.getLogger("vllm.dsv41.engram").warning(
            "dsv41 Engram: vLLM runs its V1 model runner with CUDA graphs (%s): upstream's V4.1 model hashes "
            "Engram's n-grams only in steps with attention metadata, which that runner's graph capture does not give, "
            "so captured graphs may replay without Engram (not checked on a GPU; the V2 runner, vLLM's default, builds "
            "the metadata). --enforce-eager avoids it", mode)  # fmt: skip
    original = nvidia_model.Engram
    nvidia_model.Engram = mmap_engram_class()
    try:
        yield True
    finally:
        nvidia_model.Engram = original


def _v1_runner_graphs(vllm_config: Any) -> str:
    """The CUDA graph mode's name when vLLM will run its V1 model runner with graphs (else "")."""
    if getattr(vllm_config, "use_v2_model_runner", True):
        return ""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    name = str(getattr(mode, "name", mode or "NONE"))
    return "" if name == "NONE" else name


def engram_gathers(model: torch.nn.Module) -> dict[int, EngramRowGather]:
    """The row gathers of a built model, by Engram layer (benchmarks and tests; empty for ``engram="upstream"``)."""
    return {m.layer: m.rows for m in model.modules() if isinstance(m, MmapEngramEmbedding)}
