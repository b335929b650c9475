"""The EXL3 weight format in pure numpy: the reference every kernel of the project is checked against.

An EXL3 linear stores ``y = x @ W`` (``W`` is ``(k, n)`` = (in, out), the transpose of ``nn.Linear.weight``) as

* ``trellis`` int16 ``[k/16, n/16, 16*K]``: one 16x16 tile per ``[tk, tn]``, a tail-biting bitstream of
  ``256*K`` bits read as little-endian uint32 words, MSB first inside each word;
* ``suh`` fp16 ``[k]`` and ``svh`` fp16 ``[n]``: the input and output scale/sign vectors;
* an optional 0-dim int32 codebook marker, ``mcg`` or ``mul1`` (none means 3INST);
* an optional ``bias`` fp16 ``[n]``.

Decoding: each of a tile's 256 elements owns the 16-bit window of the stream that ends after its own code
(``state[t] = ((state[t-1] << K) | code[t]) & 0xFFFF``, wrapping around the tile: tail-biting); the codebook
maps the state to an fp16 value; the tile permutation places element ``t`` at ``perm[t]`` of the row-major
16x16 tile. That gives ``W_inner``; the original-basis weight is
``W = diag(suh) . H_k . W_inner . H_n . diag(svh)`` with ``H`` the blockwise, orthonormal Hadamard-128.

All arithmetic on integers is uint32 modulo 2**32, exactly as on the GPU; ``decode`` is bit-exact against
exllamav3's CUDA ``reconstruct``. ``reconstruct`` and ``linear`` compute in float64 and round to float32 once.
Source: ../shared/reference/exl3-format.md sections 1 and 2 (this file is our own implementation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import numpy as np

__all__ = [
    "CODEBOOKS",
    "CODEBOOK_MULT",
    "LOP3_AND",
    "LOP3_XOR",
    "MARKERS",
    "MUL1_BIAS",
    "MUL1_SCALE",
    "SUPPORTED_BITS",
    "Codebook",
    "Exl3Tensor",
    "bits_from_trellis",
    "codebook_values",
    "decode",
    "decode_states",
    "hadamard_128",
    "hadamard_matrix",
    "linear",
    "random_tensor",
    "reconstruct",
    "stream_windows",
    "tensor_core_perm",
    "trellis_shape",
    "trellis_states",
    "window_ends",
]

Codebook = Literal["3inst", "mcg", "mul1"]
CODEBOOKS: tuple[Codebook, ...] = ("3inst", "mcg", "mul1")

#: ``(multiplier, addend)`` of each codebook's hash: ``x = (state * multiplier + addend) mod 2**32``.
CODEBOOK_MULT: dict[Codebook, tuple[int, int]] = {
    "3inst": (89226354, 64248484),
    "mcg": (0xCBAC1FED, 0),
    "mul1": (0x83DCD12D, 0),
}
#: 3INST and MCG map the hash through LOP3: ``(x & LOP3_AND) ^ LOP3_XOR``, then add its two fp16 halves.
LOP3_AND = 0x8FFF8FFF
LOP3_XOR = 0x3B603B60

#: Marker tensor values (0-dim int32): the codebook's multiplier as int32. Only their presence selects the
#: codebook; the values are checked too.
MARKERS: dict[str, int] = {
    "mcg": np.array(CODEBOOK_MULT["mcg"][0], dtype=np.uint32).view(np.int32).item(),  # -877912083
    "mul1": np.array(CODEBOOK_MULT["mul1"][0], dtype=np.uint32).view(np.int32).item(),  # -2082680531
}

INTEGER_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS: tuple[float, ...] = (1.5, 2.5, 3.5)  # MUL1 only (exllamav3 1.6.x)
SUPPORTED_BITS: dict[Codebook, tuple[float, ...]] = {
    "3inst": INTEGER_BITS,
    "mcg": INTEGER_BITS,
    "mul1": INTEGER_BITS + HALF_BITS,
}

_M32 = np.uint64(0xFFFFFFFF)
_HAD_SCALE = 1.0 / math.sqrt(128.0)


# --------------------------------------------------------------------------------------------- codebooks


def _halves_sum(x: np.ndarray) -> np.ndarray:
    """SUMH: fp16(low half) + fp16(high half) of each uint32, rounded once to fp16 (``__hadd``)."""
    lo = (x & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
    # Both halves have magnitudes in [0.125, 2): the fp32 sum is exact, so one rounding matches __hadd.
    return (lo + hi).astype(np.float16)


def _lop3(x: np.ndarray) -> np.ndarray:
    return (x & np.uint32(LOP3_AND)) ^ np.uint32(LOP3_XOR)


def _mul32(s: np.ndarray, mult: int, add: int = 0) -> np.ndarray:
    """``(s * mult + add) mod 2**32`` for uint16/uint32 states, without numpy overflow warnings."""
    s64 = s.astype(np.uint64)
    return ((s64 * np.uint64(mult) + np.uint64(add)) & _M32).astype(np.uint32)


#: MUL1's GPU decode is one fp16 FMA: ``(1024 + bytesum) * MUL1_SCALE + MUL1_BIAS``, rounded once;
#: the two constants are the fp16 values half(0x1EEE) and half(0xC931).
MUL1_SCALE = float(np.array(0x1EEE, dtype=np.uint16).view(np.float16))  # 0.00676727294921875
MUL1_BIAS = float(np.array(0xC931, dtype=np.uint16).view(np.float16))  # -10.3828125


def codebook_values(states: np.ndarray, codebook: Codebook) -> np.ndarray:
    """Map 16-bit trellis states to their fp16 codebook values, bit-exactly as exllamav3's GPU kernels.

    Parameters
    ----------
    states : integer array, values in [0, 65535], any shape.
    codebook : "3inst", "mcg" or "mul1".

    Returns
    -------
    float16 array of the same shape.
    """
    s = np.asarray(states)
    if s.dtype.kind not in "iu":
        raise ValueError(f"states must be an integer array, got dtype {s.dtype}")
    s = s.astype(np.uint32) & np.uint32(0xFFFF)
    if codebook in ("3inst", "mcg"):
        return _halves_sum(_lop3(_mul32(s, *CODEBOOK_MULT[codebook])))
    if codebook == "mul1":
        p = _mul32(s, *CODEBOOK_MULT["mul1"])
        bytesum = (
            (p & np.uint32(0xFF))
            + ((p >> np.uint32(8)) & np.uint32(0xFF))
            + ((p >> np.uint32(16)) & np.uint32(0xFF))
            + (p >> np.uint32(24))
        )
        # The product of two 11-bit significands plus the bias is exact in float64; numpy's
        # float64 -> float16 conversion rounds once, to nearest even, like the hfma.
        exact = (1024.0 + bytesum.astype(np.float64)) * MUL1_SCALE + MUL1_BIAS
        return exact.astype(np.float16)
    raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")


# ---------------------------------------------------------------------------------- bitstream and states


def _check_bits(bits: float, codebook: Codebook | None = None) -> None:
    if codebook is not None and codebook not in SUPPORTED_BITS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    allowed = SUPPORTED_BITS[codebook] if codebook else INTEGER_BITS + HALF_BITS
    if bits not in allowed:
        what = f" for codebook {codebook!r}" if codebook else ""
        raise ValueError(f"unsupported bits per weight K={bits}{what}; supported: {allowed}")


def window_ends(bits: float) -> np.ndarray:
    """``S(t)``: the stream position just past element t's code, for t = 0..255 (int64 [256])."""
    t = np.arange(256, dtype=np.int64)
    if float(bits).is_integer():
        return (t + 1) * int(bits)
    ka = int(bits - 0.5)
    # Odd elements of each group of 16 take KA + 1 bits, even ones KA (exllamav3 quant/frac.cu).
    d = ka + ((0xAAAA >> (t & 15)) & 1)
    per_group = np.cumsum(d[:16])
    return (t >> 4) * (16 * ka + 8) + per_group[t & 15]


def code_lengths(bits: float) -> np.ndarray:
    """Bits consumed by each of a tile's 256 elements (int64 [256])."""
    _check_bits(bits)
    ends = window_ends(bits)
    return np.diff(np.concatenate([[0], ends]))


def _stream_words(trellis: np.ndarray) -> np.ndarray:
    """The tile bitstreams as uint32 words, ``u32[w] = u16[2w] | u16[2w+1] << 16`` (uint64 [..., 8K])."""
    u16 = trellis.astype(np.int16, copy=False).view(np.uint16).astype(np.uint64)
    return u16[..., 0::2] | (u16[..., 1::2] << np.uint64(16))


def stream_windows(bits: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each element's 16-bit state lies in its tile's stream of ``8K`` uint32 words.

    Returns ``(i0, i1, shift)``, int64 ``[256]`` each: ``state[t] = ((u32[i0] << 32 | u32[i1]) >> shift) & 0xFFFF``
    (the window ``[S(t) - 16, S(t))`` modulo the tile's ``256*K`` bits, MSB first; see :func:`window_ends`).
    """
    nbits = int(256 * bits)
    nwords = nbits // 32
    start = (window_ends(bits) - 16) % nbits
    i0 = start // 32
    i1 = (i0 + 1) % nwords
    shift = 48 - start % 32  # 64 - 16 - (start % 32)
    return i0, i1, shift


def trellis_shape(k: int, n: int, bits: float) -> tuple[int, int, int]:
    """Shape of the int16 trellis of a ``(k, n)`` linear at ``bits`` per weight: ``(k/16, n/16, 16*K)``."""
    if k % 16 or n % 16 or k <= 0 or n <= 0:
        raise ValueError(f"EXL3 linear dims must be positive multiples of 16, got ({k}, {n})")
    _check_bits(bits)
    return (k // 16, n // 16, int(16 * bits))


def bits_from_trellis(trellis: np.ndarray) -> float:
    """K, bits per weight, from the trellis's last dimension (``16 * K`` int16 words per tile)."""
    words = trellis.shape[-1]
    bits = words / 16
    if words % 8 != 0 or bits not in INTEGER_BITS + HALF_BITS:
        raise ValueError(f"trellis last dimension {words} is not 16*K for a supported K {INTEGER_BITS + HALF_BITS}")
    return bits


def trellis_states(trellis: np.ndarray) -> np.ndarray:
    """The 16-bit state of every element, in trellis order.

    Parameters
    ----------
    trellis : int16 ``[..., 16*K]``, one tile per leading index.

    Returns
    -------
    uint16 ``[..., 256]``: ``state[t]`` = stream bits ``[S(t) - 16, S(t))`` modulo the tile's ``256*K`` bits,
    MSB first, where ``S(t)`` is the end of element t's code.
    """
    bits = bits_from_trellis(trellis)
    words = _stream_words(trellis)
    i0, i1, shift64 = stream_windows(bits)
    shift = shift64.astype(np.uint64)
    pair = (words[..., i0] << np.uint64(32)) | words[..., i1]
    return ((pair >> shift) & np.uint64(0xFFFF)).astype(np.uint16)


def tensor_core_perm() -> np.ndarray:
    """``perm[t]``: the row-major position (``r * 16 + c``) of trellis element t in its 16x16 tile."""
    perm = np.empty(256, dtype=np.int64)
    for t in range(32):
        r0 = (t % 4) * 2
        r1, r2, r3 = r0 + 1, r0 + 8, r0 + 9
        c0 = t // 4
        c1 = c0 + 8
        perm[8 * t : 8 * t + 8] = [
            r0 * 16 + c0, r1 * 16 + c0, r2 * 16 + c0, r3 * 16 + c0,
            r0 * 16 + c1, r1 * 16 + c1, r2 * 16 + c1, r3 * 16 + c1,
        ]  # fmt: skip
    return perm


_PERM = tensor_core_perm()


def decode_states(states: np.ndarray, codebook: Codebook) -> np.ndarray:
    """States ``[tk, tn, 256]`` in trellis order -> W_inner fp16 ``(16*tk, 16*tn)``."""
    tk, tn, _ = states.shape
    vals = codebook_values(states, codebook)
    tiles = np.empty_like(vals)
    tiles[..., _PERM] = vals
    return tiles.reshape(tk, tn, 16, 16).transpose(0, 2, 1, 3).reshape(16 * tk, 16 * tn)


def decode(trellis: np.ndarray, codebook: Codebook) -> np.ndarray:
    """Decode a trellis to ``W_inner``, the fp16 weights in the Hadamard basis, bit-exactly.

    Parameters
    ----------
    trellis : int16 ``[k/16, n/16, 16*K]``.
    codebook : "3inst", "mcg" or "mul1".

    Returns
    -------
    float16 ``(k, n)``.
    """
    trellis = np.asarray(trellis)
    _check_trellis(trellis, "trellis")
    _check_bits(bits_from_trellis(trellis), codebook)
    tk, tn, _ = trellis.shape
    out = np.empty((16 * tk, 16 * tn), dtype=np.float16)
    rows_per_chunk = max(1, 8192 // max(tn, 1))  # bound the temporary memory (~8k tiles at a time)
    for r in range(0, tk, rows_per_chunk):
        chunk = trellis[r : r + rows_per_chunk]
        out[16 * r : 16 * (r + chunk.shape[0])] = decode_states(trellis_states(chunk), codebook)
    return out


# ----------------------------------------------------------------------------------------------- Hadamard


def hadamard_matrix(size: int = 128) -> np.ndarray:
    """The Sylvester Hadamard matrix of ``size`` (a power of two), entries +-1 (not normalised), float64."""
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


_H128 = hadamard_matrix(128) * _HAD_SCALE


def hadamard_128(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Blockwise orthonormal Sylvester Hadamard-128 along ``axis`` (length a multiple of 128), in float64."""
    x = np.asarray(x, dtype=np.float64)
    x = np.moveaxis(x, axis, -1)
    size = x.shape[-1]
    if size % 128 != 0:
        raise ValueError(f"Hadamard-128 needs a length that is a multiple of 128, got {size}")
    blocks = x.reshape(*x.shape[:-1], size // 128, 128)
    out = (blocks @ _H128).reshape(x.shape)
    return np.moveaxis(out, -1, axis)


# --------------------------------------------------------------------------------------- reconstruction


def reconstruct(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: Codebook) -> np.ndarray:
    """The original-basis weight ``W = diag(suh) H W_inner H diag(svh)`` (float32 ``(k, n)``, ``y = x @ W``)."""
    w_inner = decode(trellis, codebook)
    k, n = w_inner.shape
    suh64 = _check_vector(suh, k, "suh").astype(np.float64)
    svh64 = _check_vector(svh, n, "svh").astype(np.float64)
    w = hadamard_128(hadamard_128(w_inner, axis=0), axis=1)
    return (suh64[:, None] * w * svh64[None, :]).astype(np.float32)


def linear(
    x: np.ndarray,
    trellis: np.ndarray,
    suh: np.ndarray,
    svh: np.ndarray,
    codebook: Codebook,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """``y = x @ W (+ bias)`` in the EXL3 forward order, float64 inside, float32 ``(m, n)`` out.

    ``xh = H(x * suh)``; ``t = xh @ W_inner``; ``y = H(t) * svh + bias``.
    """
    w_inner = decode(trellis, codebook)
    k, n = w_inner.shape
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must have shape (m, {k}), got {x.shape}")
    if x.dtype.kind != "f":
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    suh64 = _check_vector(suh, k, "suh").astype(np.float64)
    svh64 = _check_vector(svh, n, "svh").astype(np.float64)
    xh = hadamard_128(x.astype(np.float64) * suh64[None, :])
    y = hadamard_128(xh @ w_inner.astype(np.float64)) * svh64[None, :]
    if bias is not None:
        y = y + _check_vector(bias, n, "bias", dtypes=(np.float16, np.float32)).astype(np.float64)
    return y.astype(np.float32)


# ------------------------------------------------------------------------------------------- validation


def _check_trellis(trellis: np.ndarray, name: str) -> None:
    if trellis.dtype != np.int16:
        raise ValueError(f"{name}: trellis dtype must be int16 (I16), got {trellis.dtype}")
    if trellis.ndim != 3:
        raise ValueError(f"{name}: trellis must be 3-D [k/16, n/16, 16*K], got shape {trellis.shape}")
    tk, tn, words = trellis.shape
    if (16 * tk) % 128 or (16 * tn) % 128 or tk == 0 or tn == 0:
        raise ValueError(
            f"{name}: k = {16 * tk} and n = {16 * tn} must be positive multiples of 128 (trellis shape {trellis.shape})"
        )
    try:
        bits_from_trellis(trellis)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _check_vector(v: np.ndarray, length: int, name: str, dtypes: tuple[type, ...] = (np.float16,)) -> np.ndarray:
    v = np.asarray(v)
    if v.dtype not in dtypes:
        allowed = ", ".join(np.dtype(d).name for d in dtypes)
        raise ValueError(f"{name}: dtype must be {allowed}, got {v.dtype}")
    if v.shape != (length,):
        raise ValueError(f"{name}: shape must be ({length},), got {v.shape}")
    return v


class SafetensorsHandle(Protocol):
    """What ``Exl3Tensor.from_safetensors`` needs: ``safetensors.safe_open(path, "numpy")`` or a dict."""

    def keys(self) -> Any: ...

    def get_tensor(self, name: str) -> np.ndarray: ...


class _DictHandle:
    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self._t = tensors

    def keys(self) -> Any:
        return self._t.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        return np.asarray(self._t[name])


_KNOWN_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")


def _unpack_signs(packed: np.ndarray, length: int, name: str) -> np.ndarray:
    """Legacy ``su``/``sv``: element ``16j+b`` is bit b of uint16 word j; set means -1."""
    if packed.dtype != np.int16 or packed.shape != (length // 16,):
        raise ValueError(
            f"{name}: legacy sign vector must be int16 [{length // 16}], got {packed.dtype} {packed.shape}"
        )
    bits = (packed.view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & 1
    return np.where(bits.reshape(-1) == 1, -1.0, 1.0).astype(np.float16)


@dataclasses.dataclass(frozen=True, eq=False)
class Exl3Tensor:
    """One EXL3 linear: its on-disk tensors plus the derived codebook, bits and shape.

    ``y = x @ W`` with ``W`` of shape ``(k, n)`` = (in_features, out_features).
    """

    trellis: np.ndarray  # int16 [k/16, n/16, 16*K]
    suh: np.ndarray  # float16 [k]
    svh: np.ndarray  # float16 [n]
    bias: np.ndarray | None  # float16 [n] or None
    codebook: Codebook
    bits: float
    k: int
    n: int

    def __post_init__(self) -> None:
        self.validate("Exl3Tensor")

    @classmethod
    def from_arrays(
        cls,
        trellis: np.ndarray,
        suh: np.ndarray,
        svh: np.ndarray,
        codebook: Codebook,
        bias: np.ndarray | None = None,
        name: str = "Exl3Tensor",
    ) -> Exl3Tensor:
        """Build and validate from arrays; ``k``, ``n`` and ``bits`` are derived from the trellis."""
        trellis = np.asarray(trellis)
        _check_trellis(trellis, name)
        if codebook not in CODEBOOKS:
            raise ValueError(f"{name}: unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
        tk, tn, _ = trellis.shape
        if bias is not None:
            bias = np.asarray(bias)
            if bias.dtype == np.float32:
                bias = bias.astype(np.float16)
        return cls(
            trellis=trellis,
            suh=np.asarray(suh),
            svh=np.asarray(svh),
            bias=bias,
            codebook=codebook,
            bits=bits_from_trellis(trellis),
            k=16 * tk,
            n=16 * tn,
        )

    def validate(self, name: str) -> None:
        _check_trellis(self.trellis, f"{name}.trellis")
        tk, tn, _ = self.trellis.shape
        if (self.k, self.n) != (16 * tk, 16 * tn):
            raise ValueError(f"{name}: k, n = {self.k}, {self.n} disagree with trellis {self.trellis.shape}")
        if self.codebook not in CODEBOOKS:
            raise ValueError(f"{name}: unknown codebook {self.codebook!r}; expected one of {CODEBOOKS}")
        if self.bits != bits_from_trellis(self.trellis):
            raise ValueError(f"{name}: bits {self.bits} disagree with trellis {self.trellis.shape}")
        try:
            _check_bits(self.bits, self.codebook)
        except ValueError as e:
            raise ValueError(f"{name}.trellis: {e}") from None
        _check_vector(self.suh, self.k, f"{name}.suh")
        _check_vector(self.svh, self.n, f"{name}.svh")
        if self.bias is not None:
            _check_vector(self.bias, self.n, f"{name}.bias")

    @classmethod
    def from_safetensors(cls, handle: SafetensorsHandle | Mapping[str, np.ndarray], prefix: str) -> Exl3Tensor:
        """Read ``<prefix>.trellis``, ``.suh``, ``.svh``, the marker and ``.bias`` from a safetensors handle.

        ``handle`` is ``safetensors.safe_open(path, framework="numpy")`` (or any object with ``keys()`` and
        ``get_tensor(name)``, or a dict of arrays). Legacy packed ``su``/``sv`` sign vectors are accepted.
        Raises ValueError naming the tensor for a missing tensor, a wrong dtype or shape, or an unknown
        or conflicting marker.
        """
        h: SafetensorsHandle = _DictHandle(handle) if isinstance(handle, Mapping) else handle
        keys = set(h.keys())
        present = {s for s in _KNOWN_SUFFIXES if f"{prefix}.{s}" in keys}
        unknown = sorted(
            key for key in keys
            if key.startswith(prefix + ".") and "." not in key[len(prefix) + 1 :]
            and key[len(prefix) + 1 :] not in _KNOWN_SUFFIXES
        )  # fmt: skip
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown EXL3 tensor or codebook marker")
        if "trellis" not in present:
            raise ValueError(f"{prefix}.trellis: missing (not an EXL3 linear)")
        trellis = h.get_tensor(f"{prefix}.trellis")
        _check_trellis(trellis, f"{prefix}.trellis")
        tk, tn, _ = trellis.shape
        k, n = 16 * tk, 16 * tn

        def scale_vector(new: str, legacy: str, length: int) -> np.ndarray:
            if new in present:
                v = h.get_tensor(f"{prefix}.{new}")
                return _check_vector(v, length, f"{prefix}.{new}")
            if legacy in present:
                return _unpack_signs(h.get_tensor(f"{prefix}.{legacy}"), length, f"{prefix}.{legacy}")
            raise ValueError(f"{prefix}.{new}: missing")

        suh = scale_vector("suh", "su", k)
        svh = scale_vector("svh", "sv", n)
        markers = [m for m in ("mcg", "mul1") if m in present]
        if len(markers) > 1:
            raise ValueError(f"{prefix}.mcg: conflicting codebook markers {markers}")
        codebook: Codebook = "3inst"
        if markers:
            name = f"{prefix}.{markers[0]}"
            marker = h.get_tensor(name)
            if marker.dtype != np.int32 or marker.shape != ():
                raise ValueError(f"{name}: codebook marker must be a 0-dim int32, got {marker.dtype} {marker.shape}")
            if int(marker) != MARKERS[markers[0]]:
                raise ValueError(
                    f"{name}: unknown codebook marker value {int(marker)} (expected {MARKERS[markers[0]]})"
                )
            codebook = markers[0]  # type: ignore[assignment]
        bias = None
        if "bias" in present:
            bias = h.get_tensor(f"{prefix}.bias")
            bias = _check_vector(bias, n, f"{prefix}.bias", dtypes=(np.float16, np.float32)).astype(np.float16)
        try:
            _check_bits(bits_from_trellis(trellis), codebook)
        except ValueError as e:
            raise ValueError(f"{prefix}.trellis: {e}") from None
        return cls.from_arrays(trellis, suh, svh, codebook, bias, name=prefix)

    def to_tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The exact on-disk tensor set: trellis I16, suh/svh F16, a 0-dim I32 marker (not for 3INST), bias."""
        out = {
            f"{prefix}.trellis": np.ascontiguousarray(self.trellis, dtype=np.int16),
            f"{prefix}.suh": np.ascontiguousarray(self.suh, dtype=np.float16),
            f"{prefix}.svh": np.ascontiguousarray(self.svh, dtype=np.float16),
        }
        if self.codebook in MARKERS:
            out[f"{prefix}.{self.codebook}"] = np.array(MARKERS[self.codebook], dtype=np.int32)
        if self.bias is not None:
            out[f"{prefix}.bias"] = np.ascontiguousarray(self.bias, dtype=np.float16)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        return sum(a.nbytes for a in self.to_tensors("t").values())

    def decode(self) -> np.ndarray:
        """W_inner fp16 ``(k, n)``."""
        return decode(self.trellis, self.codebook)

    def reconstruct(self) -> np.ndarray:
        """Original-basis W float32 ``(k, n)``."""
        return reconstruct(self.trellis, self.suh, self.svh, self.codebook)

    def linear(self, x: np.ndarray) -> np.ndarray:
        """``x @ W + bias`` float32 ``(m, n)``."""
        return linear(x, self.trellis, self.suh, self.svh, self.codebook, self.bias)


def random_tensor(
    k: int,
    n: int,
    bits: float,
    codebook: Codebook,
    seed: int | np.random.Generator = 0,
    *,
    bias: bool = False,
) -> Exl3Tensor:
    """A valid random EXL3 tensor: any trellis bit pattern is a valid tail-biting encoding.

    ``suh`` and ``svh`` are random signs times magnitudes drawn like a real conversion's (input RMS over the
    codebook scale, output-channel scales), chosen so that ``W``'s entries have RMS about ``1/sqrt(k)``:
    ``x @ W`` keeps unit-variance inputs at unit variance, comfortably inside fp16 range.
    """
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    _check_bits(bits, codebook)
    if k <= 0 or n <= 0 or k % 128 or n % 128:
        raise ValueError(f"k = {k} and n = {n} must be positive multiples of 128")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    words = int(16 * bits)
    trellis = rng.integers(-32768, 32768, size=(k // 16, n // 16, words), dtype=np.int16)
    cb_rms = {"3inst": 1.243711, "mcg": 1.244112, "mul1": 1.000312}[codebook]
    signs_k = rng.choice(np.array([-1.0, 1.0]), size=k)
    signs_n = rng.choice(np.array([-1.0, 1.0]), size=n)
    suh = (signs_k * rng.uniform(0.5, 1.5, size=k) / (cb_rms * math.sqrt(k))).astype(np.float16)
    svh = (signs_n * rng.uniform(0.5, 1.5, size=n)).astype(np.float16)
    b = (rng.standard_normal(n) * 0.1).astype(np.float16) if bias else None
    return Exl3Tensor.from_arrays(trellis, suh, svh, codebook, b)
