// The MUL1 AVX2 kernels' per-slot instruction sequences (16 weights, one token) from registers, 4 independent slots
// in flight, thread CPU time (a diagnostic, not part of the package build): the pair form (csrc/arch/avx2, the
// default), its parts, exllamav3-like planar funnels, the former 32-bit-lane form, and the exact path with three
// ways of rounding to fp16. Cycles at CPU_TIER_GHZ (default 3.98).
//   g++ -O2 -mavx2 -mfma -mf16c packages/cpu-tier/scripts/avx2_slot_probe.cpp -o /tmp/slots && /tmp/slots
#include <immintrin.h>
#include <time.h>
#include <cstdio>
#include <cstdint>
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define KEEP(v) __asm__ volatile("" : "+x"(v))
#include <cstdlib>
static const double GHZ = getenv("CPU_TIER_GHZ") ? atof(getenv("CPU_TIER_GHZ")) : 3.98;
template <class F> void run(const char* name, int per_iter_w, F f) {
  double best = 1e9; long n = 2000000;
  for (int r = 0; r < 7; ++r) { double t0 = cpu_s(); f(n); double t = cpu_s() - t0; if (t < best) best = t; }
  printf("%-40s %.3f cycles per 16 weights\n", name, best * GHZ * 1e9 / n / (per_iter_w / 16.0));
}
int main() {
  const __m256i mlo = _mm256_set1_epi16(short(0xD12D)), mhi = _mm256_set1_epi16(short(0x83DC)), one8 = _mm256_set1_epi8(1);
  const __m256i ctl = _mm256_set1_epi32(0x00010203), srl = _mm256_set1_epi32(5), sll = _mm256_set1_epi32(7), x = _mm256_set1_epi32(0x00030005);
  const __m256i mult = _mm256_set1_epi32(0x83DCD12D), mask = _mm256_set1_epi32(0xFFFF), ones16 = _mm256_set1_epi16(1);
  // pair form: 13 ops per 16 weights; 4 independent slots per iteration
  run("pair slot (13 ops)", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    for (long i = 0; i < n; ++i) {
#define SLOT(L, acc) { __m256i v = _mm256_shuffle_epi8(L, ctl); __m256i lo = _mm256_srlv_epi32(v, srl), hi = _mm256_sllv_epi32(v, sll); \
      __m256i st = _mm256_blend_epi16(lo, hi, 0xAA); __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, x)); KEEP(L); }
      SLOT(L0, a0) SLOT(L1, a1) SLOT(L2, a2) SLOT(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("pair slot, ctl + x from memory, window loads", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0;
    alignas(64) static uint8_t tilebuf[4096]; alignas(64) static __m256i ctlm[16], xm[16];
    for (int k = 0; k < 16; ++k) { ctlm[k] = ctl; xm[k] = x; }
    for (long i = 0; i < n; ++i) {
      const uint8_t* tp = tilebuf + ((i * 96) & 2047);
#define SLOTM(off, k, acc) { __m256i L = _mm256_loadu_si256((const __m256i*)(tp + off)); __m256i v = _mm256_shuffle_epi8(L, ctlm[k]); \
      __m256i lo = _mm256_srlv_epi32(v, srl), hi = _mm256_sllv_epi32(v, sll); \
      __m256i st = _mm256_blend_epi16(lo, hi, 0xAA); __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, xm[k])); __asm__("" : "+x"(acc)); }
      SLOTM(0, 0, a0) SLOTM(16, 1, a1) SLOTM(32, 2, a2) SLOTM(48, 3, a3)
      __asm__ volatile("" ::: "memory");
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("pair slot, immediate shifts", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    for (long i = 0; i < n; ++i) {
#define SLOTI(L, acc) { __m256i v = _mm256_shuffle_epi8(L, ctl); __m256i lo = _mm256_srli_epi32(v, 5), hi = _mm256_slli_epi32(v, 7); \
      __m256i st = _mm256_blend_epi16(lo, hi, 0xAA); __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, x)); KEEP(L); }
      SLOTI(L0, a0) SLOTI(L1, a1) SLOTI(L2, a2) SLOTI(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("pair slot, no pshufb", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    for (long i = 0; i < n; ++i) {
#define SLOTN(L, acc) { __m256i v = L; __m256i lo = _mm256_srlv_epi32(v, srl), hi = _mm256_sllv_epi32(v, sll); \
      __m256i st = _mm256_blend_epi16(lo, hi, 0xAA); __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, x)); KEEP(L); }
      SLOTN(L0, a0) SLOTN(L1, a1) SLOTN(L2, a2) SLOTN(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("pair slot, 8 slots in flight", 128, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0, L4 = L0, L5 = L0, L6 = L0, L7 = L0;
    for (long i = 0; i < n; ++i) {
      SLOT(L0, a0) SLOT(L1, a1) SLOT(L2, a2) SLOT(L3, a3) SLOT(L4, a4) SLOT(L5, a5) SLOT(L6, a6) SLOT(L7, a7)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);
  });
  run("hash+acc only (mul 6 + add 3)", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    for (long i = 0; i < n; ++i) {
#define SLOTH(L, acc) { __m256i st = L; __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, x)); KEEP(L); }
      SLOTH(L0, a0) SLOTH(L1, a1) SLOTH(L2, a2) SLOTH(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("planar funnel mix (anchor-like)", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    __m256i M0 = _mm256_set1_epi32(0x2345678), M1 = M0, M2 = M0, M3 = M0;
    for (long i = 0; i < n; ++i) {
#define SLOTP(L, M, acc, EXTRA) { __m256i lo = _mm256_srli_epi32(L, 5); __m256i hi = _mm256_slli_epi32(M, 7); EXTRA \
      __m256i st = _mm256_blend_epi16(lo, hi, 0xAA); __m256i plo = _mm256_mullo_epi16(st, mlo); \
      __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, mlo), _mm256_mullo_epi16(st, mhi)); \
      __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, one8), _mm256_maddubs_epi16(phi, one8)); \
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(bs, x)); KEEP(L); KEEP(M); }
      SLOTP(L0, M0, a0, lo = _mm256_or_si256(lo, _mm256_slli_epi32(M0, 27));)
      SLOTP(L1, M1, a1, hi = _mm256_or_si256(hi, _mm256_srli_epi32(L1, 9));)
      SLOTP(L2, M2, a2, lo = _mm256_or_si256(lo, _mm256_slli_epi32(M2, 27)); hi = _mm256_or_si256(hi, _mm256_srli_epi32(L2, 9));)
      SLOTP(L3, M3, a3, )
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("exact slot (26 ops)", 64, [&](long n) {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0; __m256i L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    const __m256 kinv = _mm256_set1_ps(0.0067f), kaff = _mm256_set1_ps(-3.45f), xf = _mm256_set1_ps(0.01f);
    const __m256i sgnexp = _mm256_set1_epi32(int(0xFF800000u)), e13 = _mm256_set1_epi32(13 << 23);
    for (long i = 0; i < n; ++i) {
#define RH8(f) { __m256 m = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_and_si256(_mm256_castps_si256(f), sgnexp), e13)); f = _mm256_sub_ps(_mm256_add_ps(f, m), m); }
#define EH(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), ones16); \
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), kinv, kaff); RH8(f) acc = _mm256_fmadd_ps(f, xf, acc); }
#define ESLOT(L, acc) { EH(L, acc, ctl) EH(L, acc, sll) KEEP(L); }
      ESLOT(L0, a0) ESLOT(L1, a1) ESLOT(L2, a2) ESLOT(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("exact slot, int rounding of the float bits", 64, [&](long n) {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0; __m256i L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    const __m256 kinv = _mm256_set1_ps(0.0067f), kaff = _mm256_set1_ps(-3.45f), xf = _mm256_set1_ps(0.01f);
    const __m256i b13 = _mm256_set1_epi32(0x2000), k4095 = _mm256_set1_epi32(0xFFF), keep = _mm256_set1_epi32(int(0xFFFFE000u));
    for (long i = 0; i < n; ++i) {
#define RI8(f) { __m256i b = _mm256_castps_si256(f); __m256i c = _mm256_cmpeq_epi32(_mm256_and_si256(b, b13), b13); \
      f = _mm256_castsi256_ps(_mm256_and_si256(_mm256_sub_epi32(_mm256_add_epi32(b, k4095), c), keep)); }
#define EHI(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), ones16); \
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), kinv, kaff); RI8(f) acc = _mm256_fmadd_ps(f, xf, acc); }
#define ESLOTI(L, acc) { EHI(L, acc, ctl) EHI(L, acc, sll) KEEP(L); }
      ESLOTI(L0, a0) ESLOTI(L1, a1) ESLOTI(L2, a2) ESLOTI(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("exact slot, N = 1774 bs - 905216, int rounding", 64, [&](long n) {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0; __m256i L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    const __m256 xf = _mm256_set1_ps(0.01f);
    const __m256i b13 = _mm256_set1_epi32(0x2000), k4095 = _mm256_set1_epi32(0xFFF), keep = _mm256_set1_epi32(int(0xFFFFE000u));
    const __m256i k1774 = _mm256_set1_epi16(1774), koff = _mm256_set1_epi32(-905216);
    for (long i = 0; i < n; ++i) {
#define EHN2(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), k1774), koff); \
      __m256 f = _mm256_cvtepi32_ps(v); RI8(f) acc = _mm256_fmadd_ps(f, xf, acc); }
#define ESLOTN2(L, acc) { EHN2(L, acc, ctl) EHN2(L, acc, sll) KEEP(L); }
      ESLOTN2(L0, a0) ESLOTN2(L1, a1) ESLOTN2(L2, a2) ESLOTN2(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("exact slot, F16C rounding", 64, [&](long n) {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0; __m256i L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    const __m256 kinv = _mm256_set1_ps(0.0067f), kaff = _mm256_set1_ps(-3.45f), xf = _mm256_set1_ps(0.01f);
    for (long i = 0; i < n; ++i) {
#define EHF(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), ones16); \
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), kinv, kaff); f = _mm256_cvtph_ps(_mm256_cvtps_ph(f, 0)); acc = _mm256_fmadd_ps(f, xf, acc); }
#define ESLOTF(L, acc) { EHF(L, acc, ctl) EHF(L, acc, sll) KEEP(L); }
      ESLOTF(L0, a0) ESLOTF(L1, a1) ESLOTF(L2, a2) ESLOTF(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("exact slot, no rounding", 64, [&](long n) {
    __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0; __m256i L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    const __m256 kinv = _mm256_set1_ps(0.0067f), kaff = _mm256_set1_ps(-3.45f), xf = _mm256_set1_ps(0.01f);
    for (long i = 0; i < n; ++i) {
#define EHN(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), ones16); \
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), kinv, kaff); acc = _mm256_fmadd_ps(f, xf, acc); }
#define ESLOTN(L, acc) { EHN(L, acc, ctl) EHN(L, acc, sll) KEEP(L); }
      ESLOTN(L0, a0) ESLOTN(L1, a1) ESLOTN(L2, a2) ESLOTN(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  // former form: 14 ops per 16 weights (two halves of 8)
  run("former slot (14 ops)", 64, [&](long n) {
    __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, L0 = _mm256_set1_epi32(0x12345678), L1 = L0, L2 = L0, L3 = L0;
    for (long i = 0; i < n; ++i) {
#define HALF(L, acc, c) { __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), srl), mask); \
      v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v, mult), one8), x); acc = _mm256_add_epi32(acc, v); }
#define FSLOT(L, acc) { HALF(L, acc, ctl) HALF(L, acc, sll) KEEP(L); }
      FSLOT(L0, a0) FSLOT(L1, a1) FSLOT(L2, a2) FSLOT(L3, a3)
    }
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3);
  });
  run("6 multiplies only (pair's)", 64, [&](long n) {
    __m256i s0 = _mm256_set1_epi32(3), s1 = s0, s2 = s0, s3 = s0;
    for (long i = 0; i < n; ++i) {
#define MUL6(s) { __m256i a = _mm256_mullo_epi16(s, mlo), b = _mm256_mulhi_epu16(s, mlo), c = _mm256_mullo_epi16(s, mhi); \
      s = _mm256_madd_epi16(_mm256_maddubs_epi16(a, one8), _mm256_maddubs_epi16(b, c)); }
      MUL6(s0) MUL6(s1) MUL6(s2) MUL6(s3)
    }
    KEEP(s0); KEEP(s1); KEEP(s2); KEEP(s3);
  });
}
