"""Hits through a pointer table (``vllm_dsv41.hits``) on the CPU: the geometry and its checks, the float64
reference read through host addresses (the home's mappings, numpy pools) against cpu-tier's reference and the
plugin's, skipped picks, argument checks, and our Triton kernels under Triton's interpreter."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

from cpu_tier.exl3 import Exl3Tensor, random_tensor
from cpu_tier.testing import ref_expert
from vllm_dsv41.hits import (
    ExpertPool,
    HitGeometry,
    ReferenceHits,
    TritonHits,
    in_place_backend,
    layer_pointers,
    make_hits,
    pointer_problems,
)
from vllm_dsv41.home import EXPERT_COLUMNS, ExpertHome, LayerExperts
from vllm_dsv41.reference import ReferenceExperts


def random_layer(rng: np.random.Generator, experts: int, hidden: int, inter: int,
                 bits: tuple[float, float, float] = (3, 3, 3), codebooks: tuple[str, str, str] = ("mul1",) * 3,
                 layer: int = 0) -> LayerExperts:  # fmt: skip
    def one(k: int, n: int, r: int) -> Exl3Tensor:
        return random_tensor(k, n, bits[r], codebooks[r], rng)  # type: ignore[arg-type]

    return LayerExperts(layer, tuple(one(hidden, inter, 0) for _ in range(experts)),
                        tuple(one(hidden, inter, 1) for _ in range(experts)),
                        tuple(one(inter, hidden, 2) for _ in range(experts)))  # fmt: skip


def routing(rng: np.random.Generator, tokens: int, k: int, experts: int, skip: float) -> tuple[torch.Tensor, ...]:
    """Top-``k`` of ``experts`` per token, each pick skipped (-1) with probability ``skip``; the first token's first
    pick is always kept, so a routing never skips everything (a reference of all zeros has no scale to compare to)."""
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    skipped = rng.random(ids.shape) < skip
    skipped[0, 0] = False
    ids[skipped] = -1
    w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(w)


def per_pick(lx: LayerExperts, x: np.ndarray, ids: torch.Tensor, w: torch.Tensor, limit: float | None) -> np.ndarray:
    """float64 ``w * expert(x[t])`` per pick (cpu-tier's reference), zeros for skipped picks."""
    t, k = ids.shape
    out = np.zeros((t, k, lx.hidden))
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            if e >= 0:
                y = ref_expert(x[i : i + 1].astype(np.float64), lx.gate[e], lx.up[e], lx.down[e], limit)[0]
                out[i, j] = float(w[i, j]) * y
    return out


def rel_max(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|; a reference of all zeros fails here rather than giving NaN (NaN < tol is False,
    but the message would hide why)."""
    scale = float(np.abs(b).max())
    assert scale > 0, "the reference is all zeros: the case computes nothing"
    return float(np.abs(a - b).max() / scale)


# ------------------------------------------------------------------------------------------------ geometry


def test_geometry_of_the_demo_layers(home: ExpertHome) -> None:
    for lx in home.layers():
        g = HitGeometry.from_layer(lx, swiglu_limit=10.0)
        assert (g.layer, g.num_experts, g.hidden, g.intermediate) == (lx.layer, 8, 256, 128)
        assert g.bits == (3, 3, 3) and g.codebooks == ("mul1", "mul1", "mul1") and g.swiglu_limit == 10.0
        assert g.trellis_bytes == 3 * 256 * 128 * 3 // 8
        specs = g.column_specs()
        assert [n for n, _, _ in specs] == [f"{r}.{p}" for r, p in EXPERT_COLUMNS]
        t0 = lx.down[0]
        assert specs[6][1] == t0.trellis.shape and specs[7][1] == t0.suh.shape and specs[8][1] == t0.svh.shape
        assert g.expert_bytes == sum(getattr(getattr(lx, r)[0], p).nbytes for r, p in EXPERT_COLUMNS)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("shape", r"layer 4: expert 2 up: 256x256 \(in x out\), expert 0 makes it 256x128"),
        ("bits", r"layer 4: expert 2 up: 4 bits per weight, expert 0 has 3"),
        ("codebook", r"layer 4: expert 2 up: codebook mcg, expert 0 has mul1"),
        ("bias", r"layer 4: expert 2 up: has a bias"),
    ],
)
def test_geometry_names_the_expert_that_differs(change: str, match: str) -> None:
    rng = np.random.default_rng(3)
    lx = random_layer(rng, 3, 256, 128, layer=4)
    odd = {
        "shape": random_tensor(256, 256, 3, "mul1", rng),
        "bits": random_tensor(256, 128, 4, "mul1", rng),
        "codebook": random_tensor(256, 128, 3, "mcg", rng),
        "bias": random_tensor(256, 128, 3, "mul1", rng, bias=True),
    }[change]
    up = list(lx.up)
    up[2] = odd
    with pytest.raises(ValueError, match=match):
        HitGeometry.from_layer(dataclasses.replace(lx, up=tuple(up)))


def test_geometry_field_checks() -> None:
    ok = dict(layer=0, num_experts=2, hidden=256, intermediate=128, bits=(3, 3, 3), codebooks=("mul1",) * 3)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128"):
        HitGeometry(**{**ok, "hidden": 200})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="swiglu_limit must be positive"):
        HitGeometry(**ok, swiglu_limit=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_experts must be positive"):
        HitGeometry(**{**ok, "num_experts": 0})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- reference


def test_reference_through_the_home_equals_the_plugin_reference(home: ExpertHome) -> None:
    """Pointers into the pack's mapped files: the reference equals ``ReferenceExperts`` summed over k, and
    cpu-tier's per-pick reference with skipped picks."""
    rng = np.random.default_rng(11)
    ref = ReferenceExperts()
    for lx in home.layers():
        ref.add_layer(lx.layer, lx.gate, lx.up, lx.down)
        ptrs = layer_pointers(lx)
        # the table holds the home's own addresses
        assert int(ptrs[8, 5]) == home.address(f"model.layers.{lx.layer}.mlp.experts.5.down_proj.svh")
        hits = ReferenceHits(HitGeometry.from_layer(lx))
        x = rng.standard_normal((6, 256)).astype(np.float32)
        ids, w = routing(rng, 6, 2, 8, skip=0.0)
        out = torch.empty((6, 2, 256))
        hits.forward(ptrs, torch.from_numpy(x), ids, w, out)
        want = ref.forward(lx.layer, x, ids.numpy(), w.numpy())
        assert rel_max(out.sum(1).numpy(), want) < 1e-6
        ids[0, 1] = ids[3, 0] = -1
        hits.forward(ptrs, torch.from_numpy(x), ids, w, out)
        assert rel_max(out.numpy(), per_pick(lx, x, ids, w, None)) < 1e-6
        assert bool((out[0, 1] == 0).all()) and bool((out[3, 0] == 0).all())


@pytest.mark.parametrize(
    ("bits", "codebooks", "limit", "dtype"),
    [
        ((3, 3, 3), ("mul1", "mul1", "mul1"), 10.0, torch.float32),
        ((2, 4, 2.5), ("mcg", "3inst", "mul1"), 3.0, torch.bfloat16),
        ((4, 4, 3), ("mcg", "mcg", "mcg"), None, torch.float16),
    ],
)
def test_reference_on_fresh_experts_in_a_numpy_pool(bits: tuple[float, float, float], codebooks: tuple[str, str, str],
                                                    limit: float | None, dtype: torch.dtype) -> None:  # fmt: skip
    rng = np.random.default_rng(int(bits[1] * 10) + len(codebooks[0]))
    lx = random_layer(rng, 5, 256, 384, bits, codebooks, layer=7)
    geo = HitGeometry.from_layer(lx, limit)
    with ExpertPool(lx, "cpu", "host") as pool:
        assert pointer_problems(pool.ptrs, geo, alignment=256) == []
        x = (rng.standard_normal((9, 256)) * 4).astype(np.float32)  # large enough for the clamp to bite
        xt = torch.from_numpy(x).to(dtype)
        ids, w = routing(rng, 9, 3, 5, skip=0.25)
        ids[4] = -1  # a token with no pick at all
        out = torch.full((9, 3, 256), float("nan"))
        ReferenceHits(geo).forward(pool.ptrs, xt, ids, w, out)
        want = per_pick(lx, xt.float().numpy(), ids, w, limit)
        assert rel_max(out.numpy(), want) < 1e-6
        assert bool((out[ids < 0] == 0).all()) and bool((out[ids >= 0].abs().amax(-1) > 0).all())
        if limit is not None:  # the clamp changes the result (it is exercised)
            assert rel_max(per_pick(lx, xt.float().numpy(), ids, w, None), want) > 1e-3


def test_reference_never_reads_a_skipped_expert() -> None:
    rng = np.random.default_rng(5)
    lx = random_layer(rng, 4, 128, 128)
    geo = HitGeometry.from_layer(lx)
    ptrs = layer_pointers(lx)
    ptrs[:, 3] = 0  # expert 3 appears only in skipped picks: its (null) pointers must never be read
    ptrs[4, 2] = 0x1236  # likewise a misaligned address for expert 2
    ids = torch.tensor([[0, -1], [1, 0]], dtype=torch.int32)
    x = torch.from_numpy(rng.standard_normal((2, 128)).astype(np.float32))
    w = torch.ones((2, 2))
    out = torch.empty((2, 2, 128))
    ReferenceHits(geo).forward(ptrs, x, ids, w, out)
    assert rel_max(out.numpy(), per_pick(lx, x.numpy(), ids, w, None)) < 1e-6
    with pytest.raises(ValueError, match=r"layer 0 expert 3 gate.trellis: null pointer"):
        ReferenceHits(geo).forward(ptrs, x, torch.tensor([[0, 3], [1, 0]], dtype=torch.int32), w, out)
    with pytest.raises(ValueError, match=r"layer 0 expert 2 up.suh: address 0x1236 is not 4-byte aligned"):
        ReferenceHits(geo).forward(ptrs, x, torch.tensor([[0, 2], [1, 0]], dtype=torch.int32), w, out)
    with pytest.raises(ValueError, match=r"expert id 4 out of range \[0, 4\)"):
        ReferenceHits(geo).forward(ptrs, x, torch.tensor([[0, 4], [1, 0]], dtype=torch.int32), w, out)


def _args(t: int = 2, k: int = 2, h: int = 128, e: int = 4) -> dict[str, torch.Tensor]:
    return dict(ptrs=torch.zeros((9, e), dtype=torch.int64), x=torch.zeros((t, h)),
                ids=torch.full((t, k), -1, dtype=torch.int32), weights=torch.zeros((t, k)),
                out=torch.zeros((t, k, h)))  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"ptrs": torch.zeros((8, 4), dtype=torch.int64)}, r"ptrs must be a contiguous int64 \[9, 4\] table"),
        ({"ptrs": torch.zeros((9, 4), dtype=torch.int32)}, r"ptrs must be .* got torch.int32"),
        ({"ptrs": torch.zeros((4, 9), dtype=torch.int64).t()}, r"\(not contiguous\)"),
        ({"x": torch.zeros((2, 256))}, r"x must be \[T, 128\]"),
        ({"x": torch.zeros((2, 128), dtype=torch.float64)}, r"x must be .* got torch.float64"),
        ({"ids": torch.zeros((2, 2), dtype=torch.int64)}, r"ids must be a contiguous int32 \[2, K\]"),
        ({"ids": torch.zeros((3, 2), dtype=torch.int32)}, r"ids must be"),
        ({"weights": torch.zeros((2, 3))}, r"weights must be a contiguous fp32 \[2, 2\]"),
        ({"out": torch.zeros((2, 128))}, r"out must be a contiguous fp32 \[2, 2, 128\]"),
        ({"out": torch.zeros((2, 2, 128), dtype=torch.float16)}, r"out must be"),
    ],
)
def test_forward_rejects_bad_arguments(bad: dict[str, torch.Tensor], match: str) -> None:
    geo = HitGeometry(layer=1, num_experts=4, hidden=128, intermediate=128, bits=(3, 3, 3), codebooks=("mul1",) * 3)
    args = {**_args(), **bad}
    for kern in (ReferenceHits(geo), TritonHits(geo, "cpu")):
        with pytest.raises(ValueError, match=match):
            kern.forward(**args)


def test_zero_tokens_and_all_skipped() -> None:
    geo = HitGeometry(layer=1, num_experts=4, hidden=128, intermediate=128, bits=(3, 3, 3), codebooks=("mul1",) * 3)
    ReferenceHits(geo).forward(**_args(t=0))
    TritonHits(geo, "cpu").forward(**_args(t=0))  # returns before any launch
    args = _args()
    args["out"].fill_(5.0)
    ReferenceHits(geo).forward(**args)  # every pick skipped, every pointer null: nothing read, exact zeros
    assert bool((args["out"] == 0).all())


# ----------------------------------------------------------------------------------------- factory, pools


def test_make_hits(home: ExpertHome) -> None:
    lx = home.layer(0)
    assert isinstance(make_hits(lx, "cpu"), ReferenceHits)
    assert make_hits(lx, "cpu", "reference", swiglu_limit=10.0).geometry.swiglu_limit == 10.0  # type: ignore[attr-defined]
    t = make_hits(lx, "cpu", "triton", max_tokens=4, top_k=2, block_n=64, block_k=64, split_k=2)
    assert isinstance(t, TritonHits) and t.scratch_bytes > 0 and t.splits(8, "gate_up") == (2, 2)
    assert t.prefetch == 0  # the interpreter has no inline PTX
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        make_hits(lx, "cpu", "triton", prefetch=-1)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        make_hits(lx, "cpu", "cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply to the 'triton' backend only"):
        make_hits(lx, "cpu", "reference", block_n=64)
    with pytest.raises(ValueError, match="need a CUDA device"):
        make_hits(lx, "cpu", "exllamav3")
    with pytest.raises(ValueError, match="block_k must be 16, 32, 64 or 128"):
        make_hits(lx, "cpu", "triton", block_k=48)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16 dividing 256 and 128"):
        make_hits(lx, "cpu", "triton", block_n=256)


@pytest.mark.parametrize(
    ("backend", "alignment", "expected"),
    [
        ("exllamav3", 4, "triton"),  # a Flash pack's home (run 7): ours reads it in place
        ("exllamav3", 8, "triton"),  # a checkpoint's safetensors
        ("exllamav3", 16, None),  # exllamav3 reads it in place too
        ("exllamav3", 4096, None),
        ("exllamav3", 2, None),  # neither reads it in place: staged either way
        ("triton", 4, None),
        ("reference", 8, None),
    ],
)
def test_in_place_backend(backend: str, alignment: int, expected: str | None) -> None:
    assert in_place_backend(backend, alignment) == expected


def test_triton_default_warps_follow_the_decode() -> None:
    """4 warps where every projection takes the group decode (fastest on the H200, run 8), 8 where one takes the
    per-element decode (it spills registers at 4: ``test_triton_kernels_compile_for_the_gpu``)."""
    flash = HitGeometry(layer=0, num_experts=384, hidden=5120, intermediate=2304, bits=(3, 3, 3),
                        codebooks=("mul1",) * 3)  # fmt: skip
    assert TritonHits(flash, "cpu").num_warps == 4
    assert TritonHits(flash, "cpu", decode="elements").num_warps == 8
    assert TritonHits(dataclasses.replace(flash, bits=(3, 3, 2.5)), "cpu").num_warps == 8
    assert TritonHits(flash, "cpu", num_warps=2).num_warps == 2
    with pytest.raises(ValueError, match="num_warps must be a power of two, got 3"):
        TritonHits(flash, "cpu", num_warps=3)


def test_triton_splits_fill_the_machine() -> None:
    geo = HitGeometry(layer=0, num_experts=384, hidden=5120, intermediate=2304, bits=(3, 3, 3), codebooks=("mul1",) * 3)
    th = TritonHits(geo, "cpu", programs_per_sm=4 * 132)  # the target of an H200 (132 multiprocessors)
    for s in (6, 12, 24, 48, 192):
        for proj, kdim, nblocks in (("gate_up", 5120, 2 * 2304 // 128), ("down", 2304, 5120 // 128)):
            ks, per = th.splits(s, proj)  # type: ignore[arg-type]
            assert ks * per >= kdim // th.block_k > (ks - 1) * per  # every k block in exactly one split
            assert ks == 1 or s * nblocks * (ks - 1) < 4 * 132  # no more splits than the target asks for
    assert th.splits(6, "gate_up")[0] > 1 and th.splits(192, "gate_up")[0] == 1


def test_expert_pool_checks(home: ExpertHome) -> None:
    lx = home.layer(1)
    with ExpertPool(lx, "cpu", "host", alignment=512) as pool:
        geo = HitGeometry.from_layer(lx)
        assert pointer_problems(pool.ptrs, geo, alignment=512) == [] and pool.nbytes >= 8 * geo.expert_bytes
        trellis = lx.down[3].trellis
        raw = (ctypes.c_int16 * trellis.size).from_address(int(pool.ptrs[6, 3]))
        assert np.array_equal(np.frombuffer(raw, dtype=np.int16).reshape(trellis.shape), trellis)
    with ExpertPool(lx, "cpu", "host", alignment=16, offset=4) as pool:  # a Flash pack's 4-byte boundaries
        geo = HitGeometry.from_layer(lx)
        assert (pool.ptrs.numpy() % 16 == 4).all() and pointer_problems(pool.ptrs, geo, alignment=4) == []
        trellis = lx.gate[5].trellis
        raw = (ctypes.c_int16 * trellis.size).from_address(int(pool.ptrs[0, 5]))
        assert np.array_equal(np.frombuffer(raw, dtype=np.int16).reshape(trellis.shape), trellis)
    with pytest.raises(ValueError, match=r"offset must be in \[0, alignment = 16\), got 16"):
        ExpertPool(lx, "cpu", "host", alignment=16, offset=16)
    with pytest.raises(ValueError, match="memory 'device' does not go with device cpu"):
        ExpertPool(lx, "cpu", "device")
    with pytest.raises(ValueError, match="memory must be 'device', 'mapped' or 'host'"):
        ExpertPool(lx, "cpu", "vram")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- Triton's interpreter

INTERPRETER = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_vllm_dsv41_hits import per_pick, random_layer, rel_max, routing
    from vllm_dsv41.hits import ExpertPool, HitGeometry, ReferenceHits, TritonHits

    rng = np.random.default_rng(int(os.environ["SEED"]))
    from test_vllm_dsv41_hits_gpu import check_decode

    # the group decode and its permutation, bit for bit (plain integer ops; the GPU test runs the inline PTX)
    for bits, bk, bn in ((3, 32, 128), (1, 16, 64), (4, 64, 256), (2, 32, 128)):
        check_decode(torch.device("cpu"), False, bits, "mul1", bk, groups=True, block_n=bn)
    print("ok group decode")

    cases = [  # experts, hidden, inter, bits, codebooks, limit, tokens, top-k, split_k, x dtype, options
        (6, 256, 128, (3, 3, 3), ("mul1",) * 3, 10.0, 5, 2, None, torch.float32, {}),
        (6, 256, 128, (3, 3, 3), ("mul1",) * 3, 10.0, 5, 2, None, torch.float32, {"decode": "elements"}),
        (4, 128, 256, (2, 4, 1), ("mul1",) * 3, 3.0, 3, 2, 2, torch.float32, {"block_k": 64, "block_n": 32}),
        (5, 128, 256, (2, 4, 2.5), ("mcg", "3inst", "mul1"), 3.0, 7, 3, 2, torch.bfloat16, {}),
        (3, 256, 128, (1, 1, 8), ("3inst", "3inst", "mcg"), None, 20, 2, 3, torch.float16, {}),
    ]
    for n, h, i, bits, cbs, limit, t, k, sk, dt, opts in cases:
        lx = random_layer(rng, n, h, i, bits, cbs)
        geo = HitGeometry.from_layer(lx, limit)
        with ExpertPool(lx, "cpu", "host") as pool:
            x = torch.from_numpy((rng.standard_normal((t, h)) * 4).astype(np.float32)).to(dt)
            ids, w = routing(rng, t, k, n, skip=0.2)
            ids[1] = -1
            want = torch.empty((t, k, h))
            ReferenceHits(geo).forward(pool.ptrs, x, ids, w, want)
            out = torch.full((t, k, h), float("nan"))
            kern = TritonHits(geo, "cpu", split_k=sk, **opts)
            kern.forward(pool.ptrs, x, ids, w, out)
            err = rel_max(out.numpy(), want.numpy())
            assert err < 2e-6, (bits, cbs, opts, err)
            assert bool((out[ids < 0] == 0).all()), "skipped picks must be exact zeros"
            print("ok", bits, cbs, kern.groups, t, k, f"{err:.1e}")

    # one expert with more picks than a dot's rows (duplicates inside a token), skipped experts' pointers null
    lx = random_layer(rng, 4, 128, 128)
    geo = HitGeometry.from_layer(lx, 10.0)
    with ExpertPool(lx, "cpu", "host") as pool:
        ids = torch.zeros((12, 3), dtype=torch.int32)
        ids[2, 1], ids[5] = 2, -1
        ids[7, 2] = 3
        ids[8] = torch.tensor([1, -1, 0], dtype=torch.int32)
        ptrs = pool.ptrs.clone()
        x = torch.from_numpy(rng.standard_normal((12, 128)).astype(np.float32))
        w = torch.from_numpy(rng.uniform(0.1, 1, (12, 3)).astype(np.float32))
        want = torch.empty((12, 3, 128))
        ReferenceHits(geo).forward(ptrs, x, ids, w, want)
        ids[7, 2] = -1
        ptrs[:, 3] = 0  # expert 3 now only in a skipped pick: a read would fault
        want[7, 2] = 0
        out = torch.full((12, 3, 128), float("nan"))
        TritonHits(geo, "cpu").forward(ptrs, x, ids, w, out)
        assert rel_max(out.numpy(), want.numpy()) < 2e-6
        print("ok duplicates")
    """
)


@pytest.mark.slow
def test_triton_kernels_in_the_interpreter(interpreted: Callable[[str, int, float], None]) -> None:
    interpreted(INTERPRETER, 7, 800)


# ------------------------------------------------------------------------------- compiled for the GPU, offline

_TYPES = dict(IDS="*i32", ROWS="*i32", COUNT="*i32", S="i32", TOPK="i32", PTRS="*i64", E="i32", COL0="i32",
              X="*fp32", stride_x="i32", A_HI="*fp16", A_LO="*fp16", A_INV="*fp32", A32="*fp32", P="*fp32", KS="i32",
              KPER="i32",
              MULT="i32", ADD="i32", limit="fp32", W="*fp32", OUT="*fp32")  # fmt: skip


def _compile(fn: object, arch: int, num_warps: int, spills: bool = False, **constexprs: object) -> str:
    """PTX of ``fn`` compiled for ``sm_<arch>`` (through ptxas: a cubin is built), no GPU needed; unless
    ``spills``, its machine code (where a disassembler is found) must not spill registers to local memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: _TYPES.get(n, "constexpr") for n in fn.arg_names}  # type: ignore[attr-defined]
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps))  # fmt: skip
    assert k.asm["cubin"], "ptxas built no cubin"
    from vllm_dsv41.ampere.aot import disassemble

    sass = disassemble(k.asm["cubin"])
    if sass is not None and not spills:  # spills would be local-memory stores and loads in the machine code
        assert not re.search(r"\b(STL|LDL)\b", sass), f"{fn.__name__} spills registers to local memory"  # type: ignore[attr-defined]
    return str(k.asm["ptx"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 86])  # the H200, the mission's RTX 3090
def test_triton_kernels_compile_for_the_gpu(arch: int) -> None:
    """The GPU-only code (inline PTX: funnel shift, dp4a, paired fp16 fma, L2 prefetch; libdevice) is compiled
    by Triton and assembled by ptxas for real targets, without a GPU; its numbers are the gpu tests'."""
    pytest.importorskip("triton.backends.nvidia")
    from vllm_dsv41 import hits_kernels as hk

    geo = dict(KDIM=4096, N=2048, BM=16, BN=128, ASM=True)
    # the per-element decode at block_k 64 and K = 2.5 spills on sm_86 (the default block_k is 32); the group
    # decode does not at any of these sizes
    cases = ((6, True, 32, 8, False, 0), (5, True, 64, 0, False, 0), (8, False, 32, 4, False, 0),
             (6, True, 32, 8, True, 1), (6, True, 32, 8, True, 2), (8, True, 64, 0, True, 1),
             (2, True, 16, 0, True, 0))  # fmt: skip
    for k2, mul1, bk, pf, groups, picks in cases:
        # TritonHits' default warps: 4 for the group decode, 8 for the per-element one (which spills at 4)
        ptx = _compile(hk.gemv_kernel, arch, 4 if groups else 8, spills=(k2, bk) == (5, 64), **geo, NPROJ=2, K2=k2,
                       MUL1=mul1, BK=bk, PREFETCH=pf, PF_LINES=16, GROUPS=groups, PICKS=picks)  # fmt: skip
        assert ("shf.l.clamp.b32" in ptx) and (("dp4a" in ptx) == mul1) and (("fma.rn.f16x2" in ptx) == mul1)
        assert ("prefetch.global.L2" in ptx) == (pf > 0)
    assert "ex2" in _compile(hk.mid_kernel, arch, 1, I=2048, HAS_LIMIT=True, LIBDEVICE=True)
    _compile(hk.prep_kernel, arch, 1, H=4096, S_BLOCK=64)
    _compile(hk.out_kernel, arch, 1, H=4096)
