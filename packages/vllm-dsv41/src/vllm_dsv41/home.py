"""``ExpertHome``: the one host copy of a pack's routed experts, memory-mapped from the pack's own files.

Every routed-expert tensor of the pack (``<moe>.experts.<E>.<proj>.<part>``, found through the pack's index or
the safetensors headers) is read in place: the byte ranges of the files that hold them are mapped read-only
(``MAP_SHARED``, so the bytes are the page cache's, never a private copy) and, when a GPU is present,
page-locked once with ``cudaHostRegister`` (read-only, mapped, portable) so every tier can DMA from them or read
them from the GPU. Each mapping is followed by a zeroed tail pad (an anonymous read-only reservation the file is
mapped over), so kernels that read a little past the last tensor never fault.

Nothing else holds the experts: the CPU tier, the all-in-VRAM oracle, the VRAM expert cache
(:meth:`ExpertHome.cache_home`: expert-cache's address-based home over these mappings) and the staged prefill all
take views (``Exl3Tensor``s of numpy views, or raw addresses) of these mappings. vLLM's weight reader never sees
them (the plugin's model loader filters them out).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cpu_tier.exl3 import Exl3Tensor
from engram_mmap.safetensors_header import TensorInfo, read_header

if TYPE_CHECKING:
    from expert_cache import ExpertCacheConfig, ExpertRows, ProjectionSpec

__all__ = [
    "EXPERT_COLUMNS",
    "EXPERT_RE",
    "PROJECTIONS",
    "CacheHome",
    "ExpertHome",
    "HomeStats",
    "LayerExperts",
    "expert_problems",
    "expert_tensor",
    "process_memory",
    "resident_bytes",
]

#: A routed expert's tensor: ``<moe>.experts.<e>.<proj>.<part>`` (``layers.3.ffn`` for V4.1's native names,
#: ``model.layers.3.mlp`` for the demo's). ``<moe>`` must hold the decoder layer number.
EXPERT_RE = re.compile(r"^(?P<moe>.*?layers\.(?P<layer>\d+)\.[A-Za-z_]+)\.experts\.(?P<expert>\d+)\."
                       r"(?P<proj>[A-Za-z0-9_]+)\.(?P<part>[A-Za-z0-9_]+)$")  # fmt: skip
#: Checkpoint projection names -> role (DeepSeek's native w1/w3/w2 and the HF gate/up/down names).
PROJECTIONS: dict[str, str] = {"w1": "gate", "w3": "up", "w2": "down",
                               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # fmt: skip
_ROLES = ("gate", "up", "down")
#: An expert's EXL3 tensors as the GPU tiers address them: one column of the VRAM cache's pointer table per
#: (role, part), in this order (the hit kernels index the columns by position).
EXPERT_COLUMNS: tuple[tuple[str, str], ...] = tuple((r, p) for r in _ROLES for p in ("trellis", "suh", "svh"))
_PAGE = mmap.PAGESIZE
_MERGE_GAP = 1 << 20  # expert tensors closer than this share one mapping (the gap is mapped too)
_NP_DTYPES = {"I16": np.int16, "F16": np.float16, "I32": np.int32, "F32": np.float32, "BF16": np.uint16,
              "U8": np.uint8, "I8": np.int8}  # fmt: skip
#: safetensors dtype -> expert-cache ``ProjectionSpec.dtype``.
_SPEC_DTYPES = {"I16": "int16", "F16": "float16", "I32": "int32", "F32": "float32", "BF16": "bfloat16",
                "U8": "uint8", "I8": "int8"}  # fmt: skip


def expert_tensor(name: str) -> tuple[int, int, str, str] | None:
    """``(layer, expert, role, part)`` of a routed-expert tensor name, else None (MTP/``mtp.*`` names: None)."""
    m = EXPERT_RE.match(name)
    if m is None or name.startswith("mtp.") or ".mtp." in name:
        return None
    role = PROJECTIONS.get(m["proj"])
    if role is None:
        return None
    return int(m["layer"]), int(m["expert"]), role, m["part"]


# ----------------------------------------------------------------------------------------- raw mappings

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MADV_WILLNEED = 3


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class _Mapping:
    """One read-only mapping of ``[begin, end)`` of a file, page-aligned, followed by a zeroed tail pad."""

    def __init__(self, path: Path, begin: int, end: int, tail_pad: int) -> None:
        self.path = path
        self.file_offset = begin // _PAGE * _PAGE  # mmap offsets must be page-aligned
        self.lead = begin - self.file_offset
        file_len = _round_up(end - self.file_offset, _PAGE)
        self.length = _round_up(end - self.file_offset + tail_pad, _PAGE)
        base = _libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                          -1, 0)  # fmt: skip
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"{path}: cannot reserve {self.length} bytes of address space")
        self.base: int = base
        fd = os.open(path, os.O_RDONLY)
        try:
            got = _libc.mmap(base, file_len, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, self.file_offset)
        finally:
            os.close(fd)
        if got != base:
            err = ctypes.get_errno()
            _libc.munmap(base, self.length)
            raise OSError(err, f"{path}: mmap of bytes [{self.file_offset}, {self.file_offset + file_len}) failed")
        self.registered = False
        self.device_base = 0
        buf = (ctypes.c_uint8 * self.length).from_address(base)
        self.array = np.frombuffer(buf, dtype=np.uint8)
        self.array.flags.writeable = False  # the OS refuses writes (PROT_READ): numpy says so instead of a SIGSEGV

    def view(self, info: TensorInfo) -> np.ndarray:
        start = info.offset - self.file_offset
        raw = self.array[start : start + info.nbytes]
        return raw.view(_NP_DTYPES[info.dtype]).reshape(info.shape)

    def contains(self, info: TensorInfo) -> bool:
        return self.file_offset <= info.offset and info.offset + info.nbytes <= self.file_offset + self.length

    def willneed(self) -> None:
        _libc.madvise(self.base, self.length, _MADV_WILLNEED)

    def close(self) -> None:
        if self.base:
            self.array = np.empty(0, np.uint8)
            _libc.munmap(self.base, self.length)
            self.base = 0


# ------------------------------------------------------------------------------------------------- home


@dataclass(frozen=True, slots=True)
class LayerExperts:
    """One MoE layer's routed experts as views of the home (one ``Exl3Tensor`` per expert and role)."""

    layer: int
    gate: tuple[Exl3Tensor, ...]
    up: tuple[Exl3Tensor, ...]
    down: tuple[Exl3Tensor, ...]

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @property
    def hidden(self) -> int:
        return self.gate[0].k

    @property
    def intermediate(self) -> int:
        return self.gate[0].n


@dataclass(frozen=True, slots=True)
class HomeStats:
    """What opening the home cost (printed in the load log)."""

    files: int
    mappings: int
    expert_bytes: int
    mapped_bytes: int
    registered: bool
    map_seconds: float
    register_seconds: float


class _Handle:
    """``keys()``/``get_tensor()`` over the home's tensors, for ``Exl3Tensor.from_safetensors``."""

    def __init__(self, home: ExpertHome, names: Iterable[str]) -> None:
        self._home = home
        self._names = list(names)

    def keys(self) -> list[str]:
        return self._names

    def get_tensor(self, name: str) -> np.ndarray:
        return self._home.array(name)


class ExpertHome:
    """The routed experts of a pack, mapped from its files (see the module docstring).

    Parameters
    ----------
    pack : the pack (or checkpoint) directory.
    register : page-lock the mappings with CUDA (needs a GPU; the caller decides).
    tail_pad : zeroed bytes after each mapping.
    populate : fault every page in at open (``MADV_WILLNEED`` and a read of every page) so that the load time is
        paid here, not at the first forward; registration populates anyway.
    layers : map only these MoE layers' experts (a pipeline-parallel stage's; ``vllm_dsv41.parallel``); None: all.
        Homes of disjoint layer sets map disjoint byte ranges of the same files: their pages are the page cache's,
        one copy shared by every process that maps them. A layer the pack has no experts for is a ``KeyError``.
    """

    def __init__(self, pack: str | os.PathLike[str], *, register: bool = False, tail_pad: int = 4096,
                 populate: bool = False, layers: Iterable[int] | None = None) -> None:  # fmt: skip
        self.pack = Path(pack)
        wanted = None if layers is None else frozenset(int(x) for x in layers)
        t0 = time.perf_counter()
        self._infos: dict[str, TensorInfo] = {}
        self._where: dict[str, _Mapping] = {}
        self._mappings: list[_Mapping] = []
        self._layers: dict[int, dict[tuple[int, str], list[str]]] = defaultdict(lambda: defaultdict(list))
        try:
            by_file: dict[Path, list[TensorInfo]] = defaultdict(list)
            for path, all_names in _expert_names_by_file(self.pack).items():
                names = all_names if wanted is None else [n for n in all_names if expert_tensor(n)[0] in wanted]  # type: ignore[index]
                if not names:
                    continue
                header = read_header(path)
                for n in names:
                    info = header.get(n)
                    if info is None:
                        raise ValueError(f"{path}: {n}: named by the index but not in the file")
                    if info.dtype not in _NP_DTYPES:
                        raise ValueError(f"{path}: {n}: unexpected dtype {info.dtype} for an EXL3 tensor")
                    by_file[path].append(info)
                    self._infos[n] = info
                    layer, expert, role, part = expert_tensor(n)  # type: ignore[misc]
                    self._layers[layer][(expert, role)].append(n)
            if wanted is not None and wanted - set(self._layers):
                missing = sorted(wanted - set(self._layers))
                raise KeyError(f"{self.pack}: MoE layers {missing} have no routed experts in the pack")
            if not self._infos:
                raise ValueError(f"{self.pack}: no routed-expert tensors (<moe>.experts.<E>.<proj>.<part>) found")
            for path, infos in sorted(by_file.items()):
                for begin, end, members in _ranges(infos):
                    m = _Mapping(path, begin, end, tail_pad)
                    self._mappings.append(m)
                    for info in members:
                        self._where[info.name] = m
            t1 = time.perf_counter()
            if populate and not register:
                self.populate()
            self.registered = False
            if register:
                self._register()
            t2 = time.perf_counter()
        except BaseException:
            self.close()
            raise
        self.stats = HomeStats(
            files=len(by_file), mappings=len(self._mappings), expert_bytes=sum(i.nbytes for i in self._infos.values()),
            mapped_bytes=sum(m.length for m in self._mappings), registered=self.registered,
            map_seconds=t1 - t0, register_seconds=t2 - t1,
        )  # fmt: skip

    # -------------------------------------------------------------------------------------------- basics

    def __enter__(self) -> ExpertHome:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unregister and unmap. Views handed out must not be used afterwards."""
        for m in getattr(self, "_mappings", []):
            if m.registered:
                from dma_prefill import _cudart

                with contextlib.suppress(Exception):
                    _cudart.host_unregister(m.base)
                m.registered = False
            m.close()
        self._mappings = []

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._layers))

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def array(self, name: str) -> np.ndarray:
        """The numpy view of one tensor (no copy; read-only memory)."""
        try:
            return self._where[name].view(self._infos[name])
        except KeyError:
            raise KeyError(f"{self.pack}: {name}: not a routed-expert tensor of the home") from None

    def address(self, name: str, *, device: bool = False) -> int:
        """The host address of a tensor, or its GPU-mapped address (``device=True``, registered homes only)."""
        m = self._where[name]
        off = self._infos[name].offset - m.file_offset
        if device:
            if not m.registered:
                raise RuntimeError(f"{name}: the home is not registered with CUDA")
            return m.device_base + off
        return m.base + off

    def populate(self) -> None:
        """Bring every mapped page into memory now (read-ahead, then one read per page)."""
        for m in self._mappings:
            m.willneed()
            int(m.array[::_PAGE].sum(dtype=np.uint64))

    def _register(self) -> None:
        from dma_prefill import _cudart

        flags = _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY
        for m in self._mappings:
            m.willneed()
            _cudart.host_register(m.base, m.length, flags)
            m.registered = True
            m.device_base, _ = _cudart.device_pointer(m.base)
        self.registered = True

    # --------------------------------------------------------------------------------------- experts

    def layer(self, layer: int) -> LayerExperts:
        """The layer's experts as ``Exl3Tensor`` views (validated; names in errors are the checkpoint's)."""
        parts = self._layers.get(layer)
        if not parts:
            raise KeyError(
                f"{self.pack}: MoE layer {layer} has no routed experts in the pack (layers {self.layer_ids})"
            )
        experts = sorted({e for e, _ in parts})
        if experts != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ValueError(f"{self.pack}: layer {layer}: experts {missing} are missing")
        out: dict[str, list[Exl3Tensor]] = {r: [] for r in _ROLES}
        for role in _ROLES:
            for e in experts:
                names = parts.get((e, role))
                if not names:
                    raise ValueError(f"{self.pack}: layer {layer} expert {e}: no {role} projection tensors")
                prefix = names[0].rsplit(".", 1)[0]
                out[role].append(Exl3Tensor.from_safetensors(_Handle(self, names), prefix))
        g, u, d = (tuple(out[r]) for r in _ROLES)
        for e, (a, b, c) in enumerate(zip(g, u, d, strict=True)):
            if (a.k, a.n) != (b.k, b.n) or (c.k, c.n) != (a.n, a.k):
                raise ValueError(f"{self.pack}: layer {layer} expert {e}: gate {a.k}x{a.n}, up {b.k}x{b.n}, "
                                 f"down {c.k}x{c.n} do not form a SwiGLU expert")  # fmt: skip
        return LayerExperts(layer, g, u, d)

    def layers(self) -> Iterator[LayerExperts]:
        for lid in self.layer_ids:
            yield self.layer(lid)

    def cache_home(self, layer_ids: Iterable[int] | None = None) -> CacheHome:
        """The experts of ``layer_ids`` (default: every MoE layer, ascending) as expert-cache's address-based home.

        Cache layer ``i`` is MoE layer ``layer_ids[i]`` (the cache counts from 0; the model numbers decoder layers).
        One pointer-table column per :data:`EXPERT_COLUMNS` entry, named ``"<role>.<part>"``; each column must have
        one shape and dtype across every expert of every listed layer (the cache has one slot layout), else a
        ``ValueError`` names the tensor that differs. The rows are these mappings (one ``uint8`` buffer each), with
        the GPU-mapped address of each when the home is registered: the cache reads them in place, copies nothing.
        The home must stay open while the cache uses them. Needs expert-cache installed.
        """
        import torch

        from expert_cache import ExpertRows, ProjectionSpec

        lids = self.layer_ids if layer_ids is None else tuple(int(x) for x in layer_ids)
        if not lids:
            raise ValueError(f"{self.pack}: layer_ids: no layers given")
        if len(set(lids)) != len(lids):
            raise ValueError(f"{self.pack}: layer_ids: {list(lids)} lists a layer twice")
        num_experts = 0
        for lid in lids:
            parts = self._layers.get(lid)
            if not parts:
                raise KeyError(
                    f"{self.pack}: MoE layer {lid} has no routed experts in the pack (layers {self.layer_ids})"
                )
            experts = sorted({e for e, _ in parts})
            if experts != list(range(len(experts))):
                missing = sorted(set(range(max(experts) + 1)) - set(experts))
                raise ValueError(f"{self.pack}: layer {lid}: experts {missing} are missing")
            if num_experts and len(experts) != num_experts:
                raise ValueError(f"{self.pack}: layer {lid} has {len(experts)} routed experts, layer {lids[0]} has "
                                 f"{num_experts}; the VRAM cache needs one expert count")  # fmt: skip
            num_experts = len(experts)
        index = {id(m): i for i, m in enumerate(self._mappings)}
        L, P, E = len(lids), len(EXPERT_COLUMNS), num_experts
        buffer = np.empty((L, P, E), np.int32)
        offset = np.empty((L, P, E), np.int64)
        first: list[str] = []
        for i, lid in enumerate(lids):
            parts = self._layers[lid]
            for p, (role, part) in enumerate(EXPERT_COLUMNS):
                for e in range(E):
                    name = next((n for n in parts.get((e, role), ()) if n.rsplit(".", 1)[1] == part), None)
                    if name is None:
                        raise ValueError(f"{self.pack}: layer {lid} expert {e}: no {role} {part} tensor")
                    info = self._infos[name]
                    if len(first) == p:
                        if not info.shape:
                            raise ValueError(f"{self.pack}: {name}: a scalar, not a pointer-table column")
                        first.append(name)
                    ref = self._infos[first[p]]
                    if (info.dtype, tuple(info.shape)) != (ref.dtype, tuple(ref.shape)):
                        raise ValueError(
                            f"{self.pack}: {name}: {info.dtype} {list(info.shape)} differs from {first[p]}'s "
                            f"{ref.dtype} {list(ref.shape)}; the VRAM cache needs one shape per column ({role}.{part})"
                        )
                    m = self._where[name]
                    buffer[i, p, e] = index[id(m)]
                    offset[i, p, e] = info.offset - m.file_offset
        specs = tuple(
            ProjectionSpec(f"{role}.{part}", tuple(self._infos[n].shape), _SPEC_DTYPES[self._infos[n].dtype])
            for (role, part), n in zip(EXPERT_COLUMNS, first, strict=True)
        )
        buffers = tuple(
            torch.frombuffer((ctypes.c_uint8 * m.length).from_address(m.base), dtype=torch.uint8)
            for m in self._mappings
        )
        bases = tuple(m.device_base for m in self._mappings) if self.registered else ()
        return CacheHome(lids, E, specs, ExpertRows(buffers, buffer, offset, bases, self))

    def describe(self) -> str:
        s = self.stats
        gib = 1 << 30
        return (
            f"{s.expert_bytes / gib:.3f} GiB of routed experts in {len(self._layers)} layers, "
            f"{s.files} files, {s.mappings} mappings ({s.mapped_bytes / gib:.3f} GiB mapped), "
            f"mapped in {s.map_seconds:.2f} s"
            + (
                f", registered with CUDA in {s.register_seconds:.2f} s "
                f"({s.mapped_bytes / max(s.register_seconds, 1e-9) / 1e9:.2f} GB/s)"
                if s.registered
                else ""
            )
        )


#: ``cudaHostRegisterReadOnly``: pin a read-only mapping (the GPU only reads it).
HOST_REGISTER_READ_ONLY = 8


@dataclass(frozen=True, eq=False)
class CacheHome:
    """A home's routed experts as expert-cache's ``ExpertCache`` takes them (:meth:`ExpertHome.cache_home`).

    ``layer_ids[i]`` is the MoE layer behind cache layer ``i``; ``projections`` are the pointer-table columns
    (:data:`EXPERT_COLUMNS` order, named ``"<role>.<part>"``); ``rows`` the address-based home for
    ``ExpertCache(config, rows, device)``.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    projections: tuple[ProjectionSpec, ...]
    rows: ExpertRows

    def cache_layer(self, layer_id: int) -> int:
        """The cache's index of MoE layer ``layer_id``."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise KeyError(f"MoE layer {layer_id} is not in the cache (layers {list(self.layer_ids)})") from None

    def cache_config(self, **fields: Any) -> ExpertCacheConfig:
        """``ExpertCacheConfig`` with this home's geometry (layers, experts, projections) and ``fields``."""
        from expert_cache import ExpertCacheConfig

        return ExpertCacheConfig(
            num_layers=len(self.layer_ids), num_experts=self.num_experts, projections=self.projections, **fields
        )


def expert_problems(pack: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> list[str]:
    """What is wrong with a pack's routed experts, from the index and the safetensors headers only (no data read).

    Checks that every MoE layer ``0 .. num_hidden_layers - 1`` has ``n_routed_experts`` experts, each with gate, up
    and down EXL3 tensor sets whose trellis shapes are ``hidden x moe_intermediate_size`` (down: the transpose),
    as ``config`` (the pack's ``config.json``, nested ``text_config`` or flat; read from the pack when None) says.
    Every problem names the file (and tensor) at fault; an empty list means the experts match the config.
    """
    pack = Path(pack)
    if config is None:
        try:
            config = json.loads((pack / "config.json").read_text())
        except (OSError, ValueError) as e:
            return [f"{pack / 'config.json'}: unreadable ({e})"]
    nested = config.get("text_config")
    tc: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
    try:
        n_exp = tc["n_routed_experts"] if "n_routed_experts" in tc else tc["num_experts"]  # DeepSeek / Qwen names
        layers, experts = int(tc["num_hidden_layers"]), int(n_exp)
        hidden, inter = int(tc["hidden_size"]), int(tc["moe_intermediate_size"])
    except (KeyError, TypeError, ValueError) as err:
        return [f"{pack / 'config.json'}: no usable {err} for the routed experts"]
    try:
        by_file = _expert_names_by_file(pack)
    except ValueError as e:
        return [str(e)]
    found: dict[tuple[int, int, str], tuple[str, tuple[int, ...]]] = {}
    problems: list[str] = []
    for path, names in by_file.items():
        try:
            header = read_header(path)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        for n in names:
            info = header.get(n)
            if info is None:
                problems.append(f"{path}: {n}: named by the index but not in the file")
                continue
            layer, expert, role, part = expert_tensor(n)  # type: ignore[misc]
            if part == "trellis":
                found[(layer, expert, role)] = (f"{path.name}: {n}", info.shape)
    if problems:  # unreadable files first: what follows from them would only repeat them
        return problems
    want = {"gate": (hidden // 16, inter // 16), "up": (hidden // 16, inter // 16), "down": (inter // 16, hidden // 16)}
    extra_layers = sorted({k[0] for k in found} - set(range(layers)))
    if extra_layers:
        problems.append(f"{pack}: routed experts for layers {extra_layers}, but the config has {layers} layers")
    for layer in range(layers):
        for role, shape in want.items():
            ids = sorted(e for (ly, e, r) in found if ly == layer and r == role)
            if ids != list(range(experts)):
                missing = sorted(set(range(experts)) - set(ids))[:5]
                problems.append(
                    f"{pack}: layer {layer}: {role} projections of experts {missing or ids[experts:][:5]} "
                    f"are {'missing' if missing else 'beyond n_routed_experts'} ({len(ids)} of {experts})"
                )
                continue
            for eid in ids:
                where, got = found[(layer, eid, role)]
                if tuple(got[:2]) != shape:
                    problems.append(f"{where}: trellis {list(got)}, the config needs {16 * shape[0]} x "
                                    f"{16 * shape[1]} (in x out)")  # fmt: skip
                    break
        if len(problems) > 20:
            break
    return problems


def _expert_names_by_file(pack: Path) -> dict[Path, list[str]]:
    """Routed-expert tensor names per file, from the index (a name maps to exactly one file) or the headers."""
    index = pack / "model.safetensors.index.json"
    out: dict[Path, list[str]] = defaultdict(list)
    if index.is_file():
        try:
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
        for name, rel in weight_map.items():
            if expert_tensor(name) is not None:
                out[pack / rel].append(name)
        return dict(out)
    files = sorted(pack.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{pack}: no model.safetensors.index.json and no *.safetensors files")
    for f in files:
        for name in read_header(f):
            if expert_tensor(name) is not None:
                out[f].append(name)
    return dict(out)


def _ranges(infos: list[TensorInfo]) -> Iterator[tuple[int, int, list[TensorInfo]]]:
    """Coalesce tensors into byte ranges ``[begin, end)`` whose gaps are below ``_MERGE_GAP``."""
    infos = sorted(infos, key=lambda i: i.offset)
    begin, end, members = infos[0].offset, infos[0].offset + infos[0].nbytes, [infos[0]]
    for i in infos[1:]:
        if i.offset - end < _MERGE_GAP:
            end = max(end, i.offset + i.nbytes)
            members.append(i)
        else:
            yield begin, end, members
            begin, end, members = i.offset, i.offset + i.nbytes, [i]
    yield begin, end, members


def process_memory() -> dict[str, int]:
    """``VmRSS`` / ``RssAnon`` / ``RssFile`` / ``RssShmem`` / ``VmLck`` / ``VmPin`` of this process, bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def resident_bytes(home: ExpertHome) -> dict[str, int]:
    """``Rss`` / ``Anonymous`` / ``Shared_Clean`` / ``Private_Clean`` of the home's mappings (``/proc/self/smaps``).

    A mapping of the pack's files holds page-cache pages: its ``Anonymous`` stays 0 (no private copy of any
    expert exists), whatever the tiers read.
    """
    spans = [(m.base, m.base + m.length) for m in home._mappings]
    want = ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Locked")
    totals = dict.fromkeys(want, 0)
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = any(a < hi and lo < b for a, b in spans)
            elif current and head and head[0].rstrip(":") in totals:
                totals[head[0].rstrip(":")] += int(head[1]) * 1024
    return totals
