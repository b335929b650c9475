// AVX-512 + AMX-INT8 band kernel (Sapphire Rapids and newer; emulated in the avx512emu build, amx.h).
#pragma once

#include "../../amx.h"
#include "kernels.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

#if defined(CT_HAVE_AMX)
// MUL1 integer path with AMX-INT8 (K <= 4). The vector units only decode: per tile (256 weights) four vpermt2b
// (one per two registers, TrellisTables::amx_perm) + eight vpmultishiftqb extract the states of 8 row pairs x 16
// columns, three 16-bit multiplies form lo16 / hi16 of s * 0x83DCD12D (plo, phi), and 16 stores stage them as one
// 16 x 64-byte B tile: row p (0..7) = plo of q-order rows (2p, 2p + 1), row 8 + p = their phi, dword n' = the two
// rows of column n'/2 + 8 (n' & 1). The tile unit does the byte sums and the activation products in one TDPBSUD:
// A row 2t (token t) = the high bytes ah of the int16 activations, row 2t + 1 = the low bytes al
// (x = 256 ah + al, al in [-128, 127]; prep_block_int keeps |x| <= 32639 so ah fits int8 too), each byte twice
// (the two rows of a dword), the 32-byte pattern twice (plo rows, phi rows). So C[2t][n'] = sum ah * bs and
// C[2t + 1][n'] = sum al * bs, exact int32 per 128-row block, as in band_int16; the block's scale is applied at
// the flush.
// Software pipeline over columns s = (block, tile column j), 8 tiles each: decode column s + 1 into one staging
// buffer, then the tile work of column s from the other, then the flush of column s - 1. A tile load never reads
// stores younger than a whole decode phase (tile loads do not take store forwarding: a load right after its
// stores waits for them to reach L1; the first form of this kernel did that per tile and ran at 0.31 cycles per
// weight). Tiles: tmm0 = C (one accumulator: one TILESTORED per column), tmm2/3 = A, tmm4..7 = B.
// Measured on Emerald Rapids (README, results/h200host_run7_*): the tile unit runs its work in order (~27 cycles
// per 256 weights at m = 1: TILELOADD 1 KiB ~9, TDPBSUD ~10) and it does not overlap the vector decode (~29), so
// this kernel is not faster than band_int16 at m = 1; at m = 8 (same tile cost, no per-token vector work) it is.
#define CT_AMX_STEP(RR, CT, AT, BT)                      \
    do {                                                 \
        CT_TILE_LOADD(BT, stg[RR][0], 64);               \
        CT_TILE_LOADD(AT, ab[RR][0], 64);                \
        CT_TILE_DPBSUD(CT, AT, BT);                      \
    } while (0)

template <int M, int TB>
static void band_amx(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const Band16 g = band16<TB>(A, band, X);
    const int tbytes = g.tbytes;
    const size_t row_stride = g.row_stride;
    const __mmask64 m0 = g.m0, m1 = g.m1;
    alignas(64) int8_t abuf[2][8][2 * M][64];      // activations, by block parity
    alignas(64) uint8_t stage[2][8][16][64];       // B tiles of a column's 8 tiles, by column parity
    alignas(64) int32_t cbuf[2][2 * M][16];        // the C tile stored for the flush, by column parity
    alignas(64) float facc[M][8][16];
    std::memset(facc, 0, sizeof(facc));
    const __m512i ml = _mm512_set1_epi16(short(MUL1_MULT & 0xFFFF));
    const __m512i mh = _mm512_set1_epi16(short(MUL1_MULT >> 16));
    __m512i perm[4], msh[8];
    for (int i = 0; i < 4; ++i) perm[i] = _mm512_load_si512(tb.amx_perm[i]);
    for (int i = 0; i < 8; ++i) msh[i] = _mm512_load_si512(tb.amx_mshift[i]);
    const int blk_first = g.r0 / 8, S = 8 * (g.r1 / 8 - blk_first);  // columns of this call

    auto build_acts = [&](int blk) {
        const __m256i c128 = _mm256_set1_epi16(128), lo8 = _mm256_set1_epi16(0xFF), dup = _mm256_set1_epi16(0x0101);
        for (int rr = 0; rr < 8; ++rr)
            for (int t = 0; t < M; ++t) {
                const __m256i x = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(X.xq + t * X.xq_stride + 16 * (8 * blk + rr)));
                const __m256i ah = _mm256_srai_epi16(_mm256_add_epi16(x, c128), 8);
                const __m256i al = _mm256_sub_epi16(x, _mm256_slli_epi16(ah, 8));
                const __m256i dh = _mm256_mullo_epi16(_mm256_and_si256(ah, lo8), dup);  // word = its low byte twice
                const __m256i dl = _mm256_mullo_epi16(_mm256_and_si256(al, lo8), dup);
                int8_t* a = abuf[blk & 1][rr][2 * t];
                _mm256_store_si256(reinterpret_cast<__m256i*>(a), dh);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 32), dh);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 64), dl);
                _mm256_store_si256(reinterpret_cast<__m256i*>(a + 96), dl);
            }
    };
    auto decode_column = [&](int s) {
        const int blk = blk_first + s / 8, j = s % 8;
        const uint8_t* brow = g.block(blk);
        g.at(blk, j);
#pragma GCC unroll 2
        for (int rr = 0; rr < 8; ++rr) {
            __m512i z0, z1;
            load_tile2<TB>(brow + rr * row_stride + j * tbytes, tbytes, m0, m1, z0, z1);
            uint8_t* bt = stage[s & 1][rr][0];
#pragma GCC unroll 4
            for (int qp = 0; qp < 4; ++qp) {
                const __m512i s2 = _mm512_permutex2var_epi8(z0, perm[qp], z1);
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    const __m512i st = _mm512_multishift_epi64_epi8(msh[2 * qp + h], s2);
                    const __m512i plo = _mm512_mullo_epi16(st, ml);
                    const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                    _mm512_store_si512(bt + 64 * (2 * qp + h), plo);
                    _mm512_store_si512(bt + 64 * (8 + 2 * qp + h), phi);
                }
            }
        }
    };
    auto tile_column = [&](int s) {
        const int blk = blk_first + s / 8;
        const uint8_t(*stg)[16][64] = stage[s & 1];
        const int8_t(*ab)[2 * M][64] = abuf[blk & 1];
        CT_TILE_ZERO(0);
        CT_AMX_STEP(0, 0, 2, 4);
        CT_AMX_STEP(1, 0, 3, 5);
        CT_AMX_STEP(2, 0, 2, 6);
        CT_AMX_STEP(3, 0, 3, 7);
        CT_AMX_STEP(4, 0, 2, 4);
        CT_AMX_STEP(5, 0, 3, 5);
        CT_AMX_STEP(6, 0, 2, 6);
        CT_AMX_STEP(7, 0, 3, 7);
        CT_TILE_STORED(0, cbuf[s & 1], 64);
    };
    auto flush_column = [&](int s) {
        const int blk = blk_first + s / 8, j = s % 8;
        const __m512 s256 = _mm512_set1_ps(256.0f);
        const int32_t(*cb)[16] = cbuf[s & 1];
        for (int t = 0; t < M; ++t) {
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[2 * t])), s256,
                                             _mm512_cvtepi32_ps(_mm512_load_si512(cb[2 * t + 1])));
            const __m512 sc = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
            _mm512_store_ps(facc[t][j], _mm512_fmadd_ps(v, sc, _mm512_load_ps(facc[t][j])));
        }
    };

    if (S > 0) {
        TileConfig cfg;
        for (int t = 0; t < 4; ++t) {
            cfg.rows[t] = uint8_t(2 * M);
            cfg.colsb[t] = 64;
        }
        for (int t = 4; t < 8; ++t) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        CT_TILE_LOADCONFIG(&cfg);
        g.start();
        build_acts(blk_first);
        decode_column(0);
        for (int s = 0; s < S; ++s) {
            if (s + 1 < S) {
                if ((s + 1) % 8 == 0) build_acts(blk_first + (s + 1) / 8);
                decode_column(s + 1);
            }
            if (s >= 1) flush_column(s - 1);
            tile_column(s);
        }
        flush_column(S - 1);
        CT_TILE_RELEASE();
    }
    for (int t = 0; t < M; ++t) {
        for (int j = 0; j < 8; ++j)
            for (int n = 0; n < 16; ++n) y[t * 128 + 16 * j + (n >> 1) + 8 * (n & 1)] = facc[t][j][n];
        int_affine(y + 128 * t, X, t);
    }
}
#undef CT_AMX_STEP
#endif

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
