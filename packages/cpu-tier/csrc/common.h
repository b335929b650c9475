// Shared definitions for every ISA variant of cpu_tier's native module.
//
// The module is compiled once per ISA (scalar / avx2 / avx512) from the same sources; CPU_TIER_NS names the
// variant's namespace so the three modules never share a C++ symbol or a nanobind type name.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef CPU_TIER_NS
#error "CPU_TIER_NS must name the ISA variant (scalar, avx2, avx512)"
#endif

#if defined(CPU_TIER_ISA_AVX512) || defined(CPU_TIER_ISA_AVX2)
#include <immintrin.h>
#endif

#define CT_INLINE inline __attribute__((always_inline))
#define CT_NOINLINE __attribute__((noinline))

namespace cpu_tier {

enum Codebook : int { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };
// decode_exact's extra index (a test hook): MUL1's exact values through the exact kernel's own arithmetic
// where a variant has one (AVX2: band_exact_mul1's offset split), else the same as CB_MUL1.
constexpr int DECODE_MUL1_SPLIT = 3;

// MUL1 GPU decode: one fp16 FMA, (1024 + bytesum) * half(0x1EEE) + half(0xC931). Its affine part is exact in fp32:
// value = bytesum * K_INV + K_AFF (before the fp16 rounding), K_AFF = 1024 * K_INV + K_BIAS.
constexpr float MUL1_K_INV = 0.00676727294921875f;
// Largest |x^| of the int16 activations (ops.h prep_block_int; the AMX kernel needs <= 127 * 256 + 127).
constexpr int XQ_MAX = 32639;
constexpr float MUL1_K_BIAS = -10.3828125f;
constexpr float MUL1_K_AFF = 1024.0f * MUL1_K_INV + MUL1_K_BIAS;  // -3.453125 exactly
constexpr uint32_t MUL1_MULT = 0x83DCD12Du;
constexpr uint32_t MCG_MULT = 0xCBAC1FEDu;
constexpr uint32_t INST3_MULT = 89226354u;
constexpr uint32_t INST3_ADD = 64248484u;
constexpr uint32_t LOP3_AND = 0x8FFF8FFFu;
constexpr uint32_t LOP3_XOR = 0x3B603B60u;
constexpr float HAD_SCALE = 0.08838834764831845f;  // 1 / sqrt(128)

// ------------------------------------------------------------------------------------------ fp16 <-> fp32
// Portable conversions (the scalar variant has no F16C); round to nearest even, subnormals and inf/nan handled.
CT_INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                man <<= 1;
                ++e;
            } while ((man & 0x400u) == 0);
            bits = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

CT_INLINE uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return uint16_t(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
    if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520: inf
    if (ax < 0x38800000u) {                                   // below the smallest normal half: subnormal/zero
        if (ax < 0x33000000u) return uint16_t(sign);          // < 2^-25 rounds to 0
        const uint32_t e = ax >> 23;
        const uint32_t man = (ax & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = 126u - e;  // 14..24 -> result = man >> (shift) with RNE
        const uint32_t half_bit = 1u << (shift - 1);
        uint32_t r = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1);
        if (rem > half_bit || (rem == half_bit && (r & 1u))) ++r;
        return uint16_t(sign | r);
    }
    uint32_t r = ((ax >> 13) - (112u << 10));
    const uint32_t rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return uint16_t(sign | r);
}

CT_INLINE float round_to_half(float f) { return half_to_float(float_to_half(f)); }

}  // namespace cpu_tier
