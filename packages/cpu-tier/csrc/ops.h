// Per-token vector work around the GEMV: input transform (x * suh, Hadamard-128), activation preparation
// (q order, int16 quantisation), output transform (Hadamard-128, * svh, + bias) and the clamped SwiGLU.
#pragma once

#include <algorithm>
#include <cmath>

#include "common.h"
#include "kernel.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// fp16 -> fp32 for n values (n a multiple of 8 for the SIMD variants).
CT_INLINE void halves_to_floats(const uint16_t* h, float* f, int n) {
#if defined(CPU_TIER_ISA_SCALAR)
    for (int i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
#else
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) f[i] = half_to_float(h[i]);
#endif
}

// In-place orthonormal Sylvester Hadamard transform of 128 values (butterflies of width 1..64, then * 1/sqrt(128)).
CT_INLINE void fwht128(float* v) {
#if defined(CPU_TIER_ISA_SCALAR)
    for (int h = 1; h < 128; h <<= 1)
        for (int i = 0; i < 128; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
    for (int i = 0; i < 128; ++i) v[i] *= HAD_SCALE;
#else
    __m256 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 neg1 = _mm256_castsi256_ps(_mm256_set_epi32(int(0x80000000), 0, int(0x80000000), 0,
                                                             int(0x80000000), 0, int(0x80000000), 0));
    const __m256 neg2 = _mm256_castsi256_ps(_mm256_set_epi32(int(0x80000000), int(0x80000000), 0, 0,
                                                             int(0x80000000), int(0x80000000), 0, 0));
    const __m256 neg4 = _mm256_castsi256_ps(_mm256_set_epi32(int(0x80000000), int(0x80000000), int(0x80000000),
                                                             int(0x80000000), 0, 0, 0, 0));
    for (int i = 0; i < 16; ++i) {
        __m256 x = r[i];
        // width 1: (a, b) -> (a + b, a - b)
        x = _mm256_add_ps(_mm256_permute_ps(x, 0xB1), _mm256_xor_ps(x, neg1));
        // width 2
        x = _mm256_add_ps(_mm256_permute_ps(x, 0x4E), _mm256_xor_ps(x, neg2));
        // width 4
        x = _mm256_add_ps(_mm256_permute2f128_ps(x, x, 0x01), _mm256_xor_ps(x, neg4));
        r[i] = x;
    }
    for (int h = 1; h < 16; h <<= 1)
        for (int i = 0; i < 16; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const __m256 a = r[j], b = r[j + h];
                r[j] = _mm256_add_ps(a, b);
                r[j + h] = _mm256_sub_ps(a, b);
            }
    const __m256 s = _mm256_set1_ps(HAD_SCALE);
    for (int i = 0; i < 16; ++i) _mm256_storeu_ps(v + 8 * i, _mm256_mul_ps(r[i], s));
#endif
}

// x (128 values) * suh -> Hadamard -> the q-order float activations of 8 tile rows. Returns their sum.
CT_INLINE float prep_block_float(const float* x, const uint16_t* suh, float* xf) {
    alignas(32) float v[128], s[128];
    halves_to_floats(suh, s, 128);
    for (int i = 0; i < 128; ++i) v[i] = x[i] * s[i];
    fwht128(v);
    float total = 0.0f;
    for (int r = 0; r < 8; ++r)
        for (int p = 0; p < 16; ++p) {
            const float val = v[16 * r + qorder_row(p)];
            xf[16 * r + p] = val;
            total += val;
        }
    return total;
}

// Same, quantised to int16 with one scale per block, amax / XQ_MAX. Returns the sum of the quantised values x^.
// XQ_MAX = 32639 = 127 * 256 + 127 rather than 32767, so the AMX kernel's split x = 256 ah + al (ah = (x + 128) >> 8,
// al in [-128, 127]) keeps ah in int8; the steps are 0.4% coarser than with 32767.
CT_INLINE float prep_block_int(const float* x, const uint16_t* suh, int16_t* xq, float* xs) {
    alignas(32) float v[128], s[128];
    halves_to_floats(suh, s, 128);
    for (int i = 0; i < 128; ++i) v[i] = x[i] * s[i];
    fwht128(v);
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax / float(XQ_MAX);
    const float inv = amax > 0.0f ? float(XQ_MAX) / amax : 0.0f;
    int32_t isum = 0;
    for (int r = 0; r < 8; ++r)
        for (int p = 0; p < 16; ++p) {
            float q = std::nearbyint(v[16 * r + qorder_row(p)] * inv);
            q = std::min(float(XQ_MAX), std::max(-float(XQ_MAX), q));
            xq[16 * r + p] = int16_t(q);
            isum += int32_t(q);
        }
    *xs = scale;
    return float(isum) * scale;
}

// y (128 Hadamard-basis outputs) -> Hadamard -> * svh (+ bias), in place.
CT_INLINE void out_block(float* y, const uint16_t* svh, const uint16_t* bias) {
    alignas(32) float s[128];
    fwht128(y);
    halves_to_floats(svh, s, 128);
    for (int i = 0; i < 128; ++i) y[i] *= s[i];
    if (bias) {
        halves_to_floats(bias, s, 128);
        for (int i = 0; i < 128; ++i) y[i] += s[i];
    }
}

// DeepSeek-V4 clamped SwiGLU: silu(min(g, limit)) * clamp(u, -limit, limit); limit = inf means no clamp.
CT_INLINE void swiglu(const float* g, const float* u, float* a, int n, float limit) {
    for (int i = 0; i < n; ++i) {
        const float gc = std::min(g[i], limit);
        const float uc = std::min(std::max(u[i], -limit), limit);
        a[i] = gc / (1.0f + std::exp(-gc)) * uc;
    }
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
