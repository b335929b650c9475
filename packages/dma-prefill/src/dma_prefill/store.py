"""``HostExpertStore``: the single home copy of every routed expert, in host memory.

One exact-size anonymous mapping per layer (payload plus a zeroed tail pad, rounded up only to the 4 KiB page;
never to a power of two as a caching host allocator would), page-locked with ``cudaHostRegister`` (portable and
mapped) when CUDA is present, plus a GPU-mapped view of the same bytes. Prefill DMA, zero-copy decode reads,
the VRAM expert cache and the CPU tier all read this memory; nothing else holds a copy.
"""

from __future__ import annotations

import contextlib
import mmap
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from cpu_tier.exl3 import Exl3Tensor

from . import _cudart
from .config import PROJECTIONS, TENSORS, LayerSpec, Projection, StoreConfig
from .layout import ExpertLayout

__all__ = ["ExpertStore", "HostExpertStore"]

_PAGE = mmap.PAGESIZE


class ExpertStore(Protocol):
    """What the staging ring, the compute backends, the CPU tail and the references need from a store of routed
    experts: ``HostExpertStore`` (its own pinned records) or ``ExternalExpertStore`` (someone else's memory)."""

    @property
    def layer_ids(self) -> tuple[int, ...]: ...

    @property
    def tail_pad(self) -> int:
        """Bytes a kernel may read past a record (every staging slot is followed by at least this many)."""
        ...

    def spec(self, layer: int) -> LayerSpec: ...

    def layout(self, layer: int) -> ExpertLayout:
        """The record layout of a layer in a staging slot."""
        ...

    def copy_segments(self, layer: int, e0: int, e1: int) -> list[tuple[torch.Tensor, int]]:
        """The copies that put records ``[e0, e1)`` into a slot: ``(uint8 host source, byte offset from the start
        of record e0)``; together they write every byte of the records' tensors."""
        ...

    def tensor(self, layer: int, expert: int, proj: Projection, name: str) -> torch.Tensor: ...

    def numpy(self, layer: int, expert: int, proj: Projection, name: str) -> np.ndarray: ...

    def view(self, layer: int, expert: int, proj: Projection) -> Exl3Tensor: ...


class _Layer:
    def __init__(self, spec: LayerSpec, layout: ExpertLayout, tail_pad: int) -> None:
        self.spec = spec
        self.layout = layout
        self.payload = spec.num_experts * layout.stride
        self.size = self.payload + tail_pad
        mapped = (self.size + _PAGE - 1) // _PAGE * _PAGE
        self.mm = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # transparent huge pages: fewer faults, faster pinning
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=self.size)
        self.host = torch.from_numpy(self.array)
        self.registered = False
        self.device: torch.Tensor | None = None
        self.device_ptr = 0
        self.device_ptr_queried = False

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)


class _PrefixHandle:
    """The keys under one prefix of a set of shards, with ``keys()``/``get_tensor()`` for ``Exl3Tensor``."""

    def __init__(self, keys: dict[str, Any]) -> None:
        self._keys = keys  # full key -> safe_open handle

    def keys(self) -> Iterable[str]:
        return self._keys.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        return self._keys[name].get_tensor(name)


class HostExpertStore:
    """Routed experts of several layers in host memory, one record per expert (see ``ExpertLayout``).

    Parameters
    ----------
    specs : layer id -> ``LayerSpec`` (layer ids are the model's layer numbers).
    config : ``StoreConfig``.
    use_cuda : register the memory with CUDA; default: ``config.register`` and CUDA is available.

    Examples
    --------
    >>> store = HostExpertStore({0: LayerSpec(16, 256, 128)}, StoreConfig(progress=False), use_cuda=False)
    >>> store.write(0, 3, "gate", exl3.random_tensor(256, 128, 3, "mul1"))
    >>> store.tensor(0, 3, "gate", "trellis").shape
    torch.Size([16, 8, 48])
    """

    def __init__(
        self, specs: Mapping[int, LayerSpec], config: StoreConfig | None = None, *, use_cuda: bool | None = None
    ) -> None:
        self.config = config or StoreConfig()
        if not specs:
            raise ValueError("HostExpertStore needs at least one layer spec")
        if use_cuda is None:
            use_cuda = self.config.register and torch.cuda.is_available()
        self.use_cuda = bool(use_cuda)
        self._layers: dict[int, _Layer] = {}
        try:
            for lid, spec in specs.items():
                if not isinstance(spec, LayerSpec):
                    raise TypeError(f"layer {lid}: spec must be a LayerSpec, got {type(spec).__name__}")
                layer = _Layer(spec, ExpertLayout.build(spec, self.config.align), self.config.tail_pad)
                self._layers[int(lid)] = layer
                if self.use_cuda:
                    _cudart.host_register(layer.ptr, layer.size)
                    layer.registered = True
                    layer.device_ptr, layer.device_ptr_queried = _cudart.device_pointer(layer.ptr)
                    arr = _cudart.CudaArray(layer.device_ptr, layer.size, layer)
                    layer.device = torch.as_tensor(arr, device="cuda")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ basics

    def __enter__(self) -> HostExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unregister the memory from CUDA. Views stay readable until they are dropped."""
        for layer in self._layers.values():
            if layer.registered:
                layer.device = None
                _cudart.host_unregister(layer.ptr)
                layer.registered = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self._layers)

    def _layer(self, layer: int) -> _Layer:
        try:
            return self._layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not in the store (layers {self.layer_ids})") from None

    def spec(self, layer: int) -> LayerSpec:
        return self._layer(layer).spec

    def layout(self, layer: int) -> ExpertLayout:
        return self._layer(layer).layout

    def nbytes(self, layer: int) -> int:
        """Payload bytes of a layer (``num_experts * stride``), without the tail pad."""
        return self._layer(layer).payload

    def allocated_bytes(self, layer: int) -> int:
        """Bytes of the layer's allocation as exposed (payload + tail pad)."""
        return self._layer(layer).size

    @property
    def tail_pad(self) -> int:
        return self.config.tail_pad

    def copy_segments(self, layer: int, e0: int, e1: int) -> list[tuple[torch.Tensor, int]]:
        """Records ``[e0, e1)`` are consecutive here: one copy."""
        return [(self.records(layer)[e0:e1].reshape(-1), 0)]

    def is_registered(self, layer: int) -> bool:
        return self._layer(layer).registered

    # ------------------------------------------------------------------------------------------- views

    def buffer(self, layer: int) -> torch.Tensor:
        """The whole layer allocation, uint8 host tensor (payload then the zeroed tail pad)."""
        return self._layer(layer).host

    def records(self, layer: int) -> torch.Tensor:
        """uint8 host tensor ``[num_experts, stride]``: one row per expert record."""
        L = self._layer(layer)
        return L.host[: L.payload].view(L.spec.num_experts, L.layout.stride)

    def device_view(self, layer: int) -> torch.Tensor:
        """uint8 CUDA tensor aliasing the layer's host memory through the mapping (zero-copy reads)."""
        L = self._layer(layer)
        if L.device is None:
            raise RuntimeError(f"layer {layer}: no GPU-mapped view (store built without CUDA registration)")
        return L.device

    def _check_expert(self, layer: int, expert: int) -> _Layer:
        L = self._layer(layer)
        if not 0 <= expert < L.spec.num_experts:
            raise IndexError(f"layer {layer}: expert {expert} out of range [0, {L.spec.num_experts})")
        return L

    def tensor(self, layer: int, expert: int, proj: Projection, name: str, *, device: bool = False) -> torch.Tensor:
        """Typed view (host, or GPU-mapped with ``device=True``) of ``trellis``/``suh``/``svh``."""
        L = self._check_expert(layer, expert)
        buf = self.device_view(layer) if device else L.host
        return L.layout.view(buf, expert, proj, name)

    def numpy(self, layer: int, expert: int, proj: Projection, name: str) -> np.ndarray:
        """numpy view of a stored tensor (writes go to the store)."""
        return self.tensor(layer, expert, proj, name).numpy()

    def offset(self, layer: int, expert: int, proj: Projection, name: str) -> int:
        """Byte offset of a tensor from the start of the layer allocation."""
        L = self._check_expert(layer, expert)
        return expert * L.layout.stride + L.layout.offsets[(proj, name)]

    def address_table(self, layer: int, *, device: bool = False) -> np.ndarray:
        """int64 ``[num_experts, 3 (gate, up, down), 3 (trellis, suh, svh)]`` absolute addresses.

        Host addresses, or the GPU-mapped addresses with ``device=True`` (what a zero-copy kernel's pointer
        tables hold).
        """
        L = self._layer(layer)
        if device and not L.registered:
            raise RuntimeError(f"layer {layer}: not registered with CUDA, no device addresses")
        base = L.device_ptr if device else L.ptr
        rel = np.array([[L.layout.offsets[(p, t)] for t in TENSORS] for p in PROJECTIONS], dtype=np.int64)
        experts = np.arange(L.spec.num_experts, dtype=np.int64)[:, None, None] * L.layout.stride
        return base + experts + rel[None]

    # ------------------------------------------------------------------------------------- read/write

    def write(self, layer: int, expert: int, proj: Projection, t: Exl3Tensor) -> None:
        """Copy one EXL3 linear into its place; its geometry, K and codebook must match the layer spec."""
        L = self._check_expert(layer, expert)
        ps = L.spec.proj(proj)
        where = f"layer {layer} expert {expert} {proj}"
        if (t.k, t.n) != (ps.k, ps.n):
            raise ValueError(f"{where}: shape (k, n) = ({t.k}, {t.n}), layer spec wants ({ps.k}, {ps.n})")
        if t.bits != ps.bits:
            raise ValueError(f"{where}: K = {t.bits} bits, layer spec wants {ps.bits}")
        if t.codebook != ps.codebook:
            raise ValueError(f"{where}: codebook {t.codebook}, layer spec wants {ps.codebook}")
        if t.bias is not None:
            raise ValueError(f"{where}: has a bias; routed experts with biases are not supported")
        for name, arr in (("trellis", t.trellis), ("suh", t.suh), ("svh", t.svh)):
            np.copyto(self.numpy(layer, expert, proj, name), arr, casting="no")

    def view(self, layer: int, expert: int, proj: Projection) -> Exl3Tensor:
        """One stored linear as an ``Exl3Tensor`` whose arrays are views of the store's memory (no copy; valid
        while the store is open)."""
        return Exl3Tensor.from_arrays(
            self.numpy(layer, expert, proj, "trellis"),
            self.numpy(layer, expert, proj, "suh"),
            self.numpy(layer, expert, proj, "svh"),
            self.spec(layer).proj(proj).codebook,
            name=f"layer {layer} expert {expert} {proj}",
        )

    def read(self, layer: int, expert: int, proj: Projection) -> Exl3Tensor:
        """A copy of one stored linear as an ``Exl3Tensor``."""
        v = self.view(layer, expert, proj)
        return Exl3Tensor.from_arrays(v.trellis.copy(), v.suh.copy(), v.svh.copy(), v.codebook)

    # ------------------------------------------------------------------------------------- safetensors

    @classmethod
    def from_safetensors(
        cls,
        paths: Sequence[str | Path],
        config: StoreConfig | None = None,
        *,
        layers: Iterable[int] | None = None,
        specs: Mapping[int, LayerSpec] | None = None,
        use_cuda: bool | None = None,
    ) -> HostExpertStore:
        """Load routed experts from safetensors shards.

        Keys follow ``config.key_template`` (default ``layers.{layer}.ffn.experts.{expert}.{proj}.{tensor}``
        with proj ``w1``/``w3``/``w2``). Without ``specs`` each layer's spec is inferred from its tensors
        (expert count, H, I, K and codebook of each projection; experts must be numbered 0..E-1).
        Raises ValueError naming the key (and the shards searched) for a missing tensor, a wrong dtype or shape,
        or a codebook/K that differs from the rest of the layer.
        """
        from safetensors import safe_open
        from tqdm import tqdm

        config = config or StoreConfig()
        if not paths:
            raise ValueError("from_safetensors: no shard paths given")
        with contextlib.ExitStack() as stack:
            handles: list[tuple[str, Any]] = []
            for p in paths:
                if not Path(p).is_file():
                    raise FileNotFoundError(f"safetensors shard not found: {p}")
                try:
                    handles.append((str(p), stack.enter_context(safe_open(str(p), framework="numpy"))))
                except Exception as err:
                    raise ValueError(f"{p}: not a readable safetensors file ({err})") from None
            by_prefix: dict[str, dict[str, Any]] = {}
            for _, h in handles:
                for key in h.keys():
                    prefix, _, _ = key.rpartition(".")
                    by_prefix.setdefault(prefix, {})[key] = h
            shard_names = ", ".join(Path(p).name for p, _ in handles)
            pattern = _template_regex(config)
            found: dict[int, dict[int, dict[str, str]]] = {}
            for prefix in by_prefix:
                m = pattern.fullmatch(prefix + ".trellis")
                if m:
                    proj = PROJECTIONS[config.proj_names.index(m["proj"])]
                    found.setdefault(int(m["layer"]), {}).setdefault(int(m["expert"]), {})[proj] = prefix
            if layers is not None:
                wanted = sorted(int(x) for x in layers)
            elif specs is not None:
                wanted = sorted(specs)
            else:
                wanted = sorted(found)
            if not wanted:
                raise ValueError(f"no routed-expert trellis matching {config.key_template!r} in {shard_names}")

            def prefix_of(layer: int, expert: int, proj: Projection) -> str:
                name = config.proj_names[PROJECTIONS.index(proj)]
                key = config.key_template.format(layer=layer, expert=expert, proj=name, tensor="trellis")
                prefix = key[: -len(".trellis")]
                if prefix not in by_prefix or key not in by_prefix[prefix]:
                    raise ValueError(f"{key}: missing (searched {shard_names})")
                return prefix

            def load(layer: int, expert: int, proj: Projection) -> Exl3Tensor:
                prefix = prefix_of(layer, expert, proj)
                return Exl3Tensor.from_safetensors(_PrefixHandle(by_prefix[prefix]), prefix)

            layer_specs: dict[int, LayerSpec] = {}
            for lid in wanted:
                if specs is not None and lid in specs:
                    layer_specs[lid] = specs[lid]
                    continue
                experts = sorted(found.get(lid, {}))
                if not experts:
                    raise ValueError(
                        f"layer {lid}: no routed experts matching {config.key_template!r} in {shard_names}"
                    )
                if experts != list(range(len(experts))):
                    missing = sorted(set(range(experts[-1] + 1)) - set(experts))
                    raise ValueError(f"layer {lid}: experts are not numbered 0..E-1 (missing {missing[:8]})")
                first = {p: load(lid, 0, p) for p in PROJECTIONS}
                layer_specs[lid] = LayerSpec(
                    num_experts=len(experts),
                    hidden=first["gate"].k,
                    intermediate=first["gate"].n,
                    bits=tuple(first[p].bits for p in PROJECTIONS),  # type: ignore[arg-type]
                    codebooks=tuple(first[p].codebook for p in PROJECTIONS),  # type: ignore[arg-type]
                )
            store = cls(layer_specs, config, use_cuda=use_cuda)
            try:
                total = sum(s.num_experts * ExpertLayout.build(s, config.align).stride for s in layer_specs.values())
                with tqdm(total=total, unit="B", unit_scale=True, desc="experts", disable=not config.progress) as bar:
                    for lid, spec in layer_specs.items():
                        for e in range(spec.num_experts):
                            for p in PROJECTIONS:
                                t = load(lid, e, p)
                                try:
                                    store.write(lid, e, p, t)
                                except ValueError as err:
                                    raise ValueError(f"{prefix_of(lid, e, p)}: {err}") from None
                            bar.update(store.layout(lid).stride)
            except BaseException:
                store.close()
                raise
            return store

    def iter_experts(self, layer: int) -> Iterator[tuple[int, dict[Projection, Exl3Tensor]]]:
        """``(expert, {proj: Exl3Tensor})`` for every expert of a layer (copies; for tests and references)."""
        for e in range(self.spec(layer).num_experts):
            yield e, {p: self.read(layer, e, p) for p in PROJECTIONS}


def _template_regex(config: StoreConfig) -> re.Pattern[str]:
    names = "|".join(re.escape(n) for n in config.proj_names)
    pat = re.escape(config.key_template)
    for field, rx in (
        ("layer", r"(?P<layer>\d+)"),
        ("expert", r"(?P<expert>\d+)"),
        ("proj", f"(?P<proj>{names})"),
        ("tensor", r"(?P<tensor>trellis)"),
    ):
        pat = pat.replace(re.escape("{" + field + "}"), rx)
    return re.compile(pat)
