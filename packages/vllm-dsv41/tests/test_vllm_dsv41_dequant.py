"""The torch dequantization of EXL3 experts (``vllm_dsv41.dequant``) against ``cpu_tier.exl3`` on the CPU: the decode
bit for bit, the reconstruction to float32 rounding; fresh random tensors every run (the seed is in the failure
message). The same on CUDA: ``test_vllm_dsv41_dequant_gpu.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from cpu_tier import exl3
from vllm_dsv41 import dequant
from vllm_dsv41.dequant import host_tensor, reconstruct_torch, w_inner_torch

#: Every codebook at every width it supports (the half-bit widths 1.5 / 2.5 / 3.5 are MUL1's).
CASES = [(cb, bits) for cb in exl3.CODEBOOKS for bits in exl3.SUPPORTED_BITS[cb]]
#: ``reconstruct_torch`` vs ``reconstruct``: both sum in float64 and round once to float32, but the Hadamard products
#: are summed in another order (the torch BLAS's, not numpy's), so where the two float64 values straddle a float32
#: rounding boundary they round to neighbours: at most one float32 ulp apart, i.e. within 2**-23 of the value
#: (RTOL). ATOL only covers an element whose float64 value cancels to about zero (two float64 roundings of a sum of
#: 2 x 128 terms: ~2**-45 of the largest weight; ulp-relative bounds mean nothing there).
RTOL = 2.0**-23
ATOL_OF_MAX = 2.0**-40


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def assert_reconstructs(got: np.ndarray, ref: np.ndarray, msg: str) -> None:
    """``got`` equals ``ref`` to float32 rounding (see RTOL), and almost all of it bit for bit."""
    assert got.dtype == np.float32 and got.shape == ref.shape, msg
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL_OF_MAX * float(np.abs(ref).max()), err_msg=msg)
    # measured: >= 0.99998 identical at <= 4 bits, 0.9987 at 8 bits (CI, seed 3658489030: denser weights straddle
    # more float32 rounding boundaries); the rest one ulp apart (the allclose above is the sharp check)
    assert (got == ref).mean() > 0.99, msg


@pytest.mark.parametrize(("codebook", "bits"), CASES)
def test_decode_is_bit_exact(codebook: exl3.Codebook, bits: float) -> None:
    seed = _seed()
    rng = np.random.default_rng(seed)
    k, n = (int(v) for v in rng.choice([128, 256, 384], size=2))
    t = exl3.random_tensor(k, n, bits, codebook, rng)
    got = w_inner_torch(t, "cpu")
    assert got.dtype == torch.float16 and got.shape == (k, n)
    np.testing.assert_array_equal(got.numpy().view(np.uint16), exl3.decode(t.trellis, codebook).view(np.uint16),
                                  err_msg=f"seed {seed}")  # fmt: skip


def test_decode_in_chunks_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries inside a row of tiles and in the float64 stage (a real projection takes 2 chunks)."""
    monkeypatch.setattr(dequant, "DECODE_CHUNK_TILES", 37)
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", 128 * 256)  # one 128-row block of a 256-wide weight at a time
    seed = _seed()
    for codebook, bits in (("mul1", 3.5), ("3inst", 2), ("mcg", 4)):
        t = exl3.random_tensor(512, 256, bits, codebook, seed)  # type: ignore[arg-type]
        got = w_inner_torch(t, "cpu").numpy()
        np.testing.assert_array_equal(got.view(np.uint16), t.decode().view(np.uint16), err_msg=f"seed {seed}")
        assert_reconstructs(reconstruct_torch(t, "cpu").numpy(), t.reconstruct(), f"seed {seed} {codebook} {bits}")


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_reconstruct_equals_numpy_to_float32_rounding(codebook: exl3.Codebook) -> None:
    seed = _seed()
    rng = np.random.default_rng(seed)
    for bits in exl3.SUPPORTED_BITS[codebook][1::2]:  # half of the widths (each tested bit-exact above)
        k, n = (int(v) for v in rng.choice([128, 256, 512], size=2))
        t = exl3.random_tensor(k, n, bits, codebook, rng)
        got = reconstruct_torch(t, torch.device("cpu"))
        assert_reconstructs(got.numpy(), t.reconstruct(), f"seed {seed} bits {bits} ({k}, {n})")


def test_a_wrong_layout_would_be_caught() -> None:
    """The bit-exact check is sharp: W_inner with its tiles transposed, or decoded with a stream shifted by one
    word, differs from the reference almost everywhere (what a wrong permutation or shift would give)."""
    t = exl3.random_tensor(256, 256, 3, "mul1", _seed())
    ref = t.decode()
    tiles = ref.reshape(16, 16, 16, 16)  # [tk, r, tn, c]
    assert (tiles.transpose(0, 3, 2, 1).reshape(256, 256) != ref).mean() > 0.9
    rolled = exl3.Exl3Tensor.from_arrays(np.roll(t.trellis, 2, axis=-1), t.suh, t.svh, "mul1")
    assert (w_inner_torch(rolled, "cpu").numpy() != ref).mean() > 0.9


def test_host_tensor_wraps_read_only_views_without_a_copy() -> None:
    """The home's views are read-only mappings: wrapped by address (``torch.from_numpy`` would warn, an error under
    this suite's filterwarnings), the same memory; a non-contiguous view is copied."""
    a = np.arange(48, dtype=np.int16).reshape(2, 24)
    a.setflags(write=False)
    t = host_tensor(a)
    assert t.dtype == torch.int16 and t.shape == (2, 24) and t.data_ptr() == a.ctypes.data
    assert torch.equal(t, torch.from_numpy(a.copy()))
    b = np.arange(8, dtype=np.float16)
    assert host_tensor(b).data_ptr() == b.ctypes.data  # writable: torch.from_numpy
    c = host_tensor(a[:, ::2])
    assert torch.equal(c, torch.from_numpy(a[:, ::2].copy()))


# ------------------------------------------------------------------------------- on CUDA (device machine)


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize(("codebook", "bits"), CASES)
def test_cuda_decode_is_bit_exact_and_reconstructs(codebook: exl3.Codebook, bits: float) -> None:
    dev = _cuda()
    seed = _seed()
    t = exl3.random_tensor(256, 384, bits, codebook, seed)
    w_inner = w_inner_torch(t, dev)
    assert w_inner.device == dev
    np.testing.assert_array_equal(w_inner.cpu().numpy().view(np.uint16), t.decode().view(np.uint16),
                                  err_msg=f"seed {seed}")  # fmt: skip
    got = reconstruct_torch(t, dev)
    assert got.device == dev
    assert_reconstructs(got.cpu().numpy(), t.reconstruct(), f"seed {seed}")


@pytest.mark.gpu
def test_cuda_flash_projection() -> None:
    """A real-size Flash projection (5120 x 2304, MUL1 3 bpw: two decode chunks, three float64 chunks)."""
    from cpu_tier.geometry import V41_FLASH

    dev = _cuda()
    seed = _seed()
    t = exl3.random_tensor(V41_FLASH.hidden, V41_FLASH.intermediate, V41_FLASH.bits, V41_FLASH.codebook, seed)
    np.testing.assert_array_equal(w_inner_torch(t, dev).cpu().numpy().view(np.uint16), t.decode().view(np.uint16),
                                  err_msg=f"seed {seed}")  # fmt: skip
    assert_reconstructs(reconstruct_torch(t, dev).cpu().numpy(), t.reconstruct(), f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_oracle_per_call_equals_load(dtype: torch.dtype) -> None:
    """The oracle on CUDA: per call and at load equal to float32 rounding (TF32 off in both), close to the float64
    reference; "auto" keeps a small layer at load."""
    from cpu_tier.exl3 import random_tensor
    from vllm_dsv41.experts import AllInVramRuntime, free_device_bytes
    from vllm_dsv41.home import LayerExperts
    from vllm_dsv41.reference import ReferenceExperts

    dev = _cuda()
    seed = _seed()
    rng = np.random.default_rng(seed)
    hidden, inter, experts, topk = 512, 256, 8, 4

    def proj(k: int, n: int) -> exl3.Exl3Tensor:
        return random_tensor(k, n, 3, "mul1", rng)

    lx = LayerExperts(0, tuple(proj(hidden, inter) for _ in range(experts)),
                      tuple(proj(hidden, inter) for _ in range(experts)),
                      tuple(proj(inter, hidden) for _ in range(experts)))  # fmt: skip
    rts = [AllInVramRuntime(dev, dtype, dequantize=d) for d in ("load", "per-call", "auto")]  # type: ignore[arg-type]
    ref = ReferenceExperts()
    ref.add_layer(0, lx.gate, lx.up, lx.down, swiglu_limit=2.0)
    for rt in rts:
        rt.add_layer(lx, swiglu_limit=2.0)
    assert [rt.modes[0] for rt in rts] == ["load", "per-call", "load"] and rts[1].nbytes == 0
    assert free_device_bytes(dev) > rts[0].nbytes
    inside = AllInVramRuntime(dev, dtype, vllm_share_bytes=torch.cuda.memory_reserved(dev) + rts[0].nbytes)
    inside.add_layer(lx, swiglu_limit=2.0)  # built in vLLM's model load: only half of its share's rest is free
    assert inside.modes[0] == "per-call" and inside.nbytes == 0
    rts.append(inside)
    for tokens in (0, 1, 7, 64):
        x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).to(dev)
        ids = rng.integers(-1, experts, size=(tokens, topk))
        w = rng.uniform(0.05, 1.0, size=(tokens, topk)).astype(np.float32)
        outs = []
        for rt in rts:
            out = torch.full((tokens + 1, hidden), float("nan"), device=dev)
            rt.forward_into(0, x, torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev), out)
            assert torch.isnan(out[tokens:]).all()
            outs.append(out[:tokens].cpu())
        # the same weights and math, but not bit for bit on CUDA: cuBLAS may pick another GEMM kernel for the
        # kept weights than for the ones dequantized in the call (H200 run 8: seed 4153200690, T = 64 differed in
        # float32); so equal to the float32 rounding of the sums
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0], rtol=0, atol=1e-6 * float(outs[0].abs().max()) if tokens else 0,
                                       msg=f"seed {seed} T {tokens}")  # fmt: skip
        if tokens:
            want = ref.forward(0, x.cpu().numpy(), ids, w)
            np.testing.assert_allclose(outs[1].numpy(), want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                       err_msg=f"seed {seed}")  # fmt: skip
    for rt in rts:
        rt.close()
