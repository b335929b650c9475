// The EXL3 GEMV band kernels' interface, shared by every ISA variant, and the one dispatch table behind it.
//
//   y[m, c] = sum_k xh[m, k] * W_inner[k, c]      for the 128 columns c of one band (8 output tiles), all k
//
// Each ISA family has its own directory of kernels (csrc/arch/scalar, arch/avx2, arch/avx512; arch/x86 holds what
// the two SIMD families share), compiled only into its own variant module; each defines kernel_table(), the
// variant's entry points. Everything above the kernels (jobs.h, ops.h, module.cpp) calls them through gemv_band().
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
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "common.h"
#include "tables.h"

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
    int pf_blocks = 1;  // software prefetch distance in 128-row blocks (0..4, 0 = none; BandWalk)
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
// f(std::integral_constant<int, m>{}) for a runtime token count m in 1..MAXM; any other m throws (every path, the
// integer and the float ones, dispatches through here: none drops a call silently).
template <class F>
CT_INLINE void with_tokens(int m, F&& f) {
    if (m < 1 || m > MAXM) throw std::logic_error("cpu-tier kernel: tokens per call outside 1..MAXM");
    static_for<MAXM>([&](auto I) CT_LAMBDA_INLINE {
        if (m == decltype(I)::value + 1) f(std::integral_constant<int, decltype(I)::value + 1>{});
    });
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

// ------------------------------------------------------------------------------------ the band's walk
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

// Prefetch `bytes` at p into L1 (prefetcht0), a line at a time.
CT_INLINE void prefetch_row(const uint8_t* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// The band prologue of every kernel, computed once: the call's tile rows [r0, r1) (Acts::blk0/blk1), the stride
// between tile rows, the band's first tile (row 0), the tile size, and the software prefetch of the band's rows
// (one tile row of the band = 8 tiles = 8 * tbytes bytes), D = Acts::pf_blocks 128-row blocks (8 tile rows) ahead;
// D = 0: none (the hardware prefetchers alone). Block kernels: the call's first D blocks up front (start), then at
// tile column j of block blk the row 8 (blk + D) + j (at). Row kernels: 8 D - 2 rows ahead (start_rows, fetch_ahead).
// Past the call's last row, a row-range call (Acts::blk1 >= 0, split jobs) prefetches the first rows of the next
// band, which its caller computes next with the same rows.
struct BandWalk {
    const uint8_t* base;       // the band's tile in tile row 0
    const uint8_t* next_base;  // the next band's, or nullptr (not a row-range call, or the last band)
    const uint8_t *lo, *hi;    // the matrix's trellis
    size_t row_stride;         // bytes from one tile row to the next
    int tbytes, r0, r1, d;
    BandWalk(const MatRef& A, int band, const Acts& X, int tile_bytes) {
        const int tiles_k = A.k / 16, tiles_n = A.n / 16;
        tbytes = tile_bytes;
        r0 = 8 * X.blk0;
        r1 = X.blk1 < 0 ? tiles_k : 8 * X.blk1;
        row_stride = size_t(tiles_n) * tile_bytes;
        base = A.trellis + size_t(band) * 8 * tile_bytes;
        next_base = X.blk1 >= 0 && band + 1 < tiles_n / 8 ? base + 8 * tile_bytes : nullptr;
        lo = A.trellis;
        hi = A.trellis + size_t(tiles_k) * row_stride;
        d = X.pf_blocks;
    }
    // Tile row r of the band (its 8 tiles, tbytes apart), and the first of the 8 rows of 128-row block blk.
    CT_INLINE const uint8_t* row(int r) const { return base + size_t(r) * row_stride; }
    CT_INLINE const uint8_t* block(int blk) const { return base + size_t(8 * blk) * row_stride; }

    CT_INLINE void issue(const uint8_t* p) const {
        const int bytes = 8 * tbytes;
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
    CT_INLINE void fetch_ahead(int r) const { fetch(r + row_ahead()); }
};

// ------------------------------------------------------------------------------------ the dispatch table
// y: [m][128] (row stride 128), the band's outputs in the Hadamard basis, before the output transform.
using IntBandFn = void (*)(const MatRef& A, int band, const Acts& X, float* y);
using FloatBandFn = void (*)(const MatRef& A, int band, const Acts& X, bool round, float* y);
// The float path's exact codebook values of n states (n a multiple of 16), as its band kernels decode them: a test
// hook, so each variant's fp16 rounding is checked against the reference on every state.
using DecodeFn = void (*)(int codebook, const uint16_t* states, size_t n, float* out);

// One ISA variant's kernels (defined by its arch/ sources: kernel_table()).
struct KernelTable {
    const char* isa;          // "scalar", "avx2", "avx512", "avx512emu"
    bool amx;                 // has the AMX-INT8 kernel (run where Acts::amx asks)
    bool emulated;            // the test-only emulated AVX-512 build (no hardware AVX-512 or AMX instructions)
    IntBandFn int_band;       // MUL1 integer path ("fast"), any m in 1..MAXM
    FloatBandFn float_band[3];  // float path per codebook (CB_3INST, CB_MCG, CB_MUL1), m in 1..MAXM;
                                // round = exact fp16 codebook values (MUL1's float path always rounds)
    DecodeFn decode_exact;    // the float path's exact codebook values (test hook; codebook index, or DECODE_MUL1_SPLIT)
};

const KernelTable& kernel_table();

inline void gemv_band(const MatRef& A, int band, const Acts& X, GemvMode mode, float* y) {
    const KernelTable& kt = kernel_table();
    if (mode == GemvMode::Int) return kt.int_band(A, band, X, y);  // MUL1
    // Float path: every M in 1..MAXM (an Acts' capacity) is compiled, as on the integer path (until session 27,
    // 5..7 ran as 4 + 1..3, decoding every weight twice: exact at 5..7 tokens took 2.4-2.9x fast's time).
    kt.float_band[A.codebook](A, band, X, mode == GemvMode::Exact, y);
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
