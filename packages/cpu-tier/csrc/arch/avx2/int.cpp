// AVX2 variant: the integer path's dispatch (MUL1 "fast") and the variant's kernel table.
#include "kernels.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// K = 2, 3 (DeepSeek-V4.1's), 4 are compiled with compile-time window offsets; every other K runs the generic
// (table-driven) kernels.
template <int M>
static void pair_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
    switch (A.bits2) {
        case 4: return band_pair<M, 4, true>(A, band, X, y);
        case 6: return band_pair<M, 6, true>(A, band, X, y);
        case 8: return band_pair<M, 8, true>(A, band, X, y);
        default:
            if (A.tb->uniform_shift) return band_pair<M, 0, true>(A, band, X, y);
            return band_pair<M, 0, false>(A, band, X, y);
    }
}

// The former forms (Acts::variant 1, the benchmark's A/B): one token row by row, several tokens in 32-bit lanes.
template <int M>
static void intm_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
    if (A.bits2 == 6) return band_intm<M, 6, true>(A, band, X, y);
    if (A.tb->uniform_shift) return band_intm<M, 0, true>(A, band, X, y);
    band_intm<M, 0, false>(A, band, X, y);
}

static void former_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
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
    with_tokens(X.m, [&](auto MM) {
        constexpr int M = decltype(MM)::value;
        if constexpr (M >= 2) intm_dispatch<M>(A, band, X, y);
    });
}

void gemv_int(const MatRef& A, int band, const Acts& X, float* y) {
    if (X.variant == 1) return former_dispatch(A, band, X, y);
    with_tokens(X.m, [&](auto MM) { pair_dispatch<decltype(MM)::value>(A, band, X, y); });
}

// 8 states at a time through DECODE (8 masked states in 32-bit lanes -> 8 values).
template <__m256 (*DECODE)(__m256i)>
static void decode_exact_with(const uint16_t* states, size_t n, float* out) {
    alignas(32) int32_t s[8];
    for (size_t i = 0; i < n; i += 8) {
        for (int l = 0; l < 8; ++l) s[l] = states[i + size_t(l)];
        _mm256_storeu_ps(out + i, DECODE(_mm256_load_si256(reinterpret_cast<const __m256i*>(s))));
    }
}
template <int CB>
static void decode_exact_cb(const uint16_t* states, size_t n, float* out) {
    decode_exact_with<decode_values<CB, true>>(states, n, out);
}

static void decode_exact(int codebook, const uint16_t* states, size_t n, float* out) {
    if (codebook == DECODE_MUL1_SPLIT) return decode_exact_with<mul1_split_values>(states, n, out);
    if (codebook == CB_MUL1) return decode_exact_cb<CB_MUL1>(states, n, out);
    if (codebook == CB_MCG) return decode_exact_cb<CB_MCG>(states, n, out);
    decode_exact_cb<CB_3INST>(states, n, out);
}

const KernelTable& kernel_table() {
    static const KernelTable t{"avx2", false, false, gemv_int, {gemv_float_3inst, gemv_float_mcg, gemv_float_mul1},
                               decode_exact};
    return t;
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
