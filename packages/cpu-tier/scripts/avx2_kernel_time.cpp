// The AVX2 band kernels alone, timed in thread CPU time (other processes' time slices do not count), on one
// gate-sized matrix (k = 5120, n = 2304, K = 3; POOL > 1: that many, streamed from DRAM; the driver:
// kernel_time_main.h). A diagnostic, not part of
// the package build. VARIANT 0 = the pair form (default), 1 = the former forms, 2 = the exact float path, 3 = the
// dword form (one state per 32-bit lane, vpmulld) in the pair form's block structure, M = 1 only (Zen 3 has a
// full-rate vpmulld; measured slower than the pair form there all the same: results/devbox_zen3_ports.txt).
// VARIANT 8 = the generic band_float loop, the exact kernel before band_exact_mul1 (which variant 2 runs at M = 1,
// 2, 3; the same values). The variants 4-7 of results/devbox_zen4_exact_variants.txt (each of its two changes alone)
// were template switches of the one-token exact kernel, removed once both were kept.
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -DCPU_TIER_NS=avx2 -DCPU_TIER_ISA_AVX2 -Ipackages/cpu-tier/csrc \
//       packages/cpu-tier/scripts/avx2_kernel_time.cpp -o /tmp/kt && /tmp/kt M VARIANT SECONDS [POOL]
#include "arch/avx2/kernels.h"
namespace cpu_tier { namespace avx2 {

// Experiment: the dword form (one state per 32-bit lane, vpmulld) in band_pair's block structure.
template <int BITS2, bool UNIFORM>
static void band_dw1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    const size_t row_stride = w.row_stride;
    alignas(64) float facc[8 * 4 * 2 * 8];
    alignas(64) __m256i xp[8][4];
    std::memset(facc, 0, sizeof(facc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF), mult = _mm256_set1_epi32(int32_t(MUL1_MULT)), ones8 = _mm256_set1_epi8(1);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr)
            for (int q = 0; q < 4; ++q) {
                int64_t v;
                std::memcpy(&v, X.xq + 16 * (8 * blk + rr) + 4 * q, 8);
                const __m256i b = _mm256_set1_epi64x(v);
                xp[rr][q] = _mm256_unpacklo_epi16(b, b);
            }
        const __m256 sc = _mm256_set1_ps(X.xs[blk]);
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
                const uint8_t* tile = brow + j * tbytes;
#pragma GCC unroll 1
                for (int rr = 0; rr < 8; ++rr, tile += row_stride) {
                    __m128i wrapv = _mm_setzero_si128();
                    if constexpr (ct_needs_wrap<BITS2>()) if (a == 0) wrapv = wrap_window(tile, tbytes);
                    static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                        constexpr int q = decltype(QQ)::value;
                        const __m256i L = slot_window<BITS2, 4 * a + q>(tile, nullptr, wrapv, tb);
                        __m256i v0 = slot_states<UNIFORM, 4 * a + q, 0>(L, tb, sh0, mask16);
                        __m256i v1 = slot_states<UNIFORM, 4 * a + q, 1>(L, tb, sh1, mask16);
                        v0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v0, mult), ones8), xp[rr][q]);
                        v1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v1, mult), ones8), xp[rr][q]);
                        acc0 = _mm256_add_epi32(acc0, v0); __asm__("" : "+x"(acc0));
                        acc1 = _mm256_add_epi32(acc1, v1); __asm__("" : "+x"(acc1));
                    });
                }
                float* f = facc + (j * 4 + a) * 16;
                _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc0), sc, _mm256_load_ps(f)));
                _mm256_store_ps(f + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc1), sc, _mm256_load_ps(f + 8)));
            });
        }
    }
    reduce_tile_acc(facc, y);
    int_affine(y, X, 0);
}
// Only the K = 3 kernels measured here (the package's int.cpp instantiates every K and M: minutes to compile).
static void kb_gemv(const MatRef& A, int band, const Acts& X, float* y) {
    if (X.variant == 2) {  // exact: float path, rounded codebook values
        if (X.m == 1) return band_float<CB_MUL1, 1, true, 6, true>(A, band, X, y);
        if (X.m == 2) return band_float<CB_MUL1, 2, true, 6, true>(A, band, X, y);
        if (X.m == 3) return band_float<CB_MUL1, 3, true, 6, true>(A, band, X, y);
        if (X.m == 4) return band_float<CB_MUL1, 4, true, 6, true>(A, band, X, y);
        return band_float<CB_MUL1, 8, true, 6, true>(A, band, X, y);
    }
    if (X.variant == 3) return band_dw1<6, true>(A, band, X, y);
    if (X.variant == 8) {  // the generic band_float loop (exact before the dedicated kernels)
        if (X.m == 1) return band_float<CB_MUL1, 1, true, 6, true, true>(A, band, X, y);
        if (X.m == 2) return band_float<CB_MUL1, 2, true, 6, true, true>(A, band, X, y);
        if (X.m == 3) return band_float<CB_MUL1, 3, true, 6, true, true>(A, band, X, y);
        if (X.m == 4) return band_float<CB_MUL1, 4, true, 6, true, true>(A, band, X, y);
        return band_float<CB_MUL1, 8, true, 6, true, true>(A, band, X, y);
    }
    if (X.variant == 1) {
        if (X.m == 1) return band_int1<6, true>(A, band, X, y);
        if (X.m == 2) return band_intm<2, 6, true>(A, band, X, y);
        if (X.m == 3) return band_intm<3, 6, true>(A, band, X, y);
        if (X.m == 4) return band_intm<4, 6, true>(A, band, X, y);
        return band_intm<8, 6, true>(A, band, X, y);
    }
    if (X.m == 1) return band_pair<1, 6, true>(A, band, X, y);
    if (X.m == 2) return band_pair<2, 6, true>(A, band, X, y);
    if (X.m == 3) return band_pair<3, 6, true>(A, band, X, y);
    if (X.m == 4) return band_pair<4, 6, true>(A, band, X, y);
    return band_pair<8, 6, true>(A, band, X, y);
}
}}
#include "kernel_time_main.h"
int main(int argc, char** argv) {
    if (argc > 2 && std::atoi(argv[2]) == 3 && std::atoi(argv[1]) != 1) {
        std::fprintf(stderr, "variant 3 computes one token: M must be 1, got %s\n", argv[1]);
        return 2;
    }
    return kernel_time_main(argc, argv, cpu_tier::avx2::kb_gemv);
}
