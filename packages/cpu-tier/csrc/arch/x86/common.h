// What the two x86 SIMD families (arch/avx2, arch/avx512) share: the tile windows of the state extraction, the
// generic-K tile copy, the accumulator reduction, and the entry points each family defines.
#pragma once

#include <immintrin.h>

#include "../../kernel.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// The tile's wrapped 16-byte window [last 4 bytes, first 12 bytes].
CT_INLINE __m128i wrap_window(const uint8_t* tile, int tile_bytes) {
    return _mm_alignr_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + tile_bytes - 16)), 12);
}

// The exact MUL1 kernels' arithmetic (both families' band_exact_mul1; the derivation is at AVX2's): a value's fp16
// rounding by Veltkamp's split, c = RN(f * 8193), round11(f) = c - (c - f), on N = f * 2^18 = 1774 bs - 905216,
// which the byte sums' multiply-add gives as M = 1774 bs = N + MUL1_N_OFF (exact in fp32).
constexpr float VELTKAMP_HALF = 8193.0f;  // 2^(24 - 11) + 1
constexpr float MUL1_N_UNIT = 262144.0f;  // 2^18: N = f * 2^18
constexpr int MUL1_N_MULT = int(MUL1_K_INV * MUL1_N_UNIT);
constexpr int MUL1_N_OFF = int(-MUL1_K_AFF * MUL1_N_UNIT);
static_assert(float(MUL1_N_MULT) == MUL1_K_INV * MUL1_N_UNIT && float(MUL1_N_OFF) == -MUL1_K_AFF * MUL1_N_UNIT,
              "MUL1's affine map is not an integer one at 2^18");
static_assert(double(VELTKAMP_HALF * float(MUL1_N_OFF)) == double(VELTKAMP_HALF) * MUL1_N_OFF,
              "the split's addend -8193 * MUL1_N_OFF is not exact in fp32");

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

// The entry points of one family, defined by its sources (one per translation unit, so a build compiles the
// instantiations in parallel) and collected in its kernel_table().
void gemv_int(const MatRef& A, int band, const Acts& X, float* y);
void gemv_float_mul1(const MatRef& A, int band, const Acts& X, bool round, float* y);
void gemv_float_mcg(const MatRef& A, int band, const Acts& X, bool round, float* y);
void gemv_float_3inst(const MatRef& A, int band, const Acts& X, bool round, float* y);

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
