"""Shared fixtures of the expert-cache tests (helpers are fixtures: tests cannot import sibling modules)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch

from expert_cache import ExpertCache, ExpertCacheConfig


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


def _read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


@pytest.fixture
def check_tables() -> Callable[[ExpertCache, list[list[torch.Tensor]]], int]:
    """``check_tables(cache, home)``: every CPU pointer reads the right expert's bytes; slot_of, pointers and the
    planned residents agree. Returns the number of resident experts. Raises AssertionError naming the entry."""

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
                    ptr = int(ptrs[layer, e, p])
                    want = home[layer][p][e].reshape(-1).view(torch.uint8).numpy().tobytes()
                    if s >= 0:
                        slot_addr = pool.data_ptr() + s * cfg.slot_stride + cfg.projection_offsets[p]
                        assert ptr == slot_addr, f"ptr[{layer},{e},{spec.name}] is not slot {s}'s address"
                    else:
                        assert ptr == cache.home_pointer(layer, e, p), f"ptr[{layer},{e},{spec.name}] is not home"
                    got = _read(ptr, spec.nbytes)
                    assert got == want, f"ptr[{layer},{e},{spec.name}] reads the wrong bytes (slot {s})"
        return n_res

    return check
