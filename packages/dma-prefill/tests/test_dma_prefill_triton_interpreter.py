"""The Triton EXL3 decode kernel on the CPU, through Triton's interpreter, bit-exact against cpu_tier.exl3.

The kernel's ASM=False branch (plain integer ops, the exact MUL1 form) runs under ``TRITON_INTERPRET=1``; the GPU
branch (funnel shift, dp4a, folded fma) is checked by test_dma_prefill_gpu.py on the device. Both take the
format's constants from cpu_tier.exl3. A subprocess, because the interpreter must be chosen before Triton
compiles the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np
    import torch
    from cpu_tier.exl3 import SUPPORTED_BITS, decode, random_tensor
    from dma_prefill.triton_ops import decode_into, decode_triton

    rng = np.random.default_rng(int(os.environ["SEED"]))
    cases = [(cb, b) for cb in ("3inst", "mcg", "mul1") for b in SUPPORTED_BITS[cb] if b in (1, 2, 3, 4, 8, 1.5, 3.5)]
    for cb, bits in cases:
        k, n = 128 * int(rng.integers(1, 3)), 128 * int(rng.integers(1, 4))
        t = random_tensor(k, n, bits, cb, seed=rng)
        got = decode_triton(torch.from_numpy(t.trellis), cb).numpy()
        want = decode(t.trellis, cb)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (cb, bits, k, n)
        print("ok", cb, bits, k, n)

    # several experts' records in one launch; an expert with no routed rows is skipped (its output untouched)
    k, n, bits, cb = 128, 256, 3, "mul1"
    ts = [random_tensor(k, n, bits, cb, seed=rng) for _ in range(3)]
    src = torch.from_numpy(np.stack([t.trellis for t in ts])).contiguous().view(-1).view(torch.int32)
    words = ts[0].trellis.size // 2
    out = torch.full((3, k, n), 7.0, dtype=torch.float16)
    decode_into(src, words, 0, torch.tensor([2, 0, 5]), out, k, n, bits, cb)
    for e in (0, 2):
        assert np.array_equal(out[e].numpy().view(np.uint16), decode(ts[e].trellis, cb).view(np.uint16)), e
    assert bool((out[1] == 7.0).all())
    print("ok records")

    # the group decode (MUL1, integer K <= 4, whole bands): every K and band width, bit for bit
    from dma_prefill.triton_ops import group_decode_fits
    for bits in (1, 2, 3, 4):
        for n, block_tn in ((256, 16), (384, 8), (128, 4)):
            assert group_decode_fits(bits, "mul1") and (n // 16) % block_tn == 0
            t = random_tensor(128, n, bits, "mul1", seed=rng)
            out = torch.full((1, 128, n), 7.0, dtype=torch.float16)
            src = torch.from_numpy(t.trellis).contiguous().view(-1).view(torch.int32)
            decode_into(src, 0, 0, torch.ones(1, dtype=torch.int64), out, 128, n, bits, "mul1", block_tn=block_tn)
            want = decode(t.trellis, "mul1")
            assert np.array_equal(out[0].numpy().view(np.uint16), want.view(np.uint16)), (bits, n, block_tn)
    assert not group_decode_fits(2.5, "mul1") and not group_decode_fits(3, "mcg") and not group_decode_fits(5, "mul1")
    print("ok groups")
    """
)


def test_decode_kernel_matches_the_reference_in_the_interpreter() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(seed))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"seed {seed}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.stdout.count("ok ") == 19, r.stdout  # 17 (codebook, K) cases + the records case + the groups


@pytest.mark.parametrize("arch", [90, 86])  # the H200, the mission's RTX 3090
def test_group_decode_compiles_for_the_gpu(arch: int) -> None:
    """The group decode's inline PTX (funnel shifts, dp4a, paired fp16 fma with 16-bit outputs) is compiled by
    Triton and assembled by ptxas for real targets without a GPU, and spills no register."""
    pytest.importorskip("triton.backends.nvidia")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dma_prefill import triton_kernels as tk

    types = dict(SRC="*i32", src_expert_stride="i32", src_offset="i32", COUNTS="*i64", OUT="*fp16",
                 out_expert_stride="i32", TN="i32", MULT="i32", ADD="i32")  # fmt: skip
    sig = {n: types.get(n, "constexpr") for n in tk.decode_kernel.arg_names}
    for k2 in (2, 4, 6, 8):
        src = ASTSource(tk.decode_kernel, sig, constexprs=dict(K2=k2, MUL1=True, BLOCK_TN=16, ASM=True, GROUPS=True))
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        assert k.asm["cubin"], "ptxas built no cubin"
        ptx = str(k.asm["ptx"])
        assert "dp4a" in ptx and "fma.rn.f16x2" in ptx and "shf.l.clamp.b32" in ptx, k2
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if nvdisasm.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(nvdisasm), f.name], capture_output=True, text=True, check=True).stdout
            assert not re.search(r"\b(STL|LDL)\b", sass), f"K2={k2}: the decode spills registers to local memory"
