"""The pure-torch expert math against the numpy reference (``cpu_tier.exl3``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_tier import exl3
from dma_prefill.ops_torch import (
    codebook_table,
    codebook_torch,
    decode_torch,
    hadamard_128_torch,
    linear_torch,
    swiglu,
)

CASES = [(cb, k) for cb in exl3.CODEBOOKS for k in exl3.SUPPORTED_BITS[cb]]


@pytest.mark.parametrize(("codebook", "bits"), CASES)
def test_decode_torch_bit_exact(codebook: str, bits: float) -> None:
    t = exl3.random_tensor(128, 256, bits, codebook, seed=int(bits * 10) + len(codebook))
    ref = exl3.decode(t.trellis, codebook)
    for table in (None, codebook_table(codebook)):  # the values computed, then looked up
        got = decode_torch(torch.from_numpy(t.trellis), codebook, chunk_tiles=50, table=table).numpy()  # 3 chunks
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_codebook_table_is_every_states_value() -> None:
    for cb in exl3.CODEBOOKS:
        table = codebook_table(cb)
        assert table.dtype == torch.float16 and table.shape == (65536,)
        np.testing.assert_array_equal(table.numpy().view(np.uint16),
                                      codebook_torch(torch.arange(65536), cb).numpy().view(np.uint16))  # fmt: skip
    with pytest.raises(ValueError, match="unknown codebook"):
        codebook_table("e8p")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"table must be float16 \[65536\]"):
        decode_torch(torch.zeros(8, 8, 48, dtype=torch.int16), "mul1", table=codebook_table("mul1").float())


def test_codebooks_every_state() -> None:
    states = np.arange(65536, dtype=np.int64)
    for cb in exl3.CODEBOOKS:
        ref = exl3.codebook_values(states, cb)
        got = codebook_torch(torch.from_numpy(states), cb).numpy()
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_hadamard_is_orthonormal_blockwise() -> None:
    x = torch.randn(5, 384, dtype=torch.float64)
    y = hadamard_128_torch(x)
    np.testing.assert_allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-12)
    np.testing.assert_allclose(hadamard_128_torch(y), x, atol=1e-12)
    np.testing.assert_allclose(y.numpy(), exl3.hadamard_128(x.numpy()), atol=1e-12)
    with pytest.raises(ValueError, match="multiple of 128"):
        hadamard_128_torch(torch.randn(2, 100))


def test_linear_torch_matches_reference() -> None:
    t = exl3.random_tensor(256, 384, 3, "mcg", seed=5)
    x = np.random.default_rng(0).standard_normal((7, 256)).astype(np.float32)
    ref = exl3.linear(x, t.trellis, t.suh, t.svh, "mcg")
    w = torch.from_numpy(exl3.decode(t.trellis, "mcg"))
    got = linear_torch(torch.from_numpy(x), w, torch.from_numpy(t.suh), torch.from_numpy(t.svh), dtype=torch.float64)
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_swiglu_clamps_like_deepseek() -> None:
    g = torch.tensor([-20.0, 0.5, 30.0])
    u = torch.tensor([50.0, -3.0, -40.0])
    got = swiglu(g, u, 10.0)
    want = torch.nn.functional.silu(torch.tensor([-20.0, 0.5, 10.0])) * torch.tensor([10.0, -3.0, -10.0])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(swiglu(g, u, None), torch.nn.functional.silu(g) * u)


def test_matmul_sequential_is_k_ordered() -> None:
    from dma_prefill.ops_torch import matmul_sequential

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 300, generator=g), torch.randn(300, 9, generator=g)
    np.testing.assert_allclose(
        matmul_sequential(a.double(), b.double()).numpy(), (a.double() @ b.double()).numpy(), rtol=1e-12, atol=1e-12
    )
    # float32: exactly the k-ordered loop of roundings, which differs from the blocked BLAS sum
    seq = matmul_sequential(a, b)
    ref = torch.zeros(7, 9)
    for k in range(300):
        ref = ref + a[:, k, None] * b[k]
    assert torch.equal(seq, ref)
    assert not torch.equal(seq, a @ b)
