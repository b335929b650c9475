"""EngramTable: one Engram embedding table mapped from its safetensors shards, and the row gather."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np

from . import _native
from .config import EngramConfig
from .safetensors_header import EngramFormatError, TensorInfo, read_header, resolve_tensor_files

__all__ = [
    "TABLE_TENSOR_RE",
    "EngramTable",
    "GatherHandle",
    "PrefetchHandle",
    "TableConfig",
    "table_prefix",
    "table_tensor_layer",
]

WEIGHT_DTYPES = ("F8_E4M3", "U8")
SCALE_DTYPES = ("F8_E8M0", "U8")
#: The checkpoint names of the Engram table tensors (DeepSeek V4.1): ``layers.<N>.engram.embed.{weight,scale}``.
TABLE_TENSOR_RE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.engram\.embed\.(?P<part>weight|scale)$")
Invalid = Literal["raise", "zero"]


def table_prefix(layer: int) -> str:
    """The tensor name prefix of Engram layer ``layer``'s table: ``layers.<layer>.engram.embed``."""
    return f"layers.{layer}.engram.embed"


def table_tensor_layer(name: str) -> int | None:
    """The Engram layer whose table tensor ``name`` is (``layers.N.engram.embed.weight|scale``), else None."""
    m = TABLE_TENSOR_RE.match(name)
    return None if m is None else int(m["layer"])


@dataclass(frozen=True, slots=True)
class TableConfig:
    """How a table is mapped and gathered.

    Parameters
    ----------
    num_threads : int
        Threads per gather, the calling (or driver) thread included. Cold rows are synchronous page
        faults, so this is the I/O queue depth per table, not a core count.
    dedup : bool
        Read each distinct row once per gather and copy the repeats from the output.
    readahead_max_rows : int
        A gather with at most this many distinct rows (a decode step: 24 per token and layer) first
        submits POSIX_FADV_WILLNEED for each of them, so all its reads are in flight at once, and
        then copies on the calling thread alone (no pool wake-up). It costs two syscalls per row
        when the rows are cached. Larger gathers copy on the pool, where each thread faults pages
        synchronously (queue depth = ``num_threads``). 0 disables it.
    random_access : bool
        MADV_RANDOM / POSIX_FADV_RANDOM on the mappings: a page fault then reads one page, not a
        read-around window (``read_ahead_kb``) per 264-byte row.
    resident_scales : bool
        Copy the scale tensor into process memory when the table opens (rows x 8 bytes: 2.9 GiB per
        V4.1 table, read once sequentially), so that a row not in the page cache costs one page read
        (its fp8 bytes) instead of two.
    """

    num_threads: int = 64
    dedup: bool = True
    readahead_max_rows: int = 2048
    random_access: bool = True
    resident_scales: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_threads <= 1024:
            raise ValueError(f"num_threads: must be in [1, 1024], got {self.num_threads}")
        if self.readahead_max_rows < 0:
            raise ValueError(f"readahead_max_rows: must be >= 0, got {self.readahead_max_rows}")


class GatherHandle:
    """An asynchronous gather in flight (from :meth:`EngramTable.gather_async`).

    The handle keeps the row ids and the output buffers alive; dropping it waits for the gather.
    """

    def __init__(self, pending: Any, rows: Any, scales: Any) -> None:
        self._pending = pending
        self._rows = rows
        self._scales = scales
        self.unique_rows: int | None = None

    def done(self) -> bool:
        """Whether the gather has finished (without waiting)."""
        return bool(self._pending.done())

    def wait(self) -> tuple[Any, Any]:
        """Wait (GIL released) and return ``(rows, scales)``; raises what the gather raised."""
        self.unique_rows = int(self._pending.wait())
        return self._rows, self._scales


class PrefetchHandle:
    """A prefetch in flight. It owns a copy of the row ids: dropping it does not wait."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def done(self) -> bool:
        """Whether every read has been submitted."""
        return bool(self._work.done())

    def wait(self) -> None:
        """Wait until the reads are submitted (not until they complete)."""
        self._work.wait()


def _check_tensor(info: TensorInfo, dtypes: tuple[str, ...], what: str) -> None:
    if info.dtype not in dtypes:
        raise EngramFormatError(
            f"{info.path}: tensor {info.name!r} has dtype {info.dtype}, expected {' or '.join(dtypes)} ({what})"
        )
    if len(info.shape) != 2:
        raise EngramFormatError(f"{info.path}: tensor {info.name!r} has shape {info.shape}, expected 2-D ({what})")


class EngramTable:
    """One Engram table (``<prefix>.weight`` fp8 rows + ``<prefix>.scale`` E8M0 scales), mapped.

    Open with :meth:`open` or :meth:`open_layer`; use as a context manager. Nothing is read at open
    beyond the safetensors headers.

    Attributes
    ----------
    rows : int
        Table rows.
    head_dim : int
        Bytes (fp8 values) per row.
    scale_cols : int
        E8M0 scales per row (``head_dim // quant_block``).
    weight, scale : TensorInfo
        Where the two tensors lie.
    """

    def __init__(self, weight: TensorInfo, scale: TensorInfo, config: TableConfig) -> None:
        self.weight = weight
        self.scale = scale
        self.config = config
        self.rows = weight.shape[0]
        self.head_dim = weight.shape[1]
        self.scale_cols = scale.shape[1]
        self.last_unique_rows: int | None = None
        self._mappings: dict[str, Any] = {}
        try:
            for path in dict.fromkeys((weight.path, scale.path)):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    self._mappings[path] = _native.Mapping(fd, os.fstat(fd).st_size, path, config.random_access)
                finally:
                    os.close(fd)
            self._native = _native.Table(
                self._mappings[weight.path], weight.offset, self.head_dim,
                self._mappings[scale.path], scale.offset, self.scale_cols,
                self.rows, config.num_threads, config.dedup, config.readahead_max_rows, config.resident_scales,
            )  # fmt: skip
        except BaseException:
            for m in self._mappings.values():
                m.close()
            raise

    # ----------------------------------------------------------------------------------- open

    @classmethod
    def open(
        cls,
        source: str | os.PathLike[str],
        prefix: str,
        *,
        rows: int | None = None,
        head_dim: int | None = None,
        quant_block: int = 32,
        config: TableConfig | None = None,
    ) -> EngramTable:
        """Map the table ``<prefix>.weight`` / ``<prefix>.scale``.

        Parameters
        ----------
        source : path-like
            ``model.safetensors.index.json``, a folder holding it, or one ``.safetensors`` shard.
        prefix : str
            Tensor name prefix, e.g. ``"layers.1.engram.embed"``.
        rows, head_dim : int, optional
            Expected shape of the weight tensor; checked when given.
        quant_block : int
            Columns per scale: the scale tensor must be ``[rows, head_dim // quant_block]``.
        config : TableConfig, optional
            Gather settings.

        Raises
        ------
        FileNotFoundError
            The index, or a shard it names, is missing.
        EngramFormatError
            A malformed header, a missing tensor, a wrong dtype or shape, a truncated file.
        """
        weight_name, scale_name = f"{prefix}.weight", f"{prefix}.scale"
        files = resolve_tensor_files(source, [weight_name, scale_name])
        headers: dict[str, dict[str, TensorInfo]] = {}
        infos = []
        for name in (weight_name, scale_name):
            path = files[name]
            if path not in headers:
                headers[path] = read_header(path)
            if name not in headers[path]:
                raise EngramFormatError(f"{path}: no tensor {name!r}")
            infos.append(headers[path][name])
        weight, scale = infos
        _check_tensor(weight, WEIGHT_DTYPES, "Engram rows, fp8 e4m3")
        _check_tensor(scale, SCALE_DTYPES, "Engram scales, e8m0")
        n, d = weight.shape
        if rows is not None and n != rows:
            raise EngramFormatError(f"{weight.path}: tensor {weight_name!r} has {n} rows, expected {rows}")
        if head_dim is not None and d != head_dim:
            raise EngramFormatError(f"{weight.path}: tensor {weight_name!r} has {d} columns, expected {head_dim}")
        if d == 0 or d % quant_block:
            raise EngramFormatError(
                f"{weight.path}: tensor {weight_name!r} has {d} columns, not a positive multiple of {quant_block}"
            )
        if scale.shape != (n, d // quant_block):
            raise EngramFormatError(
                f"{scale.path}: tensor {scale_name!r} has shape {scale.shape}, expected {(n, d // quant_block)} "
                f"(one scale per {quant_block} columns of {weight_name!r} {weight.shape})"
            )
        return cls(weight, scale, config or TableConfig())

    @classmethod
    def open_layer(
        cls,
        source: str | os.PathLike[str],
        engram: EngramConfig,
        layer: int,
        *,
        config: TableConfig | None = None,
    ) -> EngramTable:
        """Map the V4.1 table of one Engram layer (``layers.<layer>.engram.embed``), checking its
        shape against ``engram.table_rows(layer)`` and ``engram.head_dim``."""
        return cls.open(
            source,
            table_prefix(layer),
            rows=engram.table_rows(layer),
            head_dim=engram.head_dim,
            quant_block=engram.quant_block,
            config=config,
        )

    # ------------------------------------------------------------------------------ gather

    def _prepare(self, row_ids: Any, out_rows: Any, out_scales: Any, invalid: str) -> tuple[np.ndarray, Any, Any]:
        if invalid not in ("raise", "zero"):
            raise ValueError(f"invalid must be 'raise' or 'zero', got {invalid!r}")
        ids = np.asarray(row_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"row_ids must be integers, got {ids.dtype}")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if out_rows is None:
            out_rows = np.empty((*ids.shape, self.head_dim), np.uint8)
        if out_scales is None:
            out_scales = np.empty((*ids.shape, self.scale_cols), np.uint8)
        for name, arr in (("out_rows", out_rows), ("out_scales", out_scales)):
            if isinstance(arr, np.ndarray) and not arr.flags.writeable:
                raise ValueError(f"{name} is read-only")
        return ids, out_rows, out_scales

    def gather(
        self, row_ids: Any, out_rows: Any = None, out_scales: Any = None, *, invalid: Invalid = "raise"
    ) -> tuple[Any, Any]:
        """Copy rows out of the mapped table (parallel, GIL released).

        Parameters
        ----------
        row_ids : array_like of int, any shape ``S``
            Rows to read, each in ``[0, rows)`` (else IndexError, outputs untouched; see ``invalid``).
        out_rows : buffer, optional
            Host buffer of 1-byte elements, C-contiguous, ``S + (head_dim,)`` (or any shape with that
            size and last dim): numpy array or (pinned) torch CPU tensor. Allocated when None.
        out_scales : buffer, optional
            The same for the scales, last dim ``scale_cols``.
        invalid : {"raise", "zero"}
            What an id outside ``[0, rows)`` does: raise IndexError (nothing written), or give a row and
            scales of zero bytes (fp8 +0 x scale byte 0), which is what vLLM's V4.1 Engram lookup yields for
            ids it does not own, such as the -1 of dead tokens.

        Returns
        -------
        (out_rows, out_scales)
            The filled buffers: raw fp8 e4m3 bytes and raw e8m0 bytes (see :func:`dequantize`).
        """
        ids, out_rows, out_scales = self._prepare(row_ids, out_rows, out_scales, invalid)
        self.last_unique_rows = int(self._native.gather(ids, out_rows, out_scales, invalid == "zero"))
        return out_rows, out_scales

    def gather_async(
        self, row_ids: Any, out_rows: Any = None, out_scales: Any = None, *, invalid: Invalid = "raise"
    ) -> GatherHandle:
        """:meth:`gather` on the table's driver thread; returns at once with a handle to ``wait()``.

        Row ids are validated before returning. The buffers must not be touched until ``wait()``.
        Asynchronous gathers and prefetches of one table run in submission order.
        """
        ids, out_rows, out_scales = self._prepare(row_ids, out_rows, out_scales, invalid)
        return GatherHandle(self._native.gather_async(ids, out_rows, out_scales, invalid == "zero"), out_rows,
                            out_scales)  # fmt: skip

    def prefetch(self, row_ids: Any, wait: bool = False) -> PrefetchHandle | None:
        """Start reading rows into the page cache (POSIX_FADV_WILLNEED), e.g. as soon as the token
        ids of a step are known; a later :meth:`gather` of the same rows then finds them cached.

        Parameters
        ----------
        row_ids : array_like of int
            Rows to prefetch (validated at once).
        wait : bool
            Submit the reads on the calling thread (GIL released) and return None; otherwise submit
            them on the driver thread and return a handle.
        """
        ids = np.ascontiguousarray(np.asarray(row_ids), dtype=np.int64)
        if wait:
            self._native.prefetch(ids)
            return None
        return PrefetchHandle(self._native.prefetch_async(ids))

    # ------------------------------------------------------------------------- page cache

    def evict(self) -> None:
        """Drop the table's files from the page cache (benchmarks: a cold start). Pages mapped by
        other processes may stay."""
        for m in self._mappings.values():
            m.evict()

    def resident_fraction(self) -> tuple[float, float]:
        """Fractions of the weight and scale tensors' pages in the page cache (mincore)."""
        out = []
        for info in (self.weight, self.scale):
            res, total = self._mappings[info.path].resident(info.offset, info.nbytes)
            out.append(res / total if total else 1.0)
        return out[0], out[1]

    # ----------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Finish queued asynchronous work, stop the threads and unmap the files. Idempotent."""
        native = getattr(self, "_native", None)
        if native is not None:
            native.close()
        for m in getattr(self, "_mappings", {}).values():
            m.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return bool(self._native.closed)

    def __enter__(self) -> EngramTable:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"EngramTable({self.weight.name!r} {self.rows}x{self.head_dim} {self.weight.dtype} in "
            f"{os.path.basename(self.weight.path)}, scales {self.scale.dtype} in {os.path.basename(self.scale.path)})"
        )
