// The float path's template dispatch of the x86 SIMD families: included by a family's float_<codebook>.cpp after
// its kernels header (which defines band_float).
#pragma once

#include "common.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// ---------------------------------------------------------------------------------- float path dispatch
// Each family defines band_float<CB, M, ROUND, BITS2, UNIFORM> (CB: codebook; M: tokens, 1 to MAXM; BITS2: 2K
// with compile-time window offsets, 0 = table driven; UNIFORM: the shifts depend on the half only, integer K).
// K = 3 (DeepSeek-V4.1's) is compiled with compile-time window offsets; every other K runs the generic kernels.
template <int M, int CB, bool ROUND>
static void float_dispatch_k(const MatRef& A, int band, const Acts& X, float* y) {
    if (A.bits2 == 6) return band_float<CB, M, ROUND, 6, true>(A, band, X, y);
    if constexpr (CB == CB_MUL1)
        if (!A.tb->uniform_shift) return band_float<CB, M, ROUND, 0, false>(A, band, X, y);
    band_float<CB, M, ROUND, 0, true>(A, band, X, y);
}

// MUL1's float path always rounds: its "fast" precision runs the integer path.
template <int CB>
static void float_dispatch_cb(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    constexpr bool R0 = CB == CB_MUL1;  // the variant used when round == false
    with_tokens(X.m, [&](auto MM) {
        constexpr int M = decltype(MM)::value;
        if (round) float_dispatch_k<M, CB, true>(A, band, X, y);
        else float_dispatch_k<M, CB, R0>(A, band, X, y);
    });
}

// The float entry point of codebook CB (in a family's float_<codebook>.cpp, after its kernels header).
#define CT_DEFINE_GEMV_FLOAT(NAME, CB)                                                       \
    void NAME(const MatRef& A, int band, const Acts& X, bool round, float* y) {              \
        float_dispatch_cb<CB>(A, band, X, round, y);                                         \
    }

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
