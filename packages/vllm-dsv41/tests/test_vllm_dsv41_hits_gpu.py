"""Hits on the GPU (``vllm_dsv41.hits``), device machine only: each backend against the float64 reference on fresh
random experts of DeepSeek-V4.1-Flash's shape (H 5120, I 2304, 3 bpw MUL1), read through VRAM pools (as the
cache's slots: scrambled order) and through GPU-mapped host memory (as the registered home), T in {1, 2, 4, 8, 32},
with skipped picks whose experts' pointers are null (a read would fault); the Triton decode bit-exact on its own;
CUDA graph capture and replay. Run by ``scripts/gpu_hits.sh``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

TOKENS = (1, 2, 4, 8, 32)
TOP_K = 6
EXPERTS = 48  # enough for T = 32 to share experts between tokens and to leave some only in skipped picks
LIMIT = 10.0
TOL = {"triton": 1e-4, "exllamav3": 1e-2}  # max per-pick error over the pick's max |value| (fp16 activations: exl3)


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _layer(rng: np.random.Generator, experts: int, bits: float = 3, codebook: str = "mul1") -> Any:
    from cpu_tier.exl3 import random_tensor
    from cpu_tier.geometry import V41_FLASH
    from vllm_dsv41.home import LayerExperts

    h, i = V41_FLASH.hidden, V41_FLASH.intermediate

    def one(k: int, n: int) -> Any:
        return random_tensor(k, n, bits, codebook, rng)  # type: ignore[arg-type]

    return LayerExperts(0, tuple(one(h, i) for _ in range(experts)), tuple(one(h, i) for _ in range(experts)),
                        tuple(one(i, h) for _ in range(experts)))  # fmt: skip


def _routing(rng: np.random.Generator, t: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-6 of ``experts`` per token, ~15% skipped; the last expert appears only in skipped picks."""
    ids = np.stack([rng.choice(experts - 1, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.15] = -1
    ids[0, -1] = -1
    w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(w)


def _rel_per_pick(out: torch.Tensor, want: torch.Tensor, ids: torch.Tensor) -> float:
    """Max over the computed picks of ``max |out - want| / max |want|`` (each pick on its own scale)."""
    live = ids.to(out.device) >= 0
    d = (out.double() - want.double()).abs().amax(-1)[live]
    s = want.double().abs().amax(-1)[live]
    assert bool((s > 0).all()), "the reference gave a zero pick"
    return float((d / s).max()) if d.numel() else 0.0


class _Case:
    """One Flash-shaped layer in a VRAM pool (scrambled slot order) and in mapped host memory, with routings
    for every T and their float64 reference results."""

    def __init__(self) -> None:
        from vllm_dsv41.hits import ExpertPool, HitGeometry, ReferenceHits

        self.dev = _cuda()
        rng = np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))
        self.lx = _layer(rng, EXPERTS)
        self.geo = HitGeometry.from_layer(self.lx, LIMIT)
        n = EXPERTS
        perm = rng.permutation(n)  # slot j holds expert perm[j]
        scrambled = type(self.lx)(0, *(tuple(getattr(self.lx, r)[p] for p in perm) for r in ("gate", "up", "down")))
        self.slots = ExpertPool(scrambled, self.dev, "device")
        table = torch.empty_like(self.slots.ptrs)
        table[:, torch.from_numpy(perm).to(self.dev)] = self.slots.ptrs
        self.mapped = ExpertPool(self.lx, self.dev, "mapped")
        self.ptrs = {"slots": table, "mapped": self.mapped.ptrs.clone()}
        for p in self.ptrs.values():
            # the last expert is never routed to: null pointers. A kernel that looked a skipped pick (-1) up in
            # the table would read entry E - 1 of the column before: a null address, a fault.
            p[:, n - 1] = 0
        self.cases = []
        for t in TOKENS:
            ids, w = _routing(rng, t, n)
            x = torch.from_numpy((rng.standard_normal((t, self.geo.hidden)) * 4).astype(np.float32))
            ids_d, w_d, x_d = ids.to(self.dev), w.to(self.dev), x.to(self.dev)
            want = {}
            for dt in (torch.float32, torch.bfloat16):  # the reference of the input as the kernel gets it
                want[dt] = torch.empty((t, TOP_K, self.geo.hidden), device=self.dev)
                ReferenceHits(self.geo).forward(self.ptrs["slots"], x_d.to(dt), ids_d, w_d, want[dt])
            self.cases.append((t, x_d, ids_d, w_d, want))

    def close(self) -> None:
        self.slots.close()
        self.mapped.close()


@pytest.fixture(scope="module")
def case() -> Iterator[_Case]:
    c = _Case()
    yield c
    c.close()


def _kernel(case: _Case, backend: str, **options: Any) -> Any:
    from vllm_dsv41.dense import exllamav3_available
    from vllm_dsv41.hits import make_hits

    if backend == "exllamav3":
        assert exllamav3_available(), "exllamav3's CUDA extension must import on the device machine"
    return make_hits(case.lx, case.dev, backend, swiglu_limit=LIMIT, max_tokens=max(TOKENS), top_k=TOP_K, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("memory", ["slots", "mapped"])
@pytest.mark.parametrize(("backend", "options"), [("triton", {}), ("triton", {"prefetch": 0, "block_k": 64}),
                                                  ("triton", {"decode": "elements"}), ("exllamav3", {})])  # fmt: skip
def test_backend_against_the_reference(case: _Case, backend: str, options: dict[str, Any], memory: str) -> None:
    kern = _kernel(case, backend, **options)
    ptrs = case.ptrs[memory]
    for t, x, ids, w, wants in case.cases:
        for dt, ref in wants.items():
            out = torch.full_like(ref, float("nan"))
            kern.forward(ptrs, x.to(dt), ids, w, out)
            torch.cuda.synchronize()
            assert bool((out[ids < 0] == 0).all()), f"T={t}: skipped picks must be exact zeros"
            err = _rel_per_pick(out, ref, ids)
            assert err < TOL[backend], f"{backend} {options} {memory} T={t} {dt}: error {err:.2e}"


def test_auto_picks_exllamav3_on_the_gpu(case: _Case) -> None:
    from vllm_dsv41.hits import Exl3MgemmHits, make_hits

    assert isinstance(make_hits(case.lx, case.dev), Exl3MgemmHits)


def test_one_expert_with_more_picks_than_a_dot_has_rows(case: _Case) -> None:
    """24 picks of one expert at T = 8 (a dot has 16 rows: the kernel loops), and 40 at T = 32 (32 rows)."""
    from vllm_dsv41.hits import ReferenceHits

    rng = np.random.default_rng(7)
    for t, reps in ((8, 3), (32, 2)):
        ids = torch.from_numpy(rng.choice(EXPERTS - 1, (t, TOP_K)).astype(np.int32))
        ids[:, :reps] = 5
        if t == 32:
            ids[:8, 2] = 5
        ids[1, 3] = -1
        ids_d = ids.to(case.dev)
        x = torch.randn((t, case.geo.hidden), device=case.dev)
        w = torch.rand((t, TOP_K), device=case.dev) + 0.1
        want = torch.empty((t, TOP_K, case.geo.hidden), device=case.dev)
        ReferenceHits(case.geo).forward(case.ptrs["slots"], x, ids_d, w, want)
        for backend in ("triton", "exllamav3"):
            out = torch.full_like(want, float("nan"))
            _kernel(case, backend).forward(case.ptrs["slots"], x, ids_d, w, out)
            assert _rel_per_pick(out, want, ids) < TOL[backend], (backend, t)


@pytest.mark.parametrize("backend", ["triton", "exllamav3"])
def test_cuda_graph_replays_new_routings(case: _Case, backend: str) -> None:
    """Captured once per T; the routing, weights and inputs change in place between replays (as in decode)."""
    kern = _kernel(case, backend)
    ptrs = case.ptrs["slots"]
    for _t, x, ids, w, wants in case.cases[::2]:
        want = wants[torch.float32]
        sx, sids, sw = x.clone(), ids.clone(), w.clone()
        out = torch.empty_like(want)
        kern.forward(ptrs, sx, sids, sw, out)  # eager first (exllamav3 autotunes a new size)
        torch.cuda.synchronize()
        sids.fill_(-1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kern.forward(ptrs, sx, sids, sw, out)
        sids.copy_(ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_per_pick(out, want, ids) < TOL[backend]
        flipped = ids.flip(0).contiguous()  # another routing through the same graph
        sids.copy_(flipped)
        sw.copy_(w.flip(0))
        sx.copy_(x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_per_pick(out, want.flip(0), flipped) < TOL[backend]


def test_graph_capture_beyond_the_scratch_raises(case: _Case) -> None:
    from vllm_dsv41.hits import TritonHits

    kern = TritonHits(case.geo, case.dev, max_tokens=1, top_k=TOP_K)
    _t, x, ids, w, wants = case.cases[1]  # T = 2
    out = torch.empty_like(wants[torch.float32])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="exceed the scratch capacity"):
        with torch.cuda.graph(graph):
            out.zero_()  # the graph is not empty when the capture ends on the error
            kern.forward(case.ptrs["slots"], x, ids, w, out)


# ------------------------------------------------------------------------------------------ decode, bit-exact


_hk: Any = None  # vllm_dsv41.hits_kernels, once imported (Triton resolves a kernel's names in its module)


def _decode_kernel() -> Any:
    global _hk
    import triton
    import triton.language as tl

    from vllm_dsv41 import hits_kernels

    _hk = hits_kernels

    @triton.jit
    def decode_all(W, OUT, MULT, ADD, N: tl.constexpr, K2: tl.constexpr, MUL1: tl.constexpr, BK: tl.constexpr,
                   BN: tl.constexpr, ASM: tl.constexpr, GROUPS: tl.constexpr):  # fmt: skip
        kb = tl.program_id(0)
        nb = tl.program_id(1)
        TN: tl.constexpr = N // 16
        NWORDS: tl.constexpr = 4 * K2
        base = W + (nb * (BN // 16) + kb * (BK // 16) * TN) * NWORDS
        if GROUPS:
            g0, g1, g2, gsh = _hk._group_offsets(BK, BN, TN, K2)
            v = _hk._decode_groups(_hk._opaque(base, ASM), g0, g1, g2, gsh.to(tl.uint32), MULT, BK, BN, K2, ASM)
            v = _hk._trellis_to_block(v, BK, BN)
        else:
            off0, off1, sh = _hk._block_offsets(BK, BN, TN, K2)
            v = _hk._decode(_hk._opaque(base, ASM), off0, off1, sh.to(tl.uint32), MULT, ADD, MUL1, ASM)
        kk = kb * BK + tl.arange(0, BK)[:, None]
        nn = nb * BN + tl.arange(0, BN)[None, :]
        tl.store(OUT + kk * N + nn, v)

    return decode_all


def check_decode(dev: torch.device, asm: bool, bits: float, codebook: str, block_k: int, groups: bool = False,
                 block_n: int = 128) -> None:  # fmt: skip
    """``hits_kernels._decode`` (or with ``groups``, ``_decode_groups`` put in place by ``_trellis_to_block``) over
    every block of a fresh random tensor equals dma-prefill's torch decode (itself checked against
    ``cpu_tier.exl3``) bit for bit. ``asm``: the GPU's inline PTX."""
    from cpu_tier.exl3 import random_tensor
    from dma_prefill.ops_torch import decode_torch
    from vllm_dsv41.hits import _codebook_ints

    k, n = 1024, 768
    t = random_tensor(k, n, bits, codebook, int.from_bytes(np.random.bytes(4), "little"))  # type: ignore[arg-type]
    trellis = torch.from_numpy(t.trellis).to(dev)
    want = decode_torch(trellis, codebook)  # type: ignore[arg-type]
    got = torch.full((k, n), float("nan"), dtype=torch.float16, device=dev)
    mult, add = _codebook_ints(codebook)  # type: ignore[arg-type]
    _decode_kernel()[(k // block_k, n // block_n)](trellis.view(torch.int32), got, mult, add, N=n,
                                                   K2=int(round(2 * bits)), MUL1=codebook == "mul1", BK=block_k,
                                                   BN=block_n, ASM=asm, GROUPS=groups)  # fmt: skip
    diff = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    what = "groups" if groups else "elements"
    assert diff == 0, f"{bits:g} bpw {codebook} ({what}): {diff} of {k * n} decoded values differ in their bits"


@pytest.mark.parametrize(("bits", "codebook"), [(3, "mul1"), (2.5, "mul1"), (4, "3inst"), (2, "mcg")])
@pytest.mark.parametrize("block_k", [32, 64])
def test_decode_is_bit_exact(bits: float, codebook: str, block_k: int) -> None:
    """The kernels' inline-PTX decode (funnel shift, dp4a, paired fp16 fma) is bit-exact."""
    check_decode(_cuda(), True, bits, codebook, block_k)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize(("block_k", "block_n"), [(32, 128), (64, 256), (16, 64)])
def test_group_decode_is_bit_exact(bits: int, block_k: int, block_n: int) -> None:
    """The group decode's inline PTX (one 64-bit window per 8 elements, constant shifts) is bit-exact, and the
    permutation from the trellis order puts every value in its place."""
    check_decode(_cuda(), True, bits, "mul1", block_k, groups=True, block_n=block_n)
