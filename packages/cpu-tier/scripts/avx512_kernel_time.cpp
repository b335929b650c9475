// The AVX-512 band kernels alone, timed in thread CPU time (other processes' time slices do not count), on one
// gate-sized matrix (k = 5120, n = 2304, K = 3; POOL > 1: that many, streamed from DRAM), as
// scripts/avx2_kernel_time.cpp for AVX2 (the driver: kernel_time_main.h). A diagnostic, not part of the package
// build. VARIANT 0 = the integer path ("fast", band_int16), 2 = the exact float path (band_exact_mul1), 8 = the
// generic band_float loop (the exact kernel before band_exact_mul1; the same values); 5 and 6 = a prototype, the exact
// values fed by the integer path's 16-bit decode (band_exact16 below; results/devbox_zen4_avx512_exact16_proto.txt:
// on Zen 4 equal to variant 2 at m = 1, 2, slower from m = 4; not in the package, kept to be timed on Intel, where
// vpmulld is two uops and the integer decode's share is larger).
//   g++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512vbmi \
//       -mprefer-vector-width=512 -Wno-maybe-uninitialized -std=c++17 -DCPU_TIER_NS=avx512 -DCPU_TIER_ISA_AVX512 \
//       -Ipackages/cpu-tier/csrc packages/cpu-tier/scripts/avx512_kernel_time.cpp -o /tmp/kt512 \
//       && /tmp/kt512 M VARIANT SECONDS [POOL]
#include "arch/avx512/kernels.h"
namespace cpu_tier { namespace avx512 {
// Prototype: the exact values from the integer path's 16-bit decode (vpermb + vpmultishiftqb, three 16-bit
// multiplies, two vpmaddubsw: 32 byte sums per zmm), split to even / odd dwords by vpmaddwd, converted, rounded.
// DIRECT = false: Veltkamp's split with the offset folded in, each row's offset out per token (two row-parity chains);
// true: N = 1774 bs - OFF computed exactly, split plainly (no offset).
template <int M, bool DIRECT>
static void band_exact16(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const Band16 g = band16<96>(A, band, X);
    const int tbytes = g.tbytes;
    const size_t row_stride = g.row_stride;
    constexpr int NACC = 8 * 8 * 16;
    alignas(64) float facc[M][NACC];
    alignas(64) __m512 xe[8][M], xo[8][M], xoff[8][M];
    std::memset(facc, 0, sizeof(facc));
    const __m512i ml = _mm512_set1_epi16(short(MUL1_MULT & 0xFFFF));
    const __m512i mh = _mm512_set1_epi16(short(MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1);
    const __m512i pe = _mm512_set1_epi32(1), po = _mm512_set1_epi32(0x10000);
    alignas(64) static const int32_t ie_tab[16] = {0, 2, 0, 2, 4, 6, 4, 6, 8, 10, 8, 10, 12, 14, 12, 14};
    alignas(64) static const int32_t io_tab[16] = {1, 3, 1, 3, 5, 7, 5, 7, 9, 11, 9, 11, 13, 15, 13, 15};
    const __m512i ie = _mm512_load_si512(ie_tab), io = _mm512_load_si512(io_tab);
    const __m512 c1 = _mm512_set1_ps(VELTKAMP_HALF * float(MUL1_N_MULT));
    const __m512 c0 = _mm512_set1_ps(-VELTKAMP_HALF * float(MUL1_N_OFF));
    const __m512 nm = _mm512_set1_ps(float(DIRECT ? MUL1_N_MULT : -MUL1_N_MULT));
    const __m512 noff = _mm512_set1_ps(-float(MUL1_N_OFF));
    g.start();
    for (int blk = g.r0 / 8; blk < g.r1 / 8; ++blk) {
        const uint8_t* brow = g.block(blk);
        for (int rr = 0; rr < 8; ++rr)
            for (int t = 0; t < M; ++t) {
                const __m512 xr = _mm512_loadu_ps(X.xf + t * X.xf_stride + 16 * (8 * blk + rr));
                xe[rr][t] = _mm512_permutexvar_ps(ie, xr);
                xo[rr][t] = _mm512_permutexvar_ps(io, xr);
                __m512 off = _mm512_mul_ps(_mm512_add_ps(xe[rr][t], xo[rr][t]), _mm512_set1_ps(float(MUL1_N_OFF)));
                __asm__("" : "+v"(off));
                xoff[rr][t] = off;
            }
        for (int j = 0; j < 8; ++j) {
            g.at(blk, j);
            for (int c0i = 0; c0i < 8; ++c0i) {
                const __m512i perm = _mm512_load_si512(tb.perm16[c0i]);
                const __m512i msh = _mm512_load_si512(tb.mshift16[c0i]);
                const int vb = tb.vperm1_base[c0i];
                const __m512i perm1 = _mm512_load_si512(tb.perm1[c0i]);
                __m512 acc[M][2];
                for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                    __m512i st;
                    if (vb >= 0) {
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutexvar_epi8(perm1, _mm512_loadu_si512(tile + vb)));
                    } else {
                        __m512i z0, z1;
                        load_tile2<96>(tile, tbytes, g.m0, g.m1, z0, z1);
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutex2var_epi8(z0, perm, z1));
                    }
                    const __m512i plo = _mm512_mullo_epi16(st, ml);
                    const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                    const __m512i bs = _mm512_add_epi16(_mm512_maddubs_epi16(plo, ones8), _mm512_maddubs_epi16(phi, ones8));
                    const __m512 be = _mm512_cvtepi32_ps(_mm512_madd_epi16(bs, pe));
                    const __m512 bo = _mm512_cvtepi32_ps(_mm512_madd_epi16(bs, po));
                    __m512 ce = _mm512_fmadd_ps(be, c1, c0), co = _mm512_fmadd_ps(bo, c1, c0);
                    __asm__("" : "+v"(ce), "+v"(co));
                    __m512 ve, vo;
                    if constexpr (DIRECT) {
                        const __m512 ne = _mm512_fmadd_ps(be, nm, noff), no = _mm512_fmadd_ps(bo, nm, noff);
                        ve = _mm512_sub_ps(ce, _mm512_sub_ps(ce, ne));
                        vo = _mm512_sub_ps(co, _mm512_sub_ps(co, no));
                    } else {
                        ve = _mm512_sub_ps(ce, _mm512_fmadd_ps(be, nm, ce));
                        vo = _mm512_sub_ps(co, _mm512_fmadd_ps(bo, nm, co));
                    }
                    for (int t = 0; t < M; ++t) {
                        __m512& a = acc[t][rr & 1];
                        a = _mm512_fmadd_ps(ve, xe[rr][t], a);
                        a = _mm512_fmadd_ps(vo, xo[rr][t], a);
                        if constexpr (!DIRECT) a = _mm512_sub_ps(a, xoff[rr][t]);
                    }
                }
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 8 + c0i) * 16;
                    _mm512_store_ps(f, _mm512_add_ps(_mm512_load_ps(f), _mm512_add_ps(acc[t][0], acc[t][1])));
                }
            }
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_pair_acc(facc[t], y + 128 * t);
        for (int c = 0; c < 128; ++c) y[128 * t + c] *= 1.0f / MUL1_N_UNIT;
    }
}
template <int M>
static void kb_m(const MatRef& A, int band, const Acts& X, float* y) {
    if (X.variant == 2) return band_float<CB_MUL1, M, true, 6, true>(A, band, X, y);
    if (X.variant == 5) return band_exact16<M, false>(A, band, X, y);
    if (X.variant == 6) return band_exact16<M, true>(A, band, X, y);
    if (X.variant == 8) return band_float<CB_MUL1, M, true, 6, true, true>(A, band, X, y);
    band_int16<M, 96>(A, band, X, y);
}
static void kb_gemv(const MatRef& A, int band, const Acts& X, float* y) {
    switch (X.m) {
        case 1: return kb_m<1>(A, band, X, y);
        case 2: return kb_m<2>(A, band, X, y);
        case 3: return kb_m<3>(A, band, X, y);
        case 4: return kb_m<4>(A, band, X, y);
        default: return kb_m<8>(A, band, X, y);
    }
}
}}
#include "kernel_time_main.h"
int main(int argc, char** argv) { return kernel_time_main(argc, argv, cpu_tier::avx512::kb_gemv); }
