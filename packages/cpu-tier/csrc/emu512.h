// A scalar emulation of the AVX-512 intrinsics the kernels use, so the avx512 variant's kernel code can run (and
// be tested) on hosts without AVX-512. Included by arch/avx512/kernels.h only when CT_EMU512 is defined (the test-only
// module _native_avx512emu); the real avx512 variant uses the hardware instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace cpu_tier {
namespace emu {

// Out of line: keeps the emulated module quick to compile (its speed does not matter, only its results).
#define CT_EMU_FN inline __attribute__((noinline))

union alignas(64) V512 {
    int8_t i8[64];
    uint8_t u8[64];
    int16_t i16[32];
    uint16_t u16[32];
    int32_t i32[16];
    uint32_t u32[16];
    int64_t i64[8];
    uint64_t u64[8];
    float f32[16];
};
struct alignas(64) F512 {
    float f[16];
};
using mmask64 = uint64_t;

CT_EMU_FN V512 zero() {
    V512 r;
    std::memset(&r, 0, sizeof(r));
    return r;
}
CT_EMU_FN int16_t sat16(int32_t v) { return int16_t(v > 32767 ? 32767 : (v < -32768 ? -32768 : v)); }

CT_EMU_FN V512 load_si512(const void* p) {
    V512 r;
    std::memcpy(&r, p, 64);
    return r;
}
CT_EMU_FN void store_si512(void* p, V512 a) { std::memcpy(p, &a, 64); }
// the upper 256 bits are undefined on hardware; zero here
CT_EMU_FN V512 castsi256_si512(__m256i a) {
    V512 r = zero();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.u8), a);
    return r;
}
CT_EMU_FN V512 maskz_loadu_epi8(mmask64 k, const void* p) {
    V512 r = zero();
    const uint8_t* s = static_cast<const uint8_t*>(p);
    for (int i = 0; i < 64; ++i)
        if ((k >> i) & 1) r.u8[i] = s[i];  // masked-off bytes are not read (no fault), as on hardware
    return r;
}
CT_EMU_FN F512 load_ps(const float* p) {
    F512 r;
    std::memcpy(r.f, p, 64);
    return r;
}
CT_EMU_FN void store_ps(float* p, F512 a) { std::memcpy(p, a.f, 64); }

CT_EMU_FN V512 set1_epi8(char v) {
    V512 r;
    for (int i = 0; i < 64; ++i) r.i8[i] = int8_t(v);
    return r;
}
CT_EMU_FN V512 set1_epi16(short v) {
    V512 r;
    for (int i = 0; i < 32; ++i) r.i16[i] = v;
    return r;
}
CT_EMU_FN V512 set1_epi32(int v) {
    V512 r;
    for (int i = 0; i < 16; ++i) r.i32[i] = v;
    return r;
}
CT_EMU_FN V512 set1_epi64(long long v) {
    V512 r;
    for (int i = 0; i < 8; ++i) r.i64[i] = v;
    return r;
}
CT_EMU_FN F512 set1_ps(float v) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = v;
    return r;
}
CT_EMU_FN V512 setzero_si512() { return zero(); }
CT_EMU_FN F512 setzero_ps() { return set1_ps(0.0f); }

CT_EMU_FN V512 broadcast_i64x4(__m256i a) {
    V512 r;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.u8), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.u8 + 32), a);
    return r;
}
CT_EMU_FN F512 broadcast_f32x4(__m128 a) {
    F512 r;
    for (int k = 0; k < 4; ++k) _mm_storeu_ps(r.f + 4 * k, a);
    return r;
}

#define CT_EMU_BIN32(name, expr)            \
    CT_EMU_FN V512 name(V512 a, V512 b) {   \
        V512 r;                             \
        for (int i = 0; i < 16; ++i) expr;  \
        return r;                           \
    }
CT_EMU_BIN32(add_epi32, r.u32[i] = a.u32[i] + b.u32[i])
CT_EMU_BIN32(mullo_epi32, r.u32[i] = a.u32[i] * b.u32[i])
CT_EMU_BIN32(and_si512, r.u32[i] = a.u32[i] & b.u32[i])
CT_EMU_BIN32(or_si512, r.u32[i] = a.u32[i] | b.u32[i])
CT_EMU_BIN32(srlv_epi32, r.u32[i] = b.u32[i] > 31 ? 0u : a.u32[i] >> b.u32[i])
#undef CT_EMU_BIN32

CT_EMU_FN V512 add_epi16(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 32; ++i) r.u16[i] = uint16_t(a.u16[i] + b.u16[i]);
    return r;
}
CT_EMU_FN V512 mullo_epi16(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 32; ++i) r.u16[i] = uint16_t(uint32_t(a.u16[i]) * b.u16[i]);
    return r;
}
CT_EMU_FN V512 mulhi_epu16(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 32; ++i) r.u16[i] = uint16_t((uint32_t(a.u16[i]) * b.u16[i]) >> 16);
    return r;
}
CT_EMU_FN V512 slli_epi32(V512 a, unsigned n) {
    V512 r;
    for (int i = 0; i < 16; ++i) r.u32[i] = n > 31 ? 0u : a.u32[i] << n;
    return r;
}
CT_EMU_FN V512 srli_epi32(V512 a, unsigned n) {
    V512 r;
    for (int i = 0; i < 16; ++i) r.u32[i] = n > 31 ? 0u : a.u32[i] >> n;
    return r;
}
CT_EMU_FN V512 shuffle_epi8(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 64; ++i) r.u8[i] = (b.u8[i] & 0x80) ? 0 : a.u8[(i & ~15) | (b.u8[i] & 15)];
    return r;
}
// vpermt2b: idx bits 0-5 pick a byte, bit 6 picks the table (a: 0, b: 1)
CT_EMU_FN V512 permutex2var_epi8(V512 a, V512 idx, V512 b) {
    V512 r;
    for (int i = 0; i < 64; ++i) r.u8[i] = (idx.u8[i] & 64) ? b.u8[idx.u8[i] & 63] : a.u8[idx.u8[i] & 63];
    return r;
}
// vpermb: idx bits 0-5 pick a byte of a
CT_EMU_FN V512 permutexvar_epi8(V512 idx, V512 a) {
    V512 r;
    for (int i = 0; i < 64; ++i) r.u8[i] = a.u8[idx.u8[i] & 63];
    return r;
}
// vpmultishiftqb: byte j of qword q = 8 bits of b's qword q starting at bit (a.u8[8q + j] & 63), wrapping
CT_EMU_FN V512 multishift_epi64_epi8(V512 ctrl, V512 b) {
    V512 r;
    for (int q = 0; q < 8; ++q)
        for (int j = 0; j < 8; ++j) {
            const unsigned s = ctrl.u8[8 * q + j] & 63;
            const uint64_t v = b.u64[q];
            const uint64_t rot = s ? ((v >> s) | (v << (64 - s))) : v;
            r.u8[8 * q + j] = uint8_t(rot);
        }
    return r;
}
CT_EMU_FN V512 unpacklo_epi16(V512 a, V512 b) {
    V512 r;
    for (int l = 0; l < 4; ++l)
        for (int i = 0; i < 4; ++i) {
            r.i16[8 * l + 2 * i] = a.i16[8 * l + i];
            r.i16[8 * l + 2 * i + 1] = b.i16[8 * l + i];
        }
    return r;
}
CT_EMU_FN V512 permutexvar_epi16(V512 idx, V512 a) {
    V512 r;
    for (int i = 0; i < 32; ++i) r.i16[i] = a.i16[idx.u16[i] & 31];
    return r;
}
CT_EMU_FN V512 maddubs_epi16(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 32; ++i)
        r.i16[i] = sat16(int32_t(a.u8[2 * i]) * b.i8[2 * i] + int32_t(a.u8[2 * i + 1]) * b.i8[2 * i + 1]);
    return r;
}
CT_EMU_FN V512 madd_epi16(V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 16; ++i)
        r.u32[i] = uint32_t(int64_t(a.i16[2 * i]) * b.i16[2 * i] + int64_t(a.i16[2 * i + 1]) * b.i16[2 * i + 1]);
    return r;
}
CT_EMU_FN V512 dpwssd_epi32(V512 src, V512 a, V512 b) {
    V512 r;
    for (int i = 0; i < 16; ++i)
        r.u32[i] = src.u32[i] +
                   uint32_t(int64_t(a.i16[2 * i]) * b.i16[2 * i] + int64_t(a.i16[2 * i + 1]) * b.i16[2 * i + 1]);
    return r;
}
CT_EMU_FN V512 ternarylogic_epi32(V512 a, V512 b, V512 c, int imm) {
    V512 r;
    for (int i = 0; i < 16; ++i) {
        uint32_t v = 0;
        for (int bit = 0; bit < 32; ++bit) {
            const int idx = int(((a.u32[i] >> bit) & 1) << 2 | ((b.u32[i] >> bit) & 1) << 1 | ((c.u32[i] >> bit) & 1));
            v |= uint32_t((imm >> idx) & 1) << bit;
        }
        r.u32[i] = v;
    }
    return r;
}
CT_EMU_FN F512 castsi512_ps(V512 a) {
    F512 r;
    std::memcpy(r.f, &a, 64);
    return r;
}
CT_EMU_FN F512 cvtepi32_ps(V512 a) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = float(a.i32[i]);
    return r;
}
CT_EMU_FN F512 add_ps(F512 a, F512 b) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] + b.f[i];
    return r;
}
CT_EMU_FN F512 sub_ps(F512 a, F512 b) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] - b.f[i];
    return r;
}
CT_EMU_FN F512 mul_ps(F512 a, F512 b) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] * b.f[i];
    return r;
}
CT_EMU_FN F512 fmadd_ps(F512 a, F512 b, F512 c) {
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
    return r;
}
CT_EMU_FN __m256i cvtps_ph(F512 a, int) {
    alignas(32) uint16_t h[16];
    for (int i = 0; i < 16; ++i) h[i] = float_to_half(a.f[i]);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
}
CT_EMU_FN F512 cvtph_ps(__m256i a) {
    alignas(32) uint16_t h[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(h), a);
    F512 r;
    for (int i = 0; i < 16; ++i) r.f[i] = half_to_float(h[i]);
    return r;
}

}  // namespace emu
}  // namespace cpu_tier

#define __m512i ::cpu_tier::emu::V512
#define __m512 ::cpu_tier::emu::F512
#define __mmask64 ::cpu_tier::emu::mmask64
#define _mm512_load_si512 ::cpu_tier::emu::load_si512
#define _mm512_loadu_si512 ::cpu_tier::emu::load_si512
#define _mm512_castsi256_si512 ::cpu_tier::emu::castsi256_si512
#define _mm512_store_si512 ::cpu_tier::emu::store_si512
#define _mm512_maskz_loadu_epi8 ::cpu_tier::emu::maskz_loadu_epi8
#define _mm512_load_ps ::cpu_tier::emu::load_ps
#define _mm512_store_ps ::cpu_tier::emu::store_ps
#define _mm512_set1_epi8 ::cpu_tier::emu::set1_epi8
#define _mm512_set1_epi16 ::cpu_tier::emu::set1_epi16
#define _mm512_set1_epi32 ::cpu_tier::emu::set1_epi32
#define _mm512_set1_epi64 ::cpu_tier::emu::set1_epi64
#define _mm512_set1_ps ::cpu_tier::emu::set1_ps
#define _mm512_setzero_si512 ::cpu_tier::emu::setzero_si512
#define _mm512_setzero_ps ::cpu_tier::emu::setzero_ps
#define _mm512_broadcast_i64x4 ::cpu_tier::emu::broadcast_i64x4
#define _mm512_broadcast_f32x4 ::cpu_tier::emu::broadcast_f32x4
#define _mm512_add_epi32 ::cpu_tier::emu::add_epi32
#define _mm512_add_epi16 ::cpu_tier::emu::add_epi16
#define _mm512_mullo_epi32 ::cpu_tier::emu::mullo_epi32
#define _mm512_mullo_epi16 ::cpu_tier::emu::mullo_epi16
#define _mm512_mulhi_epu16 ::cpu_tier::emu::mulhi_epu16
#define _mm512_and_si512 ::cpu_tier::emu::and_si512
#define _mm512_or_si512 ::cpu_tier::emu::or_si512
#define _mm512_srlv_epi32 ::cpu_tier::emu::srlv_epi32
#define _mm512_slli_epi32 ::cpu_tier::emu::slli_epi32
#define _mm512_srli_epi32 ::cpu_tier::emu::srli_epi32
#define _mm512_shuffle_epi8 ::cpu_tier::emu::shuffle_epi8
#define _mm512_permutex2var_epi8 ::cpu_tier::emu::permutex2var_epi8
#define _mm512_permutexvar_epi8 ::cpu_tier::emu::permutexvar_epi8
#define _mm512_multishift_epi64_epi8 ::cpu_tier::emu::multishift_epi64_epi8
#define _mm512_unpacklo_epi16 ::cpu_tier::emu::unpacklo_epi16
#define _mm512_permutexvar_epi16 ::cpu_tier::emu::permutexvar_epi16
#define _mm512_maddubs_epi16 ::cpu_tier::emu::maddubs_epi16
#define _mm512_madd_epi16 ::cpu_tier::emu::madd_epi16
#define _mm512_dpwssd_epi32 ::cpu_tier::emu::dpwssd_epi32
#define _mm512_ternarylogic_epi32 ::cpu_tier::emu::ternarylogic_epi32
#define _mm512_castsi512_ps ::cpu_tier::emu::castsi512_ps
#define _mm512_cvtepi32_ps ::cpu_tier::emu::cvtepi32_ps
#define _mm512_add_ps ::cpu_tier::emu::add_ps
#define _mm512_sub_ps ::cpu_tier::emu::sub_ps
#define _mm512_mul_ps ::cpu_tier::emu::mul_ps
#define _mm512_fmadd_ps ::cpu_tier::emu::fmadd_ps
#define _mm512_cvtps_ph ::cpu_tier::emu::cvtps_ph
#define _mm512_cvtph_ps ::cpu_tier::emu::cvtph_ps
