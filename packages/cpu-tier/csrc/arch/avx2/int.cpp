// AVX2 variant: the integer path's dispatch (MUL1 "fast") and the variant's kernel table.
#include "kernels.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// K = 3 (DeepSeek-V4.1's) is compiled with compile-time window offsets; every other K runs the generic
// (table-driven) kernels, except the one-token kernel, which also specialises K = 2 and 4.
template <int M>
static void intm_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
    if (A.bits2 == 6) return band_intm<M, 6, true>(A, band, X, y);
    if (A.tb->uniform_shift) return band_intm<M, 0, true>(A, band, X, y);
    band_intm<M, 0, false>(A, band, X, y);
}

void gemv_int(const MatRef& A, int band, const Acts& X, float* y) {
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
}

const KernelTable& kernel_table() {
    static const KernelTable t{"avx2", false, false, gemv_int, {gemv_float_3inst, gemv_float_mcg, gemv_float_mul1}};
    return t;
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
