"""Shared fixtures of the expert-cache tests (helpers are fixtures: tests cannot import sibling modules)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch

from expert_cache import ExpertCache, ExpertCacheConfig, ExpertRows


@pytest.fixture
def make_home() -> Callable[..., list[list[torch.Tensor]]]:
    """``make_home(cfg, seed=0, pin=False)``: random host tensors, every expert's bytes distinct."""

    def make(cfg: ExpertCacheConfig, seed: int = 0, pin: bool = False) -> list[list[torch.Tensor]]:
        rng = np.random.default_rng(seed)
        out = []
        for _layer in range(cfg.num_layers):
            row = []
            for spec in cfg.projection_specs:
                raw = rng.integers(0, 256, size=cfg.num_experts * spec.nbytes, dtype=np.uint8)
                t = torch.from_numpy(raw).view(getattr(torch, spec.dtype))
                t = t.reshape(cfg.num_experts, *spec.shape).clone()
                row.append(t.pin_memory() if pin else t)
            out.append(row)
        return out

    return make


@pytest.fixture
def make_rows() -> Callable[..., ExpertRows]:
    """``make_rows(cfg, home, seed=0, buffers=3, pin=False)``: the stacked ``home``'s bytes copied to scattered places
    in a few host buffers (random buffer, order and gaps; rows aligned to their item size, buffers to the largest item
    size and no more, so no wider alignment comes for free), as an :class:`ExpertRows`."""

    def make(
        cfg: ExpertCacheConfig, home: list[list[torch.Tensor]], seed: int = 0, buffers: int = 3, pin: bool = False
    ) -> ExpertRows:
        rng = np.random.default_rng(seed)
        specs = cfg.projection_specs
        L, E, P = cfg.num_layers, cfg.num_experts, len(specs)
        buf = rng.integers(0, buffers, size=(L, P, E)).astype(np.int32)
        off = np.zeros((L, P, E), np.int64)
        ends = [0] * buffers
        for flat in rng.permutation(L * P * E).tolist():
            layer, rest = divmod(flat, P * E)
            p, e = divmod(rest, E)
            b, item = int(buf[layer, p, e]), specs[p].itemsize
            pos = ends[b] + int(rng.integers(0, 3)) * item  # a gap of 0-2 items
            pos += -pos % item
            off[layer, p, e] = pos
            ends[b] = pos + specs[p].nbytes
        m = max(s.itemsize for s in specs)  # each buffer starts at m mod 2m: aligned to every item size, no more
        raw = [torch.full((2 * m + n,), 0xCD, dtype=torch.uint8) for n in ends]
        if pin:
            raw = [t.pin_memory() for t in raw]
        views = []
        for t, n in zip(raw, ends, strict=True):
            skip = (m - t.data_ptr()) % (2 * m)
            views.append(t[skip : skip + n])
        for layer in range(L):
            for p, spec in enumerate(specs):
                src = home[layer][p].reshape(E, -1).view(torch.uint8)
                for e in range(E):
                    o = int(off[layer, p, e])
                    views[int(buf[layer, p, e])][o : o + spec.nbytes].copy_(src[e])
        return ExpertRows(tuple(views), buf, off, (), raw)

    return make


def _read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


@pytest.fixture
def check_tables() -> Callable[[ExpertCache, list[list[torch.Tensor]]], int]:
    """``check_tables(cache, home)``: every CPU pointer reads the right expert's bytes (``home``: the stacked bytes,
    whatever form the cache was given); slot_of, pointers and the planned residents agree; slot pointers are
    ``slot_alignment``-aligned. Returns the number of resident experts. Raises AssertionError naming the entry."""

    def check(cache: ExpertCache, home: list[list[torch.Tensor]]) -> int:
        cfg = cache.config
        specs = cfg.projection_specs
        ptrs = cache.pointer_table.cpu().numpy()
        slot_of = cache.slot_of.cpu().numpy()
        planned = cache.resident()
        pool = cache.pool
        n_res = 0
        for layer in range(cfg.num_layers):
            for e in range(cfg.num_experts):
                key = layer * cfg.num_experts + e
                s = int(slot_of[layer, e])
                assert planned.get(key, -1) == s, f"slot_of[{layer},{e}] = {s}, planner says {planned.get(key, -1)}"
                if s >= 0:
                    n_res += 1
                    assert pool is not None, "a resident expert while the pool is released"
                for p, spec in enumerate(specs):
                    ptr = int(ptrs[layer, p, e])
                    want = home[layer][p][e].reshape(-1).view(torch.uint8).numpy().tobytes()
                    if s >= 0:
                        slot_addr = pool.data_ptr() + s * cfg.slot_stride + cfg.projection_offsets[p]
                        assert ptr == slot_addr, f"ptr[{layer},{e},{spec.name}] is not slot {s}'s address"
                        assert ptr % cfg.slot_alignment == 0, f"ptr[{layer},{e},{spec.name}] is misaligned"
                    else:
                        assert ptr == cache.home_pointer(layer, e, p), f"ptr[{layer},{e},{spec.name}] is not home"
                    got = _read(ptr, spec.nbytes)
                    assert got == want, f"ptr[{layer},{e},{spec.name}] reads the wrong bytes (slot {s})"
        return n_res

    return check
