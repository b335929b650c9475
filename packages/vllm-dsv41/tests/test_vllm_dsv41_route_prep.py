"""``route_prep``: the tiered runtime's routing prep (ids, weights, hit mask, the hits' ids, the cache's step counts,
the device path's counts) as torch ops against a numpy definition, the Triton kernel against the torch ops in
Triton's interpreter (bit for bit), and the kernel compiled for sm_80 / sm_86 / sm_90 without a GPU."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

from vllm_dsv41.route_prep import prepare_routing, prepare_routing_reference, share_misses, share_misses_reference


def case(rng: np.random.Generator, t: int, k: int, e: int, ids_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple:
    ids = rng.integers(0, e, (t, k))
    ids[rng.random((t, k)) < 0.1] = -1  # padding picks (vLLM: whole rows of -1; single ones here too)
    if t > 2:
        ids[t // 2] = -1
    slot = np.where(rng.random(e) < 0.4, rng.integers(0, 99, e), -1).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    return (torch.from_numpy(ids).to(ids_dtype), torch.from_numpy(w).to(w_dtype), torch.from_numpy(slot))


def run(topk_ids: torch.Tensor, topk_w: torch.Tensor, slot: torch.Tensor, fn, **kw) -> dict[str, torch.Tensor]:
    t, k = topk_ids.shape
    d = topk_ids.device  # the outputs where the inputs are (the gpu test: CUDA; H200 run 6 had them on the CPU)
    o = {"ids": torch.full((t, k), 7, dtype=torch.int32, device=d), "w": torch.full((t, k), 7.0, device=d),
         "hit": torch.ones((t, k), dtype=torch.bool, device=d),
         "gpu_ids": torch.full((t, k), 7, dtype=torch.int32, device=d),
         "counts": torch.full((slot.numel(),), 2.0, device=d),
         "dev": torch.tensor([5, 6], dtype=torch.int64, device=d)}  # fmt: skip
    fn(topk_ids, topk_w, slot, o["counts"], o["dev"], o["ids"], o["w"], o["hit"], o["gpu_ids"], **kw)
    return o


def test_reference_matches_its_definition_on_fresh_routings() -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for t, k, e in ((1, 6, 384), (4, 6, 384), (16, 8, 64), (33, 2, 5)):
        topk_ids, topk_w, slot = case(rng, t, k, e, torch.int64, torch.bfloat16)
        o = run(topk_ids, topk_w, slot, prepare_routing_reference)
        ids = topk_ids.numpy()
        valid = ids >= 0
        hit = valid & (slot.numpy()[np.maximum(ids, 0)] >= 0)
        assert np.array_equal(o["ids"].numpy(), ids) and o["ids"].dtype == torch.int32
        assert torch.equal(o["w"], topk_w.float())
        assert np.array_equal(o["hit"].numpy(), hit)
        assert np.array_equal(o["gpu_ids"].numpy(), np.where(hit, ids, -1))
        counts = np.full(e, 2.0) + np.bincount(ids[valid], minlength=e)
        assert np.array_equal(o["counts"].numpy(), counts)
        assert o["dev"].tolist() == [5 + int(hit.sum()), 6 + int(valid.sum())]


def test_optional_outputs_are_left_alone() -> None:
    rng = np.random.default_rng(3)
    topk_ids, topk_w, slot = case(rng, 4, 6, 50, torch.int32, torch.float32)
    ids, w = torch.empty((4, 6), dtype=torch.int32), torch.empty((4, 6))
    hit = torch.empty((4, 6), dtype=torch.bool)
    prepare_routing(topk_ids, topk_w, slot, None, None, ids, w, hit, None)
    want = run(topk_ids, topk_w, slot, prepare_routing_reference)
    assert torch.equal(ids, want["ids"]) and torch.equal(hit, want["hit"]) and torch.equal(w, want["w"])


def share_case(rng: np.random.Generator, t: int, k: int, e: int) -> tuple[torch.Tensor, ...]:
    """A call's prepared routing (ids with padding and experts shared by tokens, a hit mask, the hits' ids) and a
    quota table of random shares."""
    ids = rng.integers(0, e, (t, k))
    ids[rng.random((t, k)) < 0.1] = -1
    hit = (ids >= 0) & (rng.random((t, k)) < 0.3)
    hit_e = rng.random(e) < 0.2  # some experts resident: all their picks hit
    hit |= (ids >= 0) & hit_e[np.maximum(ids, 0)]
    gpu_ids = np.where(hit, ids, -1)
    quota = np.array([rng.integers(0, n + 1) for n in range(t * k + 1)], np.int32)
    if rng.random() < 0.3:
        quota = quota[: max(1, t * k // 2)]  # a short table: its last entry for more misses
    return (torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(hit), torch.from_numpy(gpu_ids.astype(np.int32)),
            torch.from_numpy(quota), torch.tensor([9], dtype=torch.int64))  # fmt: skip


def share_definition(ids: np.ndarray, hit: np.ndarray, quota: np.ndarray) -> np.ndarray:
    """Which picks go to the GPU: those of the first ``quota[n]`` distinct missed experts, most picks first, then by
    id."""
    miss = (ids >= 0) & ~hit
    experts, picks = np.unique(ids[miss], return_counts=True)  # sorted by id
    order = experts[np.argsort(-picks, kind="stable")]
    q = int(quota[min(experts.size, quota.size - 1)])
    return miss & np.isin(ids, order[:q])


def test_share_reference_matches_its_definition_on_fresh_routings() -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for t, k, e in ((1, 6, 384), (4, 6, 384), (4, 6, 12), (16, 8, 64), (16, 6, 20)):
        for _ in range(5):
            ids, hit, gpu_ids, quota, count = share_case(rng, t, k, e)
            pcie = share_definition(ids.numpy(), hit.numpy(), quota.numpy())
            h0, g0 = hit.numpy().copy(), gpu_ids.numpy().copy()
            share_misses_reference(ids, hit, gpu_ids, quota, count)
            assert np.array_equal(hit.numpy(), h0 | pcie)
            assert np.array_equal(gpu_ids.numpy(), np.where(pcie, ids.numpy(), g0))
            assert count.tolist() == [9 + int(pcie.sum())]
            # every pick of a shared expert goes the same way
            moved = set(ids.numpy()[pcie].tolist())
            assert not (moved & set(ids.numpy()[(ids.numpy() >= 0) & ~hit.numpy()].tolist()))


def test_share_of_nothing_and_of_everything() -> None:
    ids = torch.tensor([[3, 1, 3, -1], [5, 1, 2, 7]], dtype=torch.int32)
    hit = torch.tensor([[False, False, False, False], [False, False, True, False]])
    gpu_ids = torch.where(hit, ids, -1).to(torch.int32)
    count = torch.zeros(1, dtype=torch.int64)
    share_misses(ids, hit.clone(), gpu_ids.clone(), torch.zeros(9, dtype=torch.int32), count)
    assert count.item() == 0
    h, g = hit.clone(), gpu_ids.clone()
    # 4 distinct misses: 1 and 3 twice each, 5 and 7 once
    share_misses(ids, h, g, torch.tensor([0, 0, 0, 0, 2], dtype=torch.int32), count)
    assert g.tolist() == [[3, 1, 3, -1], [-1, 1, 2, -1]] and count.item() == 4  # experts 1 and 3: 4 picks
    assert h.tolist() == [[True, True, True, False], [False, True, True, False]]
    h, g, count = hit.clone(), gpu_ids.clone(), torch.zeros(1, dtype=torch.int64)
    share_misses(ids, h, g, torch.tensor([0, 0, 0, 3], dtype=torch.int32), count)  # 4 misses: the table's last, 3
    assert g.tolist() == [[3, 1, 3, -1], [5, 1, 2, -1]] and count.item() == 5  # the most picked, then the lowest id


INTERPRETED = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_vllm_dsv41_route_prep import case, run
    from vllm_dsv41.route_prep import BLOCK, prepare_routing, prepare_routing_reference

    rng = np.random.default_rng(int(os.environ["SEED"]))
    cases = [(1, 6, 384, torch.int32, torch.float32), (4, 6, 384, torch.int64, torch.bfloat16),
             (16, 6, 384, torch.int32, torch.float32), (BLOCK // 4 + 3, 8, 40, torch.int32, torch.float16)]
    for t, k, e, idt, wdt in cases:  # the last: a grid of several programs
        topk_ids, topk_w, slot = case(rng, t, k, e, idt, wdt)
        want = run(topk_ids, topk_w, slot, prepare_routing_reference)
        got = run(topk_ids, topk_w, slot, prepare_routing, use_triton=True)
        for name in want:
            assert torch.equal(got[name], want[name]), (t, k, name, got[name], want[name])
        # without the optional outputs (the kernel's constexpr branches)
        ids, w = torch.empty((t, k), dtype=torch.int32), torch.empty((t, k))
        hit = torch.empty((t, k), dtype=torch.bool)
        prepare_routing(topk_ids, topk_w, slot, None, None, ids, w, hit, None, use_triton=True)
        assert torch.equal(ids, want["ids"]) and torch.equal(hit, want["hit"]) and torch.equal(w, want["w"])
        # strided inputs (a column slice of a wider routing): made contiguous, then the kernel
        wide_ids = torch.stack([topk_ids, topk_ids], dim=-1)[..., 0]
        wide_w = torch.stack([topk_w, topk_w], dim=-1)[..., 1]
        assert not wide_ids.is_contiguous()
        got = run(wide_ids, wide_w, slot, prepare_routing, use_triton=True)
        for name in want:
            assert torch.equal(got[name], want[name]), (t, k, name, "strided")
        print("ok", t, k)
    """
)

SHARE_INTERPRETED = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_vllm_dsv41_route_prep import share_case
    from vllm_dsv41.route_prep import share_misses, share_misses_reference

    rng = np.random.default_rng(int(os.environ["SEED"]))
    for t, k, e in ((1, 6, 384), (4, 6, 20), (16, 6, 384), (16, 8, 40)):  # the last: 128 picks, the widest block
        for _ in range(4):
            ids, hit, gpu_ids, quota, count = share_case(rng, t, k, e)
            want = [hit.clone(), gpu_ids.clone(), count.clone()]
            share_misses_reference(ids, want[0], want[1], quota, want[2])
            got = [hit.clone(), gpu_ids.clone(), count.clone()]
            share_misses(ids, got[0], got[1], quota, got[2], use_triton=True)
            for a, b in zip(got, want):
                assert torch.equal(a, b), (t, k, a, b)
        print("ok", t, k)
    """
)


@pytest.mark.slow
def test_the_kernel_equals_the_torch_ops_in_the_interpreter(interpreted: Callable[[str, int, float], None]) -> None:
    interpreted(INTERPRETED, 4, 600)


@pytest.mark.slow
def test_the_share_kernel_equals_the_torch_ops_in_the_interpreter(
    interpreted: Callable[[str, int, float], None],
) -> None:
    interpreted(SHARE_INTERPRETED, 4, 600)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_the_share_kernel_compiles_for_ampere_and_hopper(arch: int) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_dsv41.route_prep import _share

    for block in (128, 256):
        sig = dict(IDS="*i32", HIT="*u8", GPU_IDS="*i32", QUOTA="*i32", COUNT="*i64", N="i32", QMAX="i32",
                   BLOCK="constexpr")  # fmt: skip
        k = triton.compile(ASTSource(_share, sig, constexprs=dict(BLOCK=block)), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=4))  # fmt: skip
        assert k.asm["cubin"], "ptxas built no cubin"


@pytest.mark.gpu
def test_on_the_gpu_the_share_kernel_equals_the_torch_ops() -> None:
    """Device machine: the stream-driven split's share kernel on CUDA tensors against the torch ops."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for t, k, e in ((1, 6, 384), (4, 6, 20), (16, 6, 384), (16, 8, 40)):
        for _ in range(8):
            args = share_case(rng, t, k, e)
            want = [a.clone() for a in args]
            share_misses_reference(*want)
            got = [a.to(dev) for a in args]
            share_misses(*got)  # CUDA: the kernel
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.cpu(), b), (t, k)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_the_kernel_compiles_for_ampere_and_hopper(arch: int) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_dsv41.route_prep import BLOCK, _route_prep

    for ids_t, w_t, flags in (("*i32", "*fp32", (True, False, True)), ("*i64", "*bf16", (True, True, False))):
        sig = dict(TOPK_IDS=ids_t, TOPK_W=w_t, SLOT_ROW="*i32", COUNTS="*fp32", DEV="*i64", IDS="*i32", W="*fp32",
                   HIT="*u8", GPU_IDS="*i32", N="i32", COUNT="constexpr", DEV_COUNTS="constexpr",
                   GPU_IDS_OUT="constexpr", BLOCK="constexpr")  # fmt: skip
        consts = dict(COUNT=flags[0], DEV_COUNTS=flags[1], GPU_IDS_OUT=flags[2], BLOCK=BLOCK)
        k = triton.compile(ASTSource(_route_prep, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=4))  # fmt: skip
        assert k.asm["cubin"], "ptxas built no cubin"


@pytest.mark.gpu
def test_on_the_gpu_the_kernel_equals_the_torch_ops_and_replays_in_a_cuda_graph() -> None:
    """Device machine (``scripts/gpu_run.sh`` STEPS=tests runs the gpu tests): the kernel on CUDA tensors against
    the torch ops, then captured in a CUDA graph and replayed on new routing written into the same inputs."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    for t, k, e, idt, wdt in ((1, 6, 384, torch.int32, torch.float32), (16, 6, 384, torch.int64, torch.bfloat16),
                              (200, 8, 64, torch.int32, torch.float16)):  # fmt: skip
        topk_ids, topk_w, slot = (a.to(dev) for a in case(rng, t, k, e, idt, wdt))
        want = {n: v.cpu() for n, v in run(topk_ids, topk_w, slot, prepare_routing_reference).items()}
        got = run(topk_ids, topk_w, slot, prepare_routing)  # CUDA: the kernel
        for name in want:
            assert torch.equal(got[name].cpu(), want[name]), (t, k, name)
    # captured: fixed buffers, new routing copied into the inputs before each replay
    t, k, e = 4, 6, 384
    topk_ids, topk_w, slot = (a.to(dev) for a in case(rng, t, k, e, torch.int32, torch.float32))
    o = {n: v.to(dev) for n, v in run(topk_ids, topk_w, slot, prepare_routing).items()}  # warm-up (compiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        prepare_routing(topk_ids, topk_w, slot, o["counts"], o["dev"], o["ids"], o["w"], o["hit"], o["gpu_ids"])
    for _ in range(3):
        new_ids, new_w, new_slot = case(rng, t, k, e, torch.int32, torch.float32)
        topk_ids.copy_(new_ids)
        topk_w.copy_(new_w)
        slot.copy_(new_slot)
        before = {n: v.clone() for n, v in o.items()}
        g.replay()
        ref = {n: v.cpu() for n, v in before.items()}
        prepare_routing_reference(new_ids, new_w, new_slot, ref["counts"], ref["dev"], ref["ids"], ref["w"],
                                  ref["hit"], ref["gpu_ids"])  # fmt: skip
        for name in ref:
            assert torch.equal(o[name].cpu(), ref[name]), name


IN_THE_RUNTIME = textwrap.dedent(
    """
    import os, sys, tempfile
    from pathlib import Path
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import test_vllm_dsv41_tiered as T
    import vllm_dsv41.tiered as tiered
    from pack_tools.presets.tiny_demo import synth_tiny_demo
    from vllm_dsv41.home import ExpertHome
    from vllm_dsv41.reference import ReferenceExperts
    from vllm_dsv41.route_prep import prepare_routing

    calls = [0]

    def kernel_prep(*args, **kwargs):
        calls[0] += 1
        prepare_routing(*args, use_triton=True, **kwargs)

    tiered.prepare_routing = kernel_prep  # what a CUDA device runs, here in the interpreter
    rng = np.random.default_rng(int(os.environ["SEED"]))
    with tempfile.TemporaryDirectory() as d, ExpertHome(synth_tiny_demo(Path(d) / "tiny-demo")) as home:
        ref = ReferenceExperts()
        for lx in home.layers():
            ref.add_layer(lx.layer, lx.gate, lx.up, lx.down, swiglu_limit=None)
        for split in ("cpu", "auto", "pcie"):  # the split path twice, the device path (split pcie)
            before = calls[0]
            rt = T._runtime(home, 5, split, split_probe=0)  # (auto: the split path only)
            try:
                T._exact_steps(rt, rng, ref, 4, tokens=3)
                s = rt.stats
                assert s.hit_picks > 0 and s.picks == 4 * T.LAYERS * 3 * T.TOP_K, s
                assert (s.device_steps > 0) == (split == "pcie"), s
            finally:
                rt.close()
            assert calls[0] > before
            print("ok", split, s.hit_picks, s.cpu_picks, s.pcie_picks)
    """
)


@pytest.mark.slow
def test_the_tiered_runtime_with_the_kernel_is_exact(interpreted: Callable[[str, int, float], None]) -> None:
    """The runtime as a GPU runs it (the kernel, not the torch ops) on a CPU device in Triton's interpreter: every
    layer's output against the float64 reference, on the split path (splits cpu, auto) and the device path."""
    interpreted(IN_THE_RUNTIME, 3, 600)
