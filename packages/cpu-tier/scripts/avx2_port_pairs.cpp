// AVX2 port probe: which 256-bit instructions share ports (a diagnostic for the MUL1 AVX2 kernels, not part of the
// package build). Thread CPU time, so other processes' time slices do not count; cycles at the clock of
// CPU_TIER_GHZ (default 4.0: read yours from port_probe or the bench's core clock).
//   g++ -O2 -mavx2 -mfma -mf16c packages/cpu-tier/scripts/avx2_port_pairs.cpp -o /tmp/pairs && /tmp/pairs
#include <immintrin.h>
#include <cstdlib>
#include <time.h>
#include <cstdio>
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define KEEP(v) __asm__ volatile("" : "+x"(v))
template <class F> double run(F f) { double best = 1e9; long n = 3000000;
  for (int r = 0; r < 5; ++r) { double t0 = cpu_s(); f(n); double t = cpu_s() - t0; if (t < best) best = t; } return best / n * 1e9; }
#define SH(a, b) _mm256_shuffle_epi8(a, b)
#define ML(a, b) _mm256_mullo_epi16(a, b)
#define SV(a, b) _mm256_srlv_epi32(a, k5)
#define LV(a, b) _mm256_sllv_epi32(a, k5)
#define MU(a, b) _mm256_mulhi_epu16(a, b)
#define MB(a, b) _mm256_maddubs_epi16(a, b)
#define MD(a, b) _mm256_madd_epi16(a, b)
#define MLD(a, b) _mm256_mullo_epi32(a, b)
#define SL(a, b) _mm256_slli_epi32(a, 5)
#define AW(a, b) _mm256_add_epi16(a, b)
#define P2H(a, b) _mm256_castsi128_si256(_mm256_cvtps_ph(_mm256_castsi256_ps(a), 0))
#define H2P(a, b) _mm256_castps_si256(_mm256_cvtph_ps(_mm256_castsi256_si128(a)))
#define RX(a, b) _mm256_castsi128_si256(_mm_castps_si128(_mm_cvtph_ps(_mm_cvtps_ph(_mm_castsi128_ps(_mm256_castsi256_si128(a)), 0))))
#define RH(a, b) _mm256_castps_si256(_mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_castsi256_ps(a), 0)))
#define FM(a, b) _mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _mm256_castsi256_ps(b)))
#define CV(a, b) _mm256_castps_si256(_mm256_cvtepi32_ps(a))
#define SA(a, b) _mm256_sad_epu8(a, b)
#define FA(a, b) _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)))
#define AD(a, b) _mm256_add_epi32(a, b)
#define PD(a, b) _mm256_permutevar8x32_epi32(a, b)
#define BL(a, b) _mm256_blend_epi16(a, b, 0xAA)
#define SI(a, b) _mm256_srli_epi32(a, 5)
#define OR(a, b) _mm256_or_si256(a, b)
#define T(NAME, O0, O1, O2, O3, O4, O5, O6, O7, O8, O9, O10, O11) { double ns = run([&](long n) { \
    __m256i r0 = _mm256_set1_epi32(1), r1 = r0, r2 = r0, r3 = r0, r4 = r0, r5 = r0, r6 = r0, r7 = r0, r8 = r0, r9 = r0, r10 = r0, r11 = r0; \
    for (long it = 0; it < n; ++it) { r0 = O0(r0, c); r1 = O1(r1, c); r2 = O2(r2, c); r3 = O3(r3, c); r4 = O4(r4, c); r5 = O5(r5, c); \
      r6 = O6(r6, c); r7 = O7(r7, c); r8 = O8(r8, c); r9 = O9(r9, c); r10 = O10(r10, c); r11 = O11(r11, c); KEEP(r0); KEEP(r1); KEEP(r2); KEEP(r3); KEEP(r4); KEEP(r5); KEEP(r6); KEEP(r7); KEEP(r8); KEEP(r9); KEEP(r10); KEEP(r11); } \
    KEEP(r0); KEEP(r1); KEEP(r2); KEEP(r3); KEEP(r4); KEEP(r5); KEEP(r6); KEEP(r7); KEEP(r8); KEEP(r9); KEEP(r10); KEEP(r11); }); \
    printf("%-36s %6.3f ns per 12 ops = %5.2f cycles\n", NAME, ns, ns * ghz); }
int main() {
  const double ghz = getenv("CPU_TIER_GHZ") ? atof(getenv("CPU_TIER_GHZ")) : 4.0;
  const __m256i c = _mm256_set1_epi32(0x00010203), k5 = _mm256_set1_epi32(5);
  // alone: 12 independent chains of one instruction (a chain per register, so the rate is the throughput when
  // latency <= 12 / throughput)
  T("12 vpmullw", ML, ML, ML, ML, ML, ML, ML, ML, ML, ML, ML, ML)
  T("12 vpmulhuw", MU, MU, MU, MU, MU, MU, MU, MU, MU, MU, MU, MU)
  T("12 vpmulld", MLD, MLD, MLD, MLD, MLD, MLD, MLD, MLD, MLD, MLD, MLD, MLD)
  T("12 vpmaddubsw", MB, MB, MB, MB, MB, MB, MB, MB, MB, MB, MB, MB)
  T("12 vpmaddwd", MD, MD, MD, MD, MD, MD, MD, MD, MD, MD, MD, MD)
  T("12 vpsadbw", SA, SA, SA, SA, SA, SA, SA, SA, SA, SA, SA, SA)
  T("12 vfmadd231ps", FM, FM, FM, FM, FM, FM, FM, FM, FM, FM, FM, FM)
  T("12 vpshufb", SH, SH, SH, SH, SH, SH, SH, SH, SH, SH, SH, SH)
  T("12 vpermd", PD, PD, PD, PD, PD, PD, PD, PD, PD, PD, PD, PD)
  T("12 vpsrlvd", SV, SV, SV, SV, SV, SV, SV, SV, SV, SV, SV, SV)
  T("12 vpsllvd", LV, LV, LV, LV, LV, LV, LV, LV, LV, LV, LV, LV)
  T("12 vpsrld imm", SI, SI, SI, SI, SI, SI, SI, SI, SI, SI, SI, SI)
  T("12 vcvtdq2ps", CV, CV, CV, CV, CV, CV, CV, CV, CV, CV, CV, CV)
  T("12 vaddps", FA, FA, FA, FA, FA, FA, FA, FA, FA, FA, FA, FA)
  T("12 vpaddd", AD, AD, AD, AD, AD, AD, AD, AD, AD, AD, AD, AD)
  T("12 vpaddw", AW, AW, AW, AW, AW, AW, AW, AW, AW, AW, AW, AW)
  T("12 vpor", OR, OR, OR, OR, OR, OR, OR, OR, OR, OR, OR, OR)
  T("12 vpblendw", BL, BL, BL, BL, BL, BL, BL, BL, BL, BL, BL, BL)
  // pairs: 6 + 6 in the time of 6 alone = separate ports; of 12 alone = the same ports
  T("6 vpmullw + 6 vpmaddubsw", ML, MB, ML, MB, ML, MB, ML, MB, ML, MB, ML, MB)
  T("6 vpmullw + 6 vfmadd", ML, FM, ML, FM, ML, FM, ML, FM, ML, FM, ML, FM)
  T("6 vpmullw + 6 vpsadbw", ML, SA, ML, SA, ML, SA, ML, SA, ML, SA, ML, SA)
  T("6 vpmullw + 6 vpshufb", ML, SH, ML, SH, ML, SH, ML, SH, ML, SH, ML, SH)
  T("6 vpmullw + 6 vpermd", ML, PD, ML, PD, ML, PD, ML, PD, ML, PD, ML, PD)
  T("6 vpmullw + 6 vpsrlvd", ML, SV, ML, SV, ML, SV, ML, SV, ML, SV, ML, SV)
  T("6 vpmullw + 6 vpsrld imm", ML, SI, ML, SI, ML, SI, ML, SI, ML, SI, ML, SI)
  T("6 vpmullw + 6 vcvtdq2ps", ML, CV, ML, CV, ML, CV, ML, CV, ML, CV, ML, CV)
  T("6 vpmullw + 6 vpaddd", ML, AD, ML, AD, ML, AD, ML, AD, ML, AD, ML, AD)
  T("6 vpmullw + 6 vpblendw", ML, BL, ML, BL, ML, BL, ML, BL, ML, BL, ML, BL)
  T("6 vpshufb + 6 vpsrlvd", SH, SV, SH, SV, SH, SV, SH, SV, SH, SV, SH, SV)
  T("6 vpshufb + 6 vpermd", SH, PD, SH, PD, SH, PD, SH, PD, SH, PD, SH, PD)
  T("6 vpshufb + 6 vpaddd", SH, AD, SH, AD, SH, AD, SH, AD, SH, AD, SH, AD)
  T("6 vpsrlvd + 6 vpsrld imm", SV, SI, SV, SI, SV, SI, SV, SI, SV, SI, SV, SI)
  T("6 vpsrld imm + 6 vcvtdq2ps", SI, CV, SI, CV, SI, CV, SI, CV, SI, CV, SI, CV)
  T("6 vpsrld imm + 6 vaddps", SI, FA, SI, FA, SI, FA, SI, FA, SI, FA, SI, FA)
  T("4 vpmullw + 4 vpsrlvd + 4 vpsllvd", ML, SV, LV, ML, SV, LV, ML, SV, LV, ML, SV, LV)
  T("4 vpmullw + 4 vpshufb + 4 vpaddd", ML, SH, AD, ML, SH, AD, ML, SH, AD, ML, SH, AD)
  T("12 vcvtps2ph ymm", P2H, P2H, P2H, P2H, P2H, P2H, P2H, P2H, P2H, P2H, P2H, P2H)
  T("12 vcvtph2ps ymm", H2P, H2P, H2P, H2P, H2P, H2P, H2P, H2P, H2P, H2P, H2P, H2P)
}
