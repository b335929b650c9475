// EXL3 GEMV kernels over one band of 8 output tiles (128 columns), for one ISA variant.
//
//   y[m, c] = sum_k xh[m, k] * W_inner[k, c]      for the 128 columns c of the band, all k (k-major stream)
//
// Two paths:
//  * float path (every codebook): each group of 8 states is decoded once to fp32 values (optionally rounded to
//    the exact fp16 codebook value) and FMA'd into the accumulators of all m tokens;
//  * integer path (MUL1, "fast"): weights stay byte sums bs of state * 0x83DCD12D (value ~ bs * K_INV + K_AFF);
//    activations are int16 per tile row (16 k values) with scale amax / XQ_MAX (32639), so
//    y = K_INV * sum_rows scale_r * sum(bs * xq) + K_AFF * sum(x^), summed exactly in int32 within a tile.
//
// Activation layouts (prepared by ops.h): per token, per tile row r, 16 values in "q order": position 4q + i holds
// k = 16r + 2q + (i & 1) + 8 (i >> 1), the 4 rows that the 8 lanes of group q (of any column pair) multiply.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>
#include <type_traits>
#include <utility>

#include "common.h"
#include "tables.h"
#if defined(CPU_TIER_ISA_AVX512) && defined(CT_EMU512)
#include "emu512.h"
#endif
#include "amx.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

struct MatRef {
    const uint8_t* trellis = nullptr;  // [k/16][n/16][32K bytes]
    const uint16_t* suh = nullptr;     // fp16 [k]
    const uint16_t* svh = nullptr;     // fp16 [n]
    const uint16_t* bias = nullptr;    // fp16 [n] or null
    int k = 0, n = 0, bits2 = 0, codebook = 0;
    const TrellisTables* tb = nullptr;
};

struct Acts {
    int m = 0;
    const float* xf = nullptr;  // float path: [m][k] q order
    size_t xf_stride = 0;
    const int16_t* xq = nullptr;  // int path: [m][k] q order
    size_t xq_stride = 0;
    const float* xs = nullptr;  // [m][k/128] scales (int path)
    size_t xs_stride = 0;
    const float* xsum = nullptr;  // [m] sum of the activations (quantised ones on the int path)
    // Row range of the call, in 128-row blocks: [blk0, blk1) (blk1 < 0: to the end). A partial range gives partial
    // sums (additive over ranges); raw = true leaves MUL1's integer-path sums without the final affine map
    // (y * K_INV + K_AFF * xsum), for the caller to apply once to the total.
    int blk0 = 0, blk1 = -1;
    bool raw = false;
    int variant = 0;  // benchmark A/B of kernel forms (0 = the default; 1, 2: the vpermt2b forms, see band_int16)
    bool amx = false;  // MUL1 integer path, K <= 4: the AMX kernel (band_amx; the caller has the OS permission)
    int pf_blocks = 1;  // software prefetch distance in 128-row blocks (0..4, 0 = none; BandPrefetch)
};

constexpr int MAXM = 8;

// How a band is computed:
//  Exact : float path, exact fp16 codebook values, fp32 activations (every codebook);
//  Fast  : float path without the fp16 rounding of the codebook value (MCG / 3INST);
//  Int   : MUL1, int16 activations (one scale per 128-block per token), exact int32 sums per block,
//          y = K_INV * sum_blocks scale_b * sum(bs * xq) + K_AFF * sum(x^).
enum class GemvMode { Exact, Fast, Int };

#define CT_LAMBDA_INLINE __attribute__((always_inline))

template <class F, int... I>
CT_INLINE void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}): a compile-time unrolled loop.
template <int N, class F>
CT_INLINE void static_for(F&& f) {
    static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// Row (k offset inside a tile row) of q-order position p.
CT_INLINE int qorder_row(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }

// The integer path's last step for token t: y = sum * K_INV + K_AFF * sum(x^) over the band's 128 outputs, unless
// the call leaves its sums raw (Acts::raw: a row range, mapped once by the caller).
CT_INLINE void int_affine(float* y128, const Acts& X, int t) {
    if (X.raw) return;
    const float s = MUL1_K_AFF * X.xsum[t];
    for (int c = 0; c < 128; ++c) y128[c] = y128[c] * MUL1_K_INV + s;
}

// Scalar state of element t of a tile (reference decode, used by the scalar variant and the tests).
CT_INLINE uint32_t tile_state(const uint8_t* tile, const TrellisTables& tb, int t) {
    const int nwords = tb.tile_bytes / 4;
    const int s = tb.start[t];
    const int i0 = s >> 5;
    const int i1 = (i0 + 1) % nwords;
    uint32_t w0, w1;
    std::memcpy(&w0, tile + 4 * i0, 4);
    std::memcpy(&w1, tile + 4 * i1, 4);
    const uint64_t pair = (uint64_t(w0) << 32) | w1;
    return uint32_t(pair >> (48 - (s & 31))) & 0xFFFFu;
}

CT_INLINE uint32_t mul1_bytesum(uint32_t state) {
    const uint32_t p = state * MUL1_MULT;
    return (p & 0xFF) + ((p >> 8) & 0xFF) + ((p >> 16) & 0xFF) + (p >> 24);
}

// Codebook value as fp32; round=true gives the exact fp16 codebook value (bit-exact with the GPU).
CT_INLINE float codebook_value(uint32_t state, int cb, bool round) {
    if (cb == CB_MUL1) {
        const float v = float(mul1_bytesum(state)) * MUL1_K_INV + MUL1_K_AFF;
        return round ? round_to_half(v) : v;
    }
    uint32_t x = cb == CB_MCG ? state * MCG_MULT : state * INST3_MULT + INST3_ADD;
    x = (x & LOP3_AND) ^ LOP3_XOR;
    const float v = half_to_float(uint16_t(x & 0xFFFF)) + half_to_float(uint16_t(x >> 16));
    return round ? round_to_half(v) : v;
}

#if defined(CPU_TIER_ISA_SCALAR)
// =============================================================================================== scalar
constexpr const char* ISA_NAME = "scalar";

// Row-major position of trellis element t inside its 16x16 tile.
CT_INLINE int elem_row(int t) { return 2 * ((t >> 3) & 3) + (t & 1) + 8 * ((t >> 1) & 1); }
CT_INLINE int elem_col(int t) { return (t >> 5) + 8 * ((t >> 2) & 1); }

inline void gemv_band(const MatRef& A, int band, const Acts& X, GemvMode mode, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tb.tile_bytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tb.tile_bytes;
    const int m = X.m;
    std::fill(y, y + size_t(m) * 128, 0.0f);
    float w[256];
    int32_t bs[256];
    std::vector<int64_t> iacc(size_t(m) * 128, 0);
    for (int r = r0; r < r1; ++r) {
        const uint8_t* row = base + r * row_stride;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tb.tile_bytes;
            for (int t = 0; t < 256; ++t) {
                const uint32_t st = tile_state(tile, tb, t);
                const int pos = elem_row(t) * 16 + elem_col(t);
                if (mode == GemvMode::Int)
                    bs[pos] = int32_t(mul1_bytesum(st));
                else
                    w[pos] = codebook_value(st, A.codebook, mode == GemvMode::Exact);
            }
            for (int t = 0; t < m; ++t)
                for (int c = 0; c < 16; ++c) {
                    if (mode == GemvMode::Int) {
                        const int16_t* xq = X.xq + t * X.xq_stride + 16 * r;
                        int64_t acc = 0;
                        for (int p = 0; p < 16; ++p) acc += bs[qorder_row(p) * 16 + c] * int32_t(xq[p]);
                        iacc[size_t(t) * 128 + 16 * j + c] += acc;
                    } else {
                        const float* xf = X.xf + t * X.xf_stride + 16 * r;
                        float acc = 0.0f;
                        for (int p = 0; p < 16; ++p)
                            acc += w[qorder_row(p) * 16 + c] * xf[p];
                        y[t * 128 + 16 * j + c] += acc;
                    }
                }
        }
        if (mode == GemvMode::Int && (r % 8 == 7 || r == r1 - 1)) {
            for (int t = 0; t < m; ++t) {
                const float sc = X.xs[t * X.xs_stride + r / 8];
                for (int c = 0; c < 128; ++c) {
                    y[t * 128 + c] += float(iacc[size_t(t) * 128 + c]) * sc;
                    iacc[size_t(t) * 128 + c] = 0;
                }
            }
        }
    }
    if (mode == GemvMode::Int)
        for (int t = 0; t < m; ++t) int_affine(y + 128 * t, X, t);
}

#elif defined(CPU_TIER_ISA_AVX2) || defined(CPU_TIER_ISA_AVX512)
// ======================================================================================= AVX2 and AVX-512
#if defined(CPU_TIER_ISA_AVX512) && defined(CT_EMU512)
constexpr const char* ISA_NAME = "avx512emu";
#elif defined(CPU_TIER_ISA_AVX512)
constexpr const char* ISA_NAME = "avx512";
#else
constexpr const char* ISA_NAME = "avx2";
#endif

// Prefetch `bytes` at p into L1 (prefetcht0), a line at a time.
CT_INLINE void prefetch_row(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// Software prefetch of a band's trellis rows (one tile row of the band = 8 tiles, 8 * tbytes bytes), D = X.pf_blocks
// 128-row blocks (8 tile rows) ahead; D = 0: none (the hardware prefetchers alone). Block kernels: the call's first
// D blocks up front (start), then at tile column j of block blk the row 8 (blk + D) + j (at). Row kernels: 8 D - 2
// rows ahead (row). Past the call's last row, a row-range call (Acts::blk1 >= 0, split jobs) prefetches the first
// rows of the next band, which its caller computes next with the same rows.
#if defined(CT_EMU512)
// Test hook of the emulated build: every band prefetch is counted, and counted again when any of its bytes lie
// outside its matrix's trellis (a prefetch never faults, so a wrong address would otherwise go unseen).
inline std::atomic<long>& emu_prefetch_calls() {
    static std::atomic<long> n{0};
    return n;
}
inline std::atomic<long>& emu_prefetch_outside() {
    static std::atomic<long> n{0};
    return n;
}
#endif
struct BandPrefetch {
    const uint8_t* base;
    const uint8_t* next_base;  // the next band's first tile of row 0, or nullptr
    const uint8_t *lo, *hi;    // the matrix's trellis
    size_t row_stride;
    int bytes, r0, r1, d;
    BandPrefetch(const MatRef& A, int band, const Acts& X, int tbytes) {
        const int tiles_k = A.k / 16, tiles_n = A.n / 16;
        r0 = 8 * X.blk0;
        r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;
        row_stride = size_t(tiles_n) * tbytes;
        base = A.trellis + size_t(band) * 8 * tbytes;
        next_base = X.blk1 >= 0 && band + 1 < tiles_n / 8 ? base + 8 * tbytes : nullptr;
        lo = A.trellis;
        hi = A.trellis + size_t(tiles_k) * row_stride;
        bytes = 8 * tbytes;
        d = X.pf_blocks;
    }
    CT_INLINE void issue(const uint8_t* p) const {
#if defined(CT_EMU512)
        emu_prefetch_calls().fetch_add(1, std::memory_order_relaxed);
        if (p < lo || p + bytes > hi) emu_prefetch_outside().fetch_add(1, std::memory_order_relaxed);
#endif
        prefetch_row(p, bytes);
    }
    CT_INLINE void fetch(int r) const {  // row r of this call's rows, or row r - r1 of the next band's
        if (d == 0) return;
        if (r < r1)
            issue(base + size_t(r) * row_stride);
        else if (next_base && r0 + (r - r1) < r1)
            issue(next_base + size_t(r0 + (r - r1)) * row_stride);
    }
    CT_INLINE void start() const {
        for (int r = r0; r < std::min(r0 + 8 * d, r1); ++r) issue(base + size_t(r) * row_stride);
    }
    CT_INLINE void at(int blk, int j) const { fetch(8 * (blk + d) + j); }
    CT_INLINE int row_ahead() const { return 8 * d - 2; }
    CT_INLINE void start_rows() const {
        for (int r = r0; r < std::min(r0 + row_ahead(), r1); ++r) issue(base + size_t(r) * row_stride);
    }
    CT_INLINE void row(int r) const { fetch(r + row_ahead()); }
};

// The tile's wrapped 16-byte window [last 4 bytes, first 12 bytes].
CT_INLINE __m128i wrap_window(const uint8_t* tile, int tile_bytes) {
    return _mm_alignr_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + tile_bytes - 16)), 12);
}

constexpr int EXT_STRIDE = 272;  // >= 4 + 256 (largest tile), multiple of 16

// Generic K: copy a row's 8 tiles to ext = [last 4 bytes | tile] per tile, so every window (base >= -4) is
// ext + 4 + base. Reads exactly the tiles' bytes.
CT_INLINE void copy_row_ext(const uint8_t* row, int tbytes, uint8_t* ext) {
    for (int j = 0; j < 8; ++j) {
        const uint8_t* tile = row + j * tbytes;
        uint8_t* e = ext + j * EXT_STRIDE;
        std::memcpy(e, tile + tbytes - 4, 4);
        for (int o = 0; o < tbytes; o += 16)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(e + 4 + o), _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + o)));
    }
}

// 32-byte register of slot S: [window of gA | window of gB].
template <int BITS2, int S>
CT_INLINE __m256i slot_window(const uint8_t* tile, const uint8_t* ext, __m128i wrapv, const TrellisTables& tb) {
    if constexpr (BITS2 != 0) {
        constexpr CtSlot sl = ct_slot(BITS2, S);
        if constexpr (sl.single) {
            return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + sl.baseA));
        } else {
            __m128i lo, hi;
            if constexpr (sl.baseA < 0) lo = wrapv;
            else lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + sl.baseA));
            if constexpr (sl.baseB < 0) hi = wrapv;
            else hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + sl.baseB));
            return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        }
    } else {
        (void)tile;
        (void)wrapv;
        return _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ext + 4 + tb.baseA[S]))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(ext + 4 + tb.baseB[S])), 1);
    }
}

template <int BITS2>
constexpr bool ct_needs_wrap() {
    if constexpr (BITS2 == 0) {
        return false;
    } else {
        bool any = false;
        for (int s = 0; s < 16; ++s) {
            const CtSlot sl = ct_slot(BITS2, s);
            any = any || (!sl.single && (sl.baseA < 0 || sl.baseB < 0));
        }
        return any;
    }
}

// facc [8 j][4 a][2 h][L lanes] (L = 8: AVX2 registers per half; 16: AVX-512 holds both halves, same memory
// layout). Half h, lanes 0-3 -> column 16j + 2a + 8h, lanes 4-7 -> column 16j + 2a + 1 + 8h.
CT_INLINE void reduce_tile_acc(const float* facc, float* y) {
    for (int j = 0; j < 8; ++j)
        for (int a = 0; a < 4; ++a)
            for (int h = 0; h < 2; ++h) {
                const float* v = facc + ((j * 4 + a) * 2 + h) * 8;
                y[16 * j + 2 * a + 8 * h] = (v[0] + v[1]) + (v[2] + v[3]);
                y[16 * j + 2 * a + 1 + 8 * h] = (v[4] + v[5]) + (v[6] + v[7]);
            }
}

CT_INLINE __m256 round_half(__m256 f) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Float values of 8 masked states. MUL1 without rounding: the byte sum itself (the caller applies the affine map).
template <int CB, bool ROUND>
CT_INLINE __m256 decode_values(__m256i s) {
    if constexpr (CB == CB_MUL1) {
        __m256i p = _mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(MUL1_MULT)));
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(p, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
        if constexpr (ROUND)
            return round_half(_mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(MUL1_K_INV), _mm256_set1_ps(MUL1_K_AFF)));
        else
            return _mm256_cvtepi32_ps(p);
    } else {
        __m256i x = CB == CB_MCG ? _mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(MCG_MULT)))
                                 : _mm256_add_epi32(_mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(INST3_MULT))),
                                                    _mm256_set1_epi32(int32_t(INST3_ADD)));
        x = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(LOP3_AND))),
                             _mm256_set1_epi32(int32_t(LOP3_XOR)));
        // Both fp16 halves to fp32 by moving their bits (all values are normal, exponent 12..15), * 2^112.
        const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
        const __m256i manexp = _mm256_set1_epi32(0x0FFFE000);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(x, sign), _mm256_and_si256(_mm256_srli_epi32(x, 3), manexp));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(x, 16), sign),
                                           _mm256_and_si256(_mm256_slli_epi32(x, 13), manexp));
        const __m256 f = _mm256_mul_ps(_mm256_add_ps(_mm256_castsi256_ps(hi), _mm256_castsi256_ps(lo)),
                                       _mm256_set1_ps(5.192296858534828e33f));  // 2^112
        return ROUND ? round_half(f) : f;
    }
}

#if defined(CPU_TIER_ISA_AVX2)
// -------------------------------------------------------------------------------------------- AVX2 bodies

// 8 masked states of (slot S, half H) from the slot register.
template <bool UNIFORM, int S, int H>
CT_INLINE __m256i slot_states(__m256i L, const TrellisTables& tb, __m256i sh, __m256i mask16) {
    __m256i v = _mm256_shuffle_epi8(L, _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.ctrl[S][H])));
    v = _mm256_srlv_epi32(v, UNIFORM ? sh : _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[S][H])));
    return _mm256_and_si256(v, mask16);
}

// One token, MUL1, int16 activations (per 128-block scale), int32 sums per block.
template <int BITS2, bool UNIFORM>
static void band_int1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    alignas(64) float facc[8 * 4 * 2 * 8];
    alignas(64) int32_t iacc[8 * 4 * 2 * 8];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
    const __m256i mult = _mm256_set1_epi32(int32_t(MUL1_MULT));
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    auto flush = [&](int blk) {
        const __m256 sc = _mm256_set1_ps(X.xs[blk]);
        for (int i = 0; i < 8 * 4 * 2 * 8; i += 8) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(iacc + i));
            _mm256_store_ps(facc + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, _mm256_load_ps(facc + i)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(iacc + i), _mm256_setzero_si256());
        }
    };
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start_rows();
    for (int r = r0; r < r1; ++r) {
        if (r > r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = base + r * row_stride;
        pf.row(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        __m256i xp[4];
        for (int q = 0; q < 4; ++q) {
            int64_t v;
            std::memcpy(&v, X.xq + 16 * r + 4 * q, 8);
            const __m256i b = _mm256_set1_epi64x(v);
            xp[q] = _mm256_unpacklo_epi16(b, b);
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            int32_t* ia = iacc + j * 64;
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m256i acc0, acc1;
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    __m256i v0 = slot_states<UNIFORM, 4 * a + q, 0>(L, tb, sh0, mask16);
                    __m256i v1 = slot_states<UNIFORM, 4 * a + q, 1>(L, tb, sh1, mask16);
                    v0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v0, mult), ones8), xp[q]);
                    v1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v1, mult), ones8), xp[q]);
                    acc0 = q == 0 ? v0 : _mm256_add_epi32(acc0, v0);
                    acc1 = q == 0 ? v1 : _mm256_add_epi32(acc1, v1);
                });
                __m256i* p0 = reinterpret_cast<__m256i*>(ia + a * 16);
                _mm256_store_si256(p0, _mm256_add_epi32(_mm256_load_si256(p0), acc0));
                _mm256_store_si256(p0 + 1, _mm256_add_epi32(_mm256_load_si256(p0 + 1), acc1));
            });
        }
    }
    flush((r1 - 1) / 8);
    reduce_tile_acc(facc, y);
    const float s = MUL1_K_AFF * X.xsum[0];
    if (!X.raw)
        for (int c = 0; c < 128; ++c) y[c] = y[c] * MUL1_K_INV + s;
}

// One (tile j, column pair a, half h) of a block: 8 rows x 2 packed pairs, M token accumulators in registers.
struct IntConsts {
    __m256i mask16, mult, ones8, ones16, sh0, sh1;
};

template <int M, int BITS2, bool UNIFORM, int A, int H>
CT_INLINE void intm_cell_t(const uint8_t* brow, size_t row_stride, int j, int tbytes, const uint8_t* ext,
                           const TrellisTables& tb, const __m256i (*xpp)[M][2], const __m256* sc, float* facc0,
                           const IntConsts& K) {
    __m256i acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_si256();
    for (int rr = 0; rr < 8; ++rr) {
        const uint8_t* tile = brow + rr * row_stride + j * tbytes;
        const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
        __m128i wrapv = _mm_setzero_si128();
        if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
        {
            constexpr int s0 = 4 * A, s1 = s0 + 1;
            __m256i b0 = slot_states<UNIFORM, s0, H>(slot_window<BITS2, s0>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            __m256i b1 = slot_states<UNIFORM, s1, H>(slot_window<BITS2, s1>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            b0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b0, K.mult), K.ones8), K.ones16);
            b1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b1, K.mult), K.ones8), K.ones16);
            const __m256i w = _mm256_or_si256(b0, _mm256_slli_epi32(b1, 16));
            for (int t = 0; t < M; ++t) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, xpp[rr][t][0]));
        }
        {
            constexpr int s0 = 4 * A + 2, s1 = s0 + 1;
            __m256i b0 = slot_states<UNIFORM, s0, H>(slot_window<BITS2, s0>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            __m256i b1 = slot_states<UNIFORM, s1, H>(slot_window<BITS2, s1>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            b0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b0, K.mult), K.ones8), K.ones16);
            b1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b1, K.mult), K.ones8), K.ones16);
            const __m256i w = _mm256_or_si256(b0, _mm256_slli_epi32(b1, 16));
            for (int t = 0; t < M; ++t) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, xpp[rr][t][1]));
        }
    }
    for (int t = 0; t < M; ++t) {
        float* f = facc0 + t * (8 * 4 * 2 * 8) + ((j * 4 + A) * 2 + H) * 8;
        _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), sc[t], _mm256_load_ps(f)));
    }
}

template <int M, int BITS2, bool UNIFORM>
static void intm_cell(const uint8_t* brow, size_t row_stride, int j, int ah, int tbytes, const uint8_t* ext,
                      const TrellisTables& tb, const __m256i (*xpp)[M][2], const __m256* sc, float* facc0,
                      const IntConsts& K) {
    switch (ah) {
        case 0: return intm_cell_t<M, BITS2, UNIFORM, 0, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 1: return intm_cell_t<M, BITS2, UNIFORM, 0, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 2: return intm_cell_t<M, BITS2, UNIFORM, 1, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 3: return intm_cell_t<M, BITS2, UNIFORM, 1, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 4: return intm_cell_t<M, BITS2, UNIFORM, 2, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 5: return intm_cell_t<M, BITS2, UNIFORM, 2, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 6: return intm_cell_t<M, BITS2, UNIFORM, 3, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        default: return intm_cell_t<M, BITS2, UNIFORM, 3, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
    }
}

// M >= 2 tokens, MUL1, int16 activations. Two groups (q = 2p, 2p + 1) of a column pair are packed into one
// register of int16 pairs [bs(q0), bs(q1)], so each token costs one vpmaddwd per two groups. Block order: for
// each 128-row block (8 tile rows, L1 resident), every (tile, column pair, half) accumulates its 8 rows in
// registers and is flushed once with the block's per-token scale.
template <int M, int BITS2, bool UNIFORM>
static void band_intm(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    constexpr int NACC = 8 * 4 * 2 * 8;  // [j][a][h][8 lanes]
    alignas(64) float facc[M][NACC];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * 8 * EXT_STRIDE : 16];
    alignas(64) __m256i xpp[8][M][2];
    std::memset(facc, 0, sizeof(facc));
    IntConsts K;
    K.mask16 = _mm256_set1_epi32(0xFFFF);
    K.mult = _mm256_set1_epi32(int32_t(MUL1_MULT));
    K.ones8 = _mm256_set1_epi8(1);
    K.ones16 = _mm256_set1_epi16(1);
    K.sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    K.sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start();
    for (int blk = r0 / 8; blk < r1 / 8; ++blk) {
        const uint8_t* brow = base + size_t(8 * blk) * row_stride;
        for (int rr = 0; rr < 8; ++rr) {
            if constexpr (BITS2 == 0) copy_row_ext(brow + rr * row_stride, tbytes, ext + rr * 8 * EXT_STRIDE);
            for (int t = 0; t < M; ++t)
                for (int pq = 0; pq < 2; ++pq) {
                    int64_t v0, v1;
                    const int16_t* xr = X.xq + t * X.xq_stride + 16 * (8 * blk + rr) + 8 * pq;
                    std::memcpy(&v0, xr, 8);
                    std::memcpy(&v1, xr + 4, 8);
                    xpp[rr][t][pq] = _mm256_unpacklo_epi16(_mm256_set1_epi64x(v0), _mm256_set1_epi64x(v1));
                }
        }
        __m256 sc[M];
        for (int t = 0; t < M; ++t) sc[t] = _mm256_set1_ps(X.xs[t * X.xs_stride + blk]);
        for (int j = 0; j < 8; ++j) {
            pf.at(blk, j);  // block blk + D, one row per tile column, spread over the block's work
            for (int ah = 0; ah < 8; ++ah) intm_cell<M, BITS2, UNIFORM>(brow, row_stride, j, ah, tbytes, ext, tb, xpp, sc, facc[0], K);
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        int_affine(y + 128 * t, X, t);
    }
}

// M tokens, float activations, values decoded once per group (exact fp16 values, or without the final fp16
// rounding for MCG / 3INST "fast"). Block order as band_intm: accumulators stay in registers over 8 tile rows.
template <int CB, int M, bool ROUND, int BITS2, bool UNIFORM>
static void band_float(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    alignas(64) float facc[M][8 * 4 * 2 * 8];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * 8 * EXT_STRIDE : 16];
    alignas(64) __m256 xp[8][M][4];
    std::memset(facc, 0, sizeof(facc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start();
    for (int blk = r0 / 8; blk < r1 / 8; ++blk) {
        const uint8_t* brow = base + size_t(8 * blk) * row_stride;
        for (int rr = 0; rr < 8; ++rr) {
            if constexpr (BITS2 == 0) copy_row_ext(brow + rr * row_stride, tbytes, ext + rr * 8 * EXT_STRIDE);
            for (int t = 0; t < M; ++t)
                for (int q = 0; q < 4; ++q)
                    xp[rr][t][q] = _mm256_broadcast_ps(
                        reinterpret_cast<const __m128*>(X.xf + t * X.xf_stride + 16 * (8 * blk + rr) + 4 * q));
        }
        for (int j = 0; j < 8; ++j) {
            pf.at(blk, j);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                if constexpr (M <= 3) {
                    __m256 acc0[M], acc1[M];
                    for (int t = 0; t < M; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
                    for (int rr = 0; rr < 8; ++rr) {
                        const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                        const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
                        __m128i wrapv = _mm_setzero_si128();
                        if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                        static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                            constexpr int q = decltype(QQ)::value;
                            const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                            const __m256 v0 = decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, 0>(L, tb, sh0, mask16));
                            const __m256 v1 = decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, 1>(L, tb, sh1, mask16));
                            for (int t = 0; t < M; ++t) {
                                acc0[t] = _mm256_fmadd_ps(v0, xp[rr][t][q], acc0[t]);
                                acc1[t] = _mm256_fmadd_ps(v1, xp[rr][t][q], acc1[t]);
                            }
                        });
                    }
                    for (int t = 0; t < M; ++t) {
                        float* f = facc[t] + (j * 4 + a) * 16;
                        _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f), acc0[t]));
                        _mm256_store_ps(f + 8, _mm256_add_ps(_mm256_load_ps(f + 8), acc1[t]));
                    }
                } else {
                    static_for<2>([&](auto HH) CT_LAMBDA_INLINE {
                        constexpr int h = decltype(HH)::value;
                        __m256 acc[M];
                        for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
                        for (int rr = 0; rr < 8; ++rr) {
                            const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                            const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
                            __m128i wrapv = _mm_setzero_si128();
                            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                            static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                                constexpr int q = decltype(QQ)::value;
                                const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                                const __m256 v =
                                    decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, h>(L, tb, h ? sh1 : sh0, mask16));
                                for (int t = 0; t < M; ++t) acc[t] = _mm256_fmadd_ps(v, xp[rr][t][q], acc[t]);
                            });
                        }
                        for (int t = 0; t < M; ++t) {
                            float* f = facc[t] + (j * 4 + a) * 16 + 8 * h;
                            _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f), acc[t]));
                        }
                    });
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) reduce_tile_acc(facc[t], y + 128 * t);
}

#else
// ----------------------------------------------------------------------------------------- AVX-512 bodies
// One zmm per slot: [half 0 (8 lanes) | half 1 (8 lanes)], both from the slot's 32-byte register broadcast to
// the two 256-bit halves. Same tables and accumulator memory layout as AVX2.

template <bool UNIFORM, int S>
CT_INLINE __m512i slot_states16(__m512i L2, const TrellisTables& tb, __m512i sh, __m512i mask16) {
    __m512i v = _mm512_shuffle_epi8(L2, _mm512_load_si512(tb.ctrl[S]));
    v = _mm512_srlv_epi32(v, UNIFORM ? sh : _mm512_load_si512(tb.shift[S]));
    return _mm512_and_si512(v, mask16);
}

template <int BITS2, int S>
CT_INLINE __m512i slot_window2(const uint8_t* tile, const uint8_t* ext, __m128i wrapv, const TrellisTables& tb) {
    if constexpr (BITS2 != 0) {
        constexpr CtSlot sl = ct_slot(BITS2, S);
        if constexpr (sl.single)
            return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + sl.baseA)));
        else
            return _mm512_broadcast_i64x4(slot_window<BITS2, S>(tile, ext, wrapv, tb));
    } else {
        return _mm512_broadcast_i64x4(slot_window<BITS2, S>(tile, ext, wrapv, tb));
    }
}

template <int CB, bool ROUND>
CT_INLINE __m512 decode_values16(__m512i s) {
    if constexpr (CB == CB_MUL1) {
        __m512i p = _mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(MUL1_MULT)));
        p = _mm512_madd_epi16(_mm512_maddubs_epi16(p, _mm512_set1_epi8(1)), _mm512_set1_epi16(1));
        if constexpr (ROUND) {
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(MUL1_K_INV), _mm512_set1_ps(MUL1_K_AFF));
            return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            return _mm512_cvtepi32_ps(p);
        }
    } else {
        __m512i x = CB == CB_MCG ? _mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(MCG_MULT)))
                                 : _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(INST3_MULT))),
                                                    _mm512_set1_epi32(int32_t(INST3_ADD)));
        // (x & AND) ^ XOR in one ternary-logic op: imm = (A & B) ^ C = 0x6A
        x = _mm512_ternarylogic_epi32(x, _mm512_set1_epi32(int32_t(LOP3_AND)), _mm512_set1_epi32(int32_t(LOP3_XOR)), 0x6A);
        const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
        // bit select (A & C) | (B & ~C) with C = sign: ternary-logic imm 0xE4; then keep sign | exponent | mantissa
        const __m512i hi = _mm512_ternarylogic_epi32(x, _mm512_srli_epi32(x, 3), sign, 0xE4);
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi32(x, 16), _mm512_slli_epi32(x, 13), sign, 0xE4);
        const __m512i manexp_or_sign = _mm512_set1_epi32(int32_t(0x8FFFE000u));
        const __m512 f = _mm512_mul_ps(
            _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(hi, manexp_or_sign)),
                          _mm512_castsi512_ps(_mm512_and_si512(lo, manexp_or_sign))),
            _mm512_set1_ps(5.192296858534828e33f));  // 2^112
        if constexpr (ROUND) return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else return f;
    }
}

// The walk of one band call of the 16-bit-lane kernels (band_int16, band_amx): tile bytes, the tile rows
// [r0, r1) of the call, the stride between tile rows, the band's first tile, the next band's first tile when the
// caller's next call is that band over the same rows (a row-range call: prefetch it; else null), and the masks
// that load a tile of any size <= 128 bytes into two zmm without reading past it (load_tile2).
// The band of the 16-bit kernels: its rows and prefetch walk (BandPrefetch) plus the tile size and the load masks of
// a tile's two 64-byte halves.
struct Band16 : BandPrefetch {
    int tbytes;
    __mmask64 m0, m1;
    Band16(const MatRef& A, int band, const Acts& X, int tb) : BandPrefetch(A, band, X, tb), tbytes(tb) {
        m0 = tb >= 64 ? ~__mmask64(0) : ((__mmask64(1) << tb) - 1);
        m1 = tb <= 64 ? __mmask64(0) : (tb >= 128 ? ~__mmask64(0) : ((__mmask64(1) << (tb - 64)) - 1));
    }
};
template <int TB>
CT_INLINE Band16 band16(const MatRef& A, int band, const Acts& X) {
    return Band16(A, band, X, TB != 0 ? TB : A.tb->tile_bytes);
}

// MUL1 integer path on 16-bit lanes (K <= 4: the whole tile fits two zmm registers). Per 32 weights (one column
// pair c0 of a tile): vpermt2b + vpmultishiftqb extract 32 states; s * 0x83DCD12D mod 2^32 from three 16-bit
// multiplies (low half: lo16(s * 0xD12D); high half: hi16(s * 0xD12D) + lo16(s * 0x83DC)); two vpmaddubsw give
// the byte sums bs (int16); one vpdpwssd per token multiplies adjacent lanes (two rows of one column) by their
// int16 activations. Block order: 8 tile rows accumulate in registers, then one flush with the block's scale.
// Tile bytes 0..127 in two registers without reading past the tile: plain loads where whole, masked otherwise.
template <int TB>
CT_INLINE void load_tile2(const uint8_t* tile, int tbytes, __mmask64 m0, __mmask64 m1, __m512i& z0, __m512i& z1) {
    if constexpr (TB == 96) {  // K = 3
        z0 = _mm512_loadu_si512(tile);
        z1 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64)));
    } else if constexpr (TB == 128) {  // K = 4
        z0 = _mm512_loadu_si512(tile);
        z1 = _mm512_loadu_si512(tile + 64);
    } else if constexpr (TB == 64) {  // K = 2
        z0 = _mm512_loadu_si512(tile);
        z1 = z0;
    } else {
        (void)tbytes;
        z0 = _mm512_maskz_loadu_epi8(m0, tile);
        z1 = _mm512_maskz_loadu_epi8(m1, tile + 64);
    }
}

// VPERMB = true (the default): column pairs whose stream bytes lie in one in-tile 64-byte window
// (TrellisTables::vperm1_base) take one load there and a one-register vpermb instead of vpermt2b (2 port-cycles
// on Emerald Rapids' two 512-bit ports); the pairs that wrap the tile's end keep vpermt2b. Measured 7-14% faster
// on one core of Emerald Rapids, equal within noise on 16 (README).
// VPERMB = false, the benchmark's variants 1 and 2 (the former default forms): every pair takes vpermt2b on the
// whole tile in two registers. RELOAD = false (variant 2): GCC hoists the 8 rows' tiles out of the column-pair
// loop and copies a register per vpermt2b (it overwrites its table operand); true (variant 1): a compiler memory
// barrier per column pair makes it load the tiles afresh instead (no copies).
template <int M, int TB, bool RELOAD = false, bool VPERMB = true>
static void band_int16(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const Band16 g = band16<TB>(A, band, X);
    const int tbytes = g.tbytes, r0 = g.r0, r1 = g.r1;
    const size_t row_stride = g.row_stride;
    const uint8_t* base = g.base;
    const __mmask64 m0 = g.m0, m1 = g.m1;
    constexpr int NACC = 8 * 8 * 16;  // [j][c0][16 dword lanes]
    alignas(64) float facc[M][NACC];
    alignas(64) __m512i xpat[8][M];
    std::memset(facc, 0, sizeof(facc));
    const __m512i ml = _mm512_set1_epi16(short(MUL1_MULT & 0xFFFF));
    const __m512i mh = _mm512_set1_epi16(short(MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1);
    // activation word of lane L: q-order position 4 (L / 8) + L % 4 of the tile row
    alignas(64) static const uint16_t xidx_tab[32] = {0,  1,  2,  3,  0,  1,  2,  3,  4,  5,  6,  7,  4,  5,  6,  7,
                                                      8,  9,  10, 11, 8,  9,  10, 11, 12, 13, 14, 15, 12, 13, 14, 15};
    const __m512i xidx = _mm512_load_si512(xidx_tab);
    g.start();
    for (int blk = r0 / 8; blk < r1 / 8; ++blk) {
        const uint8_t* brow = base + size_t(8 * blk) * row_stride;
        for (int rr = 0; rr < 8; ++rr) {
            for (int t = 0; t < M; ++t) {
                const int16_t* xr = X.xq + t * X.xq_stride + 16 * (8 * blk + rr);
                xpat[rr][t] = _mm512_permutexvar_epi16(
                    xidx, _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))));
            }
        }
        __m512 sc[M];
        for (int t = 0; t < M; ++t) sc[t] = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
        for (int j = 0; j < 8; ++j) {
            g.at(blk, j);
            for (int c0 = 0; c0 < 8; ++c0) {
                if constexpr (RELOAD) __asm__ volatile("" ::: "memory");
                const __m512i perm = _mm512_load_si512(tb.perm16[c0]);
                const __m512i msh = _mm512_load_si512(tb.mshift16[c0]);
                const int vb = VPERMB && TB != 0 ? tb.vperm1_base[c0] : -1;
                const __m512i perm1 = _mm512_load_si512(tb.perm1[c0]);
                __m512i acc[M];
                for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                    __m512i st;
                    if (vb >= 0) {  // [tile + vb, tile + vb + 64) lies inside the tile (vperm1_base)
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutexvar_epi8(perm1, _mm512_loadu_si512(tile + vb)));
                    } else {
                        __m512i z0, z1;
                        load_tile2<TB>(tile, tbytes, m0, m1, z0, z1);
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutex2var_epi8(z0, perm, z1));
                    }
                    const __m512i plo = _mm512_mullo_epi16(st, ml);
                    const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                    const __m512i bs = _mm512_add_epi16(_mm512_maddubs_epi16(plo, ones8), _mm512_maddubs_epi16(phi, ones8));
                    for (int t = 0; t < M; ++t) acc[t] = _mm512_dpwssd_epi32(acc[t], bs, xpat[rr][t]);
                }
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 8 + c0) * 16;
                    _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), sc[t], _mm512_load_ps(f)));
                }
            }
        }
    }
    for (int t = 0; t < M; ++t) {
        // dword lane D of (j, c0): D % 4 in {0, 1} -> column c0, {2, 3} -> column c0 + 8
        for (int j = 0; j < 8; ++j)
            for (int c0 = 0; c0 < 8; ++c0) {
                const float* v = facc[t] + (j * 8 + c0) * 16;
                float lo = 0.0f, hi = 0.0f;
                for (int q = 0; q < 4; ++q) {
                    lo += v[4 * q] + v[4 * q + 1];
                    hi += v[4 * q + 2] + v[4 * q + 3];
                }
                y[t * 128 + 16 * j + c0] = lo;
                y[t * 128 + 16 * j + c0 + 8] = hi;
            }
        int_affine(y + 128 * t, X, t);
    }
}

#if defined(CT_HAVE_AMX)
// MUL1 integer path with AMX-INT8 (K <= 4). The vector units only decode: per tile (256 weights) four vpermt2b
// (one per two registers, TrellisTables::amx_perm) + eight vpmultishiftqb extract the states of 8 row pairs x 16
// columns, three 16-bit multiplies form lo16 / hi16 of s * 0x83DCD12D (plo, phi), and 16 stores stage them as one
// 16 x 64-byte B tile: row p (0..7) = plo of q-order rows (2p, 2p + 1), row 8 + p = their phi, dword n' = the two
// rows of column n'/2 + 8 (n' & 1). The tile unit does the byte sums and the activation products in one TDPBSUD:
// A row 2t (token t) = the high bytes ah of the int16 activations, row 2t + 1 = the low bytes al
// (x = 256 ah + al, al in [-128, 127]; prep_block_int keeps |x| <= 32639 so ah fits int8 too), each byte twice
// (the two rows of a dword), the 32-byte pattern twice (plo rows, phi rows). So C[2t][n'] = sum ah * bs and
// C[2t + 1][n'] = sum al * bs, exact int32 per 128-row block, as in band_int16; the block's scale is applied at
// the flush.
// Software pipeline over columns s = (block, tile column j), 8 tiles each: decode column s + 1 into one staging
// buffer, then the tile work of column s from the other, then the flush of column s - 1. A tile load never reads
// stores younger than a whole decode phase (tile loads do not take store forwarding: a load right after its
// stores waits for them to reach L1; the first form of this kernel did that per tile and ran at 0.31 cycles per
// weight). Tiles: tmm0 = C (one accumulator: one TILESTORED per column), tmm2/3 = A, tmm4..7 = B.
// Measured on Emerald Rapids (README, results/h200host_run7_*): the tile unit runs its work in order (~27 cycles
// per 256 weights at m = 1: TILELOADD 1 KiB ~9, TDPBSUD ~10) and it does not overlap the vector decode (~29), so
// this kernel is not faster than band_int16 at m = 1; at m = 8 (same tile cost, no per-token vector work) it is.
#define CT_AMX_STEP(RR, CT, AT, BT)                      \
    do {                                                 \
        CT_TILE_LOADD(BT, stg[RR][0], 64);               \
        CT_TILE_LOADD(AT, ab[RR][0], 64);                \
        CT_TILE_DPBSUD(CT, AT, BT);                      \
    } while (0)

template <int M, int TB>
static void band_amx(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const Band16 g = band16<TB>(A, band, X);
    const int tbytes = g.tbytes, r0 = g.r0, r1 = g.r1;
    const size_t row_stride = g.row_stride;
    const uint8_t* base = g.base;
    const __mmask64 m0 = g.m0, m1 = g.m1;
    alignas(64) int8_t abuf[2][8][2 * M][64];      // activations, by block parity
    alignas(64) uint8_t stage[2][8][16][64];       // B tiles of a column's 8 tiles, by column parity
    alignas(64) int32_t cbuf[2][2 * M][16];        // the C tile stored for the flush, by column parity
    alignas(64) float facc[M][8][16];
    std::memset(facc, 0, sizeof(facc));
    const __m512i ml = _mm512_set1_epi16(short(MUL1_MULT & 0xFFFF));
    const __m512i mh = _mm512_set1_epi16(short(MUL1_MULT >> 16));
    __m512i perm[4], msh[8];
    for (int i = 0; i < 4; ++i) perm[i] = _mm512_load_si512(tb.amx_perm[i]);
    for (int i = 0; i < 8; ++i) msh[i] = _mm512_load_si512(tb.amx_mshift[i]);
    const int blk_first = r0 / 8, S = 8 * (r1 / 8 - blk_first);  // columns of this call

    auto build_acts = [&](int blk) {
        const __m256i c128 = _mm256_set1_epi16(128), lo8 = _mm256_set1_epi16(0xFF), dup = _mm256_set1_epi16(0x0101);
        for (int rr = 0; rr < 8; ++rr)
            for (int t = 0; t < M; ++t) {
                const __m256i x = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(X.xq + t * X.xq_stride + 16 * (8 * blk + rr)));
                const __m256i ah = _mm256_srai_epi16(_mm256_add_epi16(x, c128), 8);
                const __m256i al = _mm256_sub_epi16(x, _mm256_slli_epi16(ah, 8));
                const __m256i dh = _mm256_mullo_epi16(_mm256_and_si256(ah, lo8), dup);  // word = its low byte twice
                const __m256i dl = _mm256_mullo_epi16(_mm256_and_si256(al, lo8), dup);
                int8_t* a = abuf[blk & 1][rr][2 * t];
                _mm256_store_si256(reinterpret_cast<__m256i*>(a), dh);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32), dh);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 64), dl);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 96), dl);
            }
    };
    auto decode_column = [&](int s) {
        const int blk = blk_first + s / 8, j = s % 8;
        const uint8_t* brow = base + size_t(8 * blk) * row_stride;
        g.at(blk, j);
#pragma GCC unroll 2
        for (int rr = 0; rr < 8; ++rr) {
            __m512i z0, z1;
            load_tile2<TB>(brow + rr * row_stride + j * tbytes, tbytes, m0, m1, z0, z1);
            uint8_t* bt = stage[s & 1][rr][0];
#pragma GCC unroll 4
            for (int qp = 0; qp < 4; ++qp) {
                const __m512i s2 = _mm512_permutex2var_epi8(z0, perm[qp], z1);
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    const __m512i st = _mm512_multishift_epi64_epi8(msh[2 * qp + h], s2);
                    const __m512i plo = _mm512_mullo_epi16(st, ml);
                    const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                    _mm512_store_si512(bt + 64 * (2 * qp + h), plo);
                    _mm512_store_si512(bt + 64 * (8 + 2 * qp + h), phi);
                }
            }
        }
    };
    auto tile_column = [&](int s) {
        const int blk = blk_first + s / 8;
        const uint8_t(*stg)[16][64] = stage[s & 1];
        const int8_t(*ab)[2 * M][64] = abuf[blk & 1];
        CT_TILE_ZERO(0);
        CT_AMX_STEP(0, 0, 2, 4);
        CT_AMX_STEP(1, 0, 3, 5);
        CT_AMX_STEP(2, 0, 2, 6);
        CT_AMX_STEP(3, 0, 3, 7);
        CT_AMX_STEP(4, 0, 2, 4);
        CT_AMX_STEP(5, 0, 3, 5);
        CT_AMX_STEP(6, 0, 2, 6);
        CT_AMX_STEP(7, 0, 3, 7);
        CT_TILE_STORED(0, cbuf[s & 1], 64);
    };
    auto flush_column = [&](int s) {
        const int blk = blk_first + s / 8, j = s % 8;
        const __m512 s256 = _mm512_set1_ps(256.0f);
        const int32_t(*cb)[16] = cbuf[s & 1];
        for (int t = 0; t < M; ++t) {
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[2 * t])), s256,
                                             _mm512_cvtepi32_ps(_mm512_load_si512(cb[2 * t + 1])));
            const __m512 sc = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
            _mm512_store_ps(facc[t][j], _mm512_fmadd_ps(v, sc, _mm512_load_ps(facc[t][j])));
        }
    };

    if (S > 0) {
        TileConfig cfg;
        for (int t = 0; t < 4; ++t) {
            cfg.rows[t] = uint8_t(2 * M);
            cfg.colsb[t] = 64;
        }
        for (int t = 4; t < 8; ++t) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        CT_TILE_LOADCONFIG(&cfg);
        g.start();
        build_acts(blk_first);
        decode_column(0);
        for (int s = 0; s < S; ++s) {
            if (s + 1 < S) {
                if ((s + 1) % 8 == 0) build_acts(blk_first + (s + 1) / 8);
                decode_column(s + 1);
            }
            if (s >= 1) flush_column(s - 1);
            tile_column(s);
        }
        flush_column(S - 1);
        CT_TILE_RELEASE();
    }
    for (int t = 0; t < M; ++t) {
        for (int j = 0; j < 8; ++j)
            for (int n = 0; n < 16; ++n) y[t * 128 + 16 * j + (n >> 1) + 8 * (n & 1)] = facc[t][j][n];
        int_affine(y + 128 * t, X, t);
    }
}
#undef CT_AMX_STEP
#endif

template <int BITS2, bool UNIFORM>
static void band_int1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    alignas(64) float facc[8 * 4 * 16];
    alignas(64) int32_t iacc[8 * 4 * 16];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i mult = _mm512_set1_epi32(int32_t(MUL1_MULT));
    const __m512i ones8 = _mm512_set1_epi8(1);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    auto flush = [&](int blk) {
        const __m512 sc = _mm512_set1_ps(X.xs[blk]);
        for (int i = 0; i < 8 * 4 * 16; i += 16) {
            const __m512i v = _mm512_load_si512(iacc + i);
            _mm512_store_ps(facc + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, _mm512_load_ps(facc + i)));
            _mm512_store_si512(iacc + i, _mm512_setzero_si512());
        }
    };
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start_rows();
    for (int r = r0; r < r1; ++r) {
        if (r > r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = base + r * row_stride;
        pf.row(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        __m512i xp[4];
        for (int q = 0; q < 4; ++q) {
            int64_t v;
            std::memcpy(&v, X.xq + 16 * r + 4 * q, 8);
            const __m512i b = _mm512_set1_epi64(v);
            xp[q] = _mm512_unpacklo_epi16(b, b);
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            int32_t* ia = iacc + j * 64;
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512i acc;
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m512i L2 = slot_window2<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    __m512i v = slot_states16<UNIFORM, 4 * a + q>(L2, tb, sh, mask16);
                    v = _mm512_maddubs_epi16(_mm512_mullo_epi32(v, mult), ones8);
                    acc = q == 0 ? _mm512_madd_epi16(v, xp[q]) : _mm512_dpwssd_epi32(acc, v, xp[q]);
                });
                _mm512_store_si512(ia + a * 16, _mm512_add_epi32(_mm512_load_si512(ia + a * 16), acc));
            });
        }
    }
    flush((r1 - 1) / 8);
    reduce_tile_acc(facc, y);
    const float s = MUL1_K_AFF * X.xsum[0];
    if (!X.raw)
        for (int c = 0; c < 128; ++c) y[c] = y[c] * MUL1_K_INV + s;
}

template <int M, int BITS2, bool UNIFORM>
static void band_intm(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    constexpr int NACC = 8 * 4 * 16;  // [j][a][16 lanes = 2 halves x 8]
    alignas(64) float facc[M][NACC];
    alignas(64) int32_t iacc[M][NACC];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    alignas(64) __m512i xpp[M][2];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i mult = _mm512_set1_epi32(int32_t(MUL1_MULT));
    const __m512i ones8 = _mm512_set1_epi8(1);
    const __m512i ones16 = _mm512_set1_epi16(1);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    auto flush = [&](int blk) {
        for (int t = 0; t < M; ++t) {
            const __m512 sc = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
            for (int i = 0; i < NACC; i += 16) {
                const __m512i v = _mm512_load_si512(iacc[t] + i);
                _mm512_store_ps(facc[t] + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, _mm512_load_ps(facc[t] + i)));
                _mm512_store_si512(iacc[t] + i, _mm512_setzero_si512());
            }
        }
    };
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start_rows();
    for (int r = r0; r < r1; ++r) {
        if (r > r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = base + r * row_stride;
        pf.row(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        for (int t = 0; t < M; ++t)
            for (int pq = 0; pq < 2; ++pq) {
                int64_t v0, v1;
                std::memcpy(&v0, X.xq + t * X.xq_stride + 16 * r + 8 * pq, 8);
                std::memcpy(&v1, X.xq + t * X.xq_stride + 16 * r + 8 * pq + 4, 8);
                xpp[t][pq] = _mm512_unpacklo_epi16(_mm512_set1_epi64(v0), _mm512_set1_epi64(v1));
            }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512i acc[M];
                static_for<2>([&](auto PP) CT_LAMBDA_INLINE {
                    constexpr int pq = decltype(PP)::value;
                    constexpr int s0 = 4 * a + 2 * pq, s1 = s0 + 1;
                    __m512i b0 = slot_states16<UNIFORM, s0>(slot_window2<BITS2, s0>(tile, e, wrapv, tb), tb, sh, mask16);
                    __m512i b1 = slot_states16<UNIFORM, s1>(slot_window2<BITS2, s1>(tile, e, wrapv, tb), tb, sh, mask16);
                    b0 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_mullo_epi32(b0, mult), ones8), ones16);
                    b1 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_mullo_epi32(b1, mult), ones8), ones16);
                    const __m512i w = _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16));
                    for (int t = 0; t < M; ++t)
                        acc[t] = pq == 0 ? _mm512_madd_epi16(w, xpp[t][0]) : _mm512_dpwssd_epi32(acc[t], w, xpp[t][1]);
                });
                for (int t = 0; t < M; ++t) {
                    int32_t* pi = iacc[t] + (j * 4 + a) * 16;
                    _mm512_store_si512(pi, _mm512_add_epi32(_mm512_load_si512(pi), acc[t]));
                }
            });
        }
    }
    flush((r1 - 1) / 8);
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        int_affine(y + 128 * t, X, t);
    }
}

template <int CB, int M, bool ROUND, int BITS2, bool UNIFORM>
static void band_float(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const int tiles_k = A.k / 16, tiles_n = A.n / 16;
    const int r0 = 8 * X.blk0, r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;  // tile rows of this call
    const size_t row_stride = size_t(tiles_n) * tbytes;
    const uint8_t* base = A.trellis + size_t(band) * 8 * tbytes;
    alignas(64) float facc[M][8 * 4 * 16];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    alignas(64) __m512 xp[M][4];
    std::memset(facc, 0, sizeof(facc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    const BandPrefetch pf(A, band, X, tbytes);
    pf.start_rows();
    for (int r = r0; r < r1; ++r) {
        const uint8_t* row = base + r * row_stride;
        pf.row(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        for (int t = 0; t < M; ++t)
            for (int q = 0; q < 4; ++q)
                xp[t][q] = _mm512_broadcast_f32x4(_mm_loadu_ps(X.xf + t * X.xf_stride + 16 * r + 4 * q));
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512 acc[M];
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m512i L2 = slot_window2<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    const __m512 v = decode_values16<CB, ROUND>(slot_states16<UNIFORM, 4 * a + q>(L2, tb, sh, mask16));
                    for (int t = 0; t < M; ++t)
                        acc[t] = q == 0 ? _mm512_mul_ps(v, xp[t][0]) : _mm512_fmadd_ps(v, xp[t][q], acc[t]);
                });
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 4 + a) * 16;
                    _mm512_store_ps(f, _mm512_add_ps(_mm512_load_ps(f), acc[t]));
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) reduce_tile_acc(facc[t], y + 128 * t);
    if constexpr (CB == CB_MUL1 && !ROUND)
        for (int t = 0; t < M; ++t) {
            int_affine(y + 128 * t, X, t);
        }
}
#endif

#else
#error "define one of CPU_TIER_ISA_SCALAR, CPU_TIER_ISA_AVX2, CPU_TIER_ISA_AVX512"
#endif

#if !defined(CPU_TIER_ISA_SCALAR)
// ---------------------------------------------------------------------------------- template dispatch
// The instantiations are spread over several translation units (gemv_*.cpp, each including this header with one
// CT_DEFINE_* macro) so a build runs them in parallel.
// K = 3 (DeepSeek-V4.1's) is compiled with compile-time window offsets; every other K runs the generic
// (table-driven) kernels, except the AVX2 one-token integer path, which also specialises K = 2 and 4.
void gemv_int(const MatRef& A, int band, const Acts& X, float* y);
void gemv_float_mul1(const MatRef& A, int band, const Acts& X, bool round, float* y);
void gemv_float_mcg(const MatRef& A, int band, const Acts& X, bool round, float* y);
void gemv_float_3inst(const MatRef& A, int band, const Acts& X, bool round, float* y);

template <int M, int CB, bool ROUND>
static void float_dispatch_k(const MatRef& A, int band, const Acts& X, float* y) {
    if (A.bits2 == 6) return band_float<CB, M, ROUND, 6, true>(A, band, X, y);
    if constexpr (CB == CB_MUL1)
        if (!A.tb->uniform_shift) return band_float<CB, M, ROUND, 0, false>(A, band, X, y);
    band_float<CB, M, ROUND, 0, true>(A, band, X, y);
}

// MUL1's float path always rounds: its "fast" precision runs the integer path.
template <int CB>
static void float_dispatch_cb(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    constexpr bool R0 = CB == CB_MUL1;  // the variant used when round == false
    switch (X.m) {
        case 1: return round ? float_dispatch_k<1, CB, true>(A, band, X, y) : float_dispatch_k<1, CB, R0>(A, band, X, y);
        case 2: return round ? float_dispatch_k<2, CB, true>(A, band, X, y) : float_dispatch_k<2, CB, R0>(A, band, X, y);
        case 4: return round ? float_dispatch_k<4, CB, true>(A, band, X, y) : float_dispatch_k<4, CB, R0>(A, band, X, y);
        default: return round ? float_dispatch_k<8, CB, true>(A, band, X, y) : float_dispatch_k<8, CB, R0>(A, band, X, y);
    }
}

#if defined(CT_DEFINE_GEMV_FLOAT_MUL1)
void gemv_float_mul1(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    float_dispatch_cb<CB_MUL1>(A, band, X, round, y);
}
#endif
#if defined(CT_DEFINE_GEMV_FLOAT_MCG)
void gemv_float_mcg(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    float_dispatch_cb<CB_MCG>(A, band, X, round, y);
}
#endif
#if defined(CT_DEFINE_GEMV_FLOAT_3INST)
void gemv_float_3inst(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    float_dispatch_cb<CB_3INST>(A, band, X, round, y);
}
#endif

#if defined(CT_DEFINE_GEMV_INT)
#if defined(CPU_TIER_ISA_AVX512)
// f(std::integral_constant<int, m>{}) for a runtime token count m in 1..MAXM (nothing otherwise).
template <class F>
CT_INLINE void with_tokens(int m, F&& f) {
    static_for<MAXM>([&](auto I) CT_LAMBDA_INLINE {
        if (m == decltype(I)::value + 1) f(std::integral_constant<int, decltype(I)::value + 1>{});
    });
}

template <int TB>
static void int16_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
#if defined(CT_HAVE_AMX)
    if (X.amx && A.tb->has_amx)
        return with_tokens(X.m, [&](auto MM) { band_amx<decltype(MM)::value, TB>(A, band, X, y); });
#endif
    with_tokens(X.m, [&](auto MM) {
        constexpr int M = decltype(MM)::value;
        if constexpr (M <= 2) {  // the benchmark's A/B forms (Acts::variant) at 1 and 2 tokens
            if (X.variant == 1) return band_int16<M, TB, true, false>(A, band, X, y);
            if (X.variant == 2) return band_int16<M, TB, false, false>(A, band, X, y);
        }
        band_int16<M, TB>(A, band, X, y);
    });
}
#endif
#if !defined(CPU_TIER_ISA_AVX512)
template <int M>
static void intm_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
    if (A.bits2 == 6) return band_intm<M, 6, true>(A, band, X, y);
    if (A.tb->uniform_shift) return band_intm<M, 0, true>(A, band, X, y);
    band_intm<M, 0, false>(A, band, X, y);
}
#endif
void gemv_int(const MatRef& A, int band, const Acts& X, float* y) {
#if defined(CPU_TIER_ISA_AVX512)
        // K <= 4 (every half-integer K too): the 16-bit path; K = 5..8 (integer, uniform shifts): 32-bit lanes.
        if (A.tb->has16) {
            if (A.tb->tile_bytes == 96) return int16_dispatch<96>(A, band, X, y);
            if (A.tb->tile_bytes == 64) return int16_dispatch<64>(A, band, X, y);
            if (A.tb->tile_bytes == 128) return int16_dispatch<128>(A, band, X, y);
            return int16_dispatch<0>(A, band, X, y);
        }
        switch (X.m) {
            case 1: return band_int1<0, true>(A, band, X, y);
            case 2: return band_intm<2, 0, true>(A, band, X, y);
            case 3: return band_intm<3, 0, true>(A, band, X, y);
            case 4: return band_intm<4, 0, true>(A, band, X, y);
            case 5: return band_intm<5, 0, true>(A, band, X, y);
            case 6: return band_intm<6, 0, true>(A, band, X, y);
            case 7: return band_intm<7, 0, true>(A, band, X, y);
            case 8: return band_intm<8, 0, true>(A, band, X, y);
            default: return;
        }
#else
        if (X.m == 1) {
            switch (A.bits2) {
                case 4: return band_int1<4, true>(A, band, X, y);
                case 6: return band_int1<6, true>(A, band, X, y);
                case 8: return band_int1<8, true>(A, band, X, y);
                default:
                    if (A.tb->uniform_shift) return band_int1<0, true>(A, band, X, y);
                    return band_int1<0, false>(A, band, X, y);
            }
        }
        switch (X.m) {
            case 2: return intm_dispatch<2>(A, band, X, y);
            case 3: return intm_dispatch<3>(A, band, X, y);
            case 4: return intm_dispatch<4>(A, band, X, y);
            case 5: return intm_dispatch<5>(A, band, X, y);
            case 6: return intm_dispatch<6>(A, band, X, y);
            case 7: return intm_dispatch<7>(A, band, X, y);
            case 8: return intm_dispatch<8>(A, band, X, y);
            default: return;
        }
#endif
}
#endif

// y: [m][128] (row stride 128), the band's outputs in the Hadamard basis, before the output transform.
inline void gemv_band(const MatRef& A, int band, const Acts& X, GemvMode mode, float* y) {
    if (mode == GemvMode::Int) return gemv_int(A, band, X, y);  // MUL1
    // Float path: M in {1, 2, 4, 8} are compiled; other token counts run as a sum of those (3 = 2 + 1, ...).
    const bool round = mode == GemvMode::Exact;
    int done = 0;
    while (done < X.m) {
        const int left = X.m - done;
        const int mm = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        Acts S = X;
        S.m = mm;
        S.xf = X.xf + size_t(done) * X.xf_stride;
        float* ys = y + size_t(done) * 128;
        switch (A.codebook) {
            case CB_MUL1: gemv_float_mul1(A, band, S, round, ys); break;
            case CB_MCG: gemv_float_mcg(A, band, S, round, ys); break;
            default: gemv_float_3inst(A, band, S, round, ys); break;
        }
        done += mm;
    }
}
#endif

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
