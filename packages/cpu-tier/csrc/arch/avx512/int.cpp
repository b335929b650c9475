// AVX-512 variant (and the emulated avx512emu): the integer path's dispatch (MUL1 "fast": the 16-bit-lane kernel
// for K <= 4, with the AMX kernel where Acts::amx asks; 32-bit lanes for K = 5..8) and the variant's kernel table.
#include "amx_kernel.h"
#include "kernels.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

template <int TB>
static void int16_dispatch(const MatRef& A, int band, const Acts& X, float* y) {
#if defined(CT_HAVE_AMX)
    if (X.amx && A.tb->has_amx)
        return with_tokens(X.m, [&](auto MM) { band_amx<decltype(MM)::value, TB>(A, band, X, y); });
#endif
    with_tokens(X.m, [&](auto MM) {
        constexpr int M = decltype(MM)::value;
        if constexpr (M <= 2) {  // the benchmark's A/B forms (Acts::variant) at 1 and 2 tokens
            if (X.variant == 1) return band_int16<M, TB, true, false>(A, band, X, y);
            if (X.variant == 2) return band_int16<M, TB, false, false>(A, band, X, y);
        }
        band_int16<M, TB>(A, band, X, y);
    });
}

void gemv_int(const MatRef& A, int band, const Acts& X, float* y) {
    // K <= 4 (every half-integer K too): the 16-bit path; K = 5..8 (integer, uniform shifts): 32-bit lanes.
    if (A.tb->has16) {
        if (A.tb->tile_bytes == 96) return int16_dispatch<96>(A, band, X, y);
        if (A.tb->tile_bytes == 64) return int16_dispatch<64>(A, band, X, y);
        if (A.tb->tile_bytes == 128) return int16_dispatch<128>(A, band, X, y);
        return int16_dispatch<0>(A, band, X, y);
    }
    switch (X.m) {
        case 1: return band_int1<0, true>(A, band, X, y);
        case 2: return band_intm<2, 0, true>(A, band, X, y);
        case 3: return band_intm<3, 0, true>(A, band, X, y);
        case 4: return band_intm<4, 0, true>(A, band, X, y);
        case 5: return band_intm<5, 0, true>(A, band, X, y);
        case 6: return band_intm<6, 0, true>(A, band, X, y);
        case 7: return band_intm<7, 0, true>(A, band, X, y);
        case 8: return band_intm<8, 0, true>(A, band, X, y);
        default: return;
    }
}

// 16 states at a time through DECODE (16 masked states in 32-bit lanes -> 16 values).
template <__m512 (*DECODE)(__m512i)>
static void decode_exact_with(const uint16_t* states, size_t n, float* out) {
    alignas(64) int32_t s[16];
    alignas(64) float v[16];
    for (size_t i = 0; i < n; i += 16) {
        for (int l = 0; l < 16; ++l) s[l] = states[i + size_t(l)];
        _mm512_store_ps(v, DECODE(_mm512_load_si512(s)));
        for (int l = 0; l < 16; ++l) out[i + size_t(l)] = v[l];
    }
}

static void decode_exact(int codebook, const uint16_t* states, size_t n, float* out) {
    if (codebook == DECODE_MUL1_SPLIT) return decode_exact_with<mul1_split_values16>(states, n, out);
    if (codebook == CB_MUL1) return decode_exact_with<decode_values16<CB_MUL1, true>>(states, n, out);
    if (codebook == CB_MCG) return decode_exact_with<decode_values16<CB_MCG, true>>(states, n, out);
    decode_exact_with<decode_values16<CB_3INST, true>>(states, n, out);
}

const KernelTable& kernel_table() {
#if defined(CT_EMU512)
    constexpr const char* name = "avx512emu";
    constexpr bool emulated = true;
#else
    constexpr const char* name = "avx512";
    constexpr bool emulated = false;
#endif
#if defined(CT_HAVE_AMX)
    constexpr bool amx = true;
#else
    constexpr bool amx = false;
#endif
    static const KernelTable t{name, amx, emulated, gemv_int, {gemv_float_3inst, gemv_float_mcg, gemv_float_mul1},
                               decode_exact};
    return t;
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
