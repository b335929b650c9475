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
import textwrap

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
    """
)


def test_decode_kernel_matches_the_reference_in_the_interpreter() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(seed))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"seed {seed}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.stdout.count("ok ") == 18, r.stdout  # 17 (codebook, K) cases + the records case
