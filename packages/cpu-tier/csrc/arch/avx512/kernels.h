// AVX-512 (F/BW/VL/DQ + VNNI + VBMI) band kernels: Ice Lake / Sapphire Rapids / Zen 4 and newer. Built twice: the
// avx512 variant, and (CT_EMU512) the test-only avx512emu variant, whose intrinsics are emulated in scalar C++
// (emu512.h) so AVX2-only machines still check these kernels' logic.
#pragma once

#if defined(CT_EMU512)
#include "../../emu512.h"
#endif
#include "../x86/common.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// One zmm per slot: [half 0 (8 lanes) | half 1 (8 lanes)], both from the slot's 32-byte register broadcast to
// the two 256-bit halves. Same tables and accumulator memory layout as AVX2.

template <bool UNIFORM, int S>
CT_INLINE __m512i slot_states16(__m512i L2, const TrellisTables& tb, __m512i sh, __m512i mask16) {
    __m512i v = _mm512_shuffle_epi8(L2, _mm512_load_si512(tb.ctrl[S]));
    v = _mm512_srlv_epi32(v, UNIFORM ? sh : _mm512_load_si512(tb.shift[S]));
    return _mm512_and_si512(v, mask16);
}

template <int BITS2, int S>
CT_INLINE __m512i slot_window2(const uint8_t* tile, const uint8_t* ext, __m128i wrapv, const TrellisTables& tb) {
    if constexpr (BITS2 != 0) {
        constexpr CtSlot sl = ct_slot(BITS2, S);
        if constexpr (sl.single)
            return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + sl.baseA)));
        else
            return _mm512_broadcast_i64x4(slot_window<BITS2, S>(tile, ext, wrapv, tb));
    } else {
        return _mm512_broadcast_i64x4(slot_window<BITS2, S>(tile, ext, wrapv, tb));
    }
}

template <int CB, bool ROUND>
CT_INLINE __m512 decode_values16(__m512i s) {
    if constexpr (CB == CB_MUL1) {
        __m512i p = _mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(MUL1_MULT)));
        p = _mm512_madd_epi16(_mm512_maddubs_epi16(p, _mm512_set1_epi8(1)), _mm512_set1_epi16(1));
        if constexpr (ROUND) {
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(MUL1_K_INV), _mm512_set1_ps(MUL1_K_AFF));
            return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            return _mm512_cvtepi32_ps(p);
        }
    } else {
        __m512i x = CB == CB_MCG ? _mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(MCG_MULT)))
                                 : _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(INST3_MULT))),
                                                    _mm512_set1_epi32(int32_t(INST3_ADD)));
        // (x & AND) ^ XOR in one ternary-logic op: imm = (A & B) ^ C = 0x6A
        x = _mm512_ternarylogic_epi32(x, _mm512_set1_epi32(int32_t(LOP3_AND)), _mm512_set1_epi32(int32_t(LOP3_XOR)), 0x6A);
        const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
        // bit select (A & C) | (B & ~C) with C = sign: ternary-logic imm 0xE4; then keep sign | exponent | mantissa
        const __m512i hi = _mm512_ternarylogic_epi32(x, _mm512_srli_epi32(x, 3), sign, 0xE4);
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi32(x, 16), _mm512_slli_epi32(x, 13), sign, 0xE4);
        const __m512i manexp_or_sign = _mm512_set1_epi32(int32_t(0x8FFFE000u));
        const __m512 f = _mm512_mul_ps(
            _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(hi, manexp_or_sign)),
                          _mm512_castsi512_ps(_mm512_and_si512(lo, manexp_or_sign))),
            _mm512_set1_ps(5.192296858534828e33f));  // 2^112
        if constexpr (ROUND) return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else return f;
    }
}

// The walk of one band call of the 16-bit-lane kernels (band_int16, band_amx): the band's walk (BandWalk) plus the
// masks that load a tile of any size <= 128 bytes into two zmm without reading past it (load_tile2).
struct Band16 : BandWalk {
    __mmask64 m0, m1;
    Band16(const MatRef& A, int band, const Acts& X, int tb) : BandWalk(A, band, X, tb) {
        m0 = tb >= 64 ? ~__mmask64(0) : ((__mmask64(1) << tb) - 1);
        m1 = tb <= 64 ? __mmask64(0) : (tb >= 128 ? ~__mmask64(0) : ((__mmask64(1) << (tb - 64)) - 1));
    }
};
template <int TB>
CT_INLINE Band16 band16(const MatRef& A, int band, const Acts& X) {
    return Band16(A, band, X, TB != 0 ? TB : A.tb->tile_bytes);
}

// The 16-bit-lane kernels' accumulators ([j][c0][16 dword lanes] of 8 x 8 column pairs) -> the band's 128 sums:
// dword lane D of (j, c0) holds column c0 for D % 4 in {0, 1}, column c0 + 8 for {2, 3}.
CT_INLINE void reduce_pair_acc(const float* facc, float* y) {
    for (int j = 0; j < 8; ++j)
        for (int c0 = 0; c0 < 8; ++c0) {
            const float* v = facc + (j * 8 + c0) * 16;
            float lo = 0.0f, hi = 0.0f;
            for (int q = 0; q < 4; ++q) {
                lo += v[4 * q] + v[4 * q + 1];
                hi += v[4 * q + 2] + v[4 * q + 3];
            }
            y[16 * j + c0] = lo;
            y[16 * j + c0 + 8] = hi;
        }
}

// MUL1 integer path on 16-bit lanes (K <= 4: the whole tile fits two zmm registers). Per 32 weights (one column
// pair c0 of a tile): vpermt2b + vpmultishiftqb extract 32 states; s * 0x83DCD12D mod 2^32 from three 16-bit
// multiplies (low half: lo16(s * 0xD12D); high half: hi16(s * 0xD12D) + lo16(s * 0x83DC)); two vpmaddubsw give
// the byte sums bs (int16); one vpdpwssd per token multiplies adjacent lanes (two rows of one column) by their
// int16 activations. Block order: 8 tile rows accumulate in registers, then one flush with the block's scale.
// Tile bytes 0..127 in two registers without reading past the tile: plain loads where whole, masked otherwise.
template <int TB>
CT_INLINE void load_tile2(const uint8_t* tile, int tbytes, __mmask64 m0, __mmask64 m1, __m512i& z0, __m512i& z1) {
    if constexpr (TB == 96) {  // K = 3
        z0 = _mm512_loadu_si512(tile);
        z1 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64)));
    } else if constexpr (TB == 128) {  // K = 4
        z0 = _mm512_loadu_si512(tile);
        z1 = _mm512_loadu_si512(tile + 64);
    } else if constexpr (TB == 64) {  // K = 2
        z0 = _mm512_loadu_si512(tile);
        z1 = z0;
    } else {
        (void)tbytes;
        z0 = _mm512_maskz_loadu_epi8(m0, tile);
        z1 = _mm512_maskz_loadu_epi8(m1, tile + 64);
    }
}

// VPERMB = true (the default): column pairs whose stream bytes lie in one in-tile 64-byte window
// (TrellisTables::vperm1_base) take one load there and a one-register vpermb instead of vpermt2b (2 port-cycles
// on Emerald Rapids' two 512-bit ports); the pairs that wrap the tile's end keep vpermt2b. Measured 7-14% faster
// on one core of Emerald Rapids, equal within noise on 16 (README).
// VPERMB = false, the benchmark's variants 1 and 2 (the former default forms): every pair takes vpermt2b on the
// whole tile in two registers. RELOAD = false (variant 2): GCC hoists the 8 rows' tiles out of the column-pair
// loop and copies a register per vpermt2b (it overwrites its table operand); true (variant 1): a compiler memory
// barrier per column pair makes it load the tiles afresh instead (no copies).
template <int M, int TB, bool RELOAD = false, bool VPERMB = true>
static void band_int16(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const Band16 g = band16<TB>(A, band, X);
    const int tbytes = g.tbytes;
    const size_t row_stride = g.row_stride;
    const __mmask64 m0 = g.m0, m1 = g.m1;
    constexpr int NACC = 8 * 8 * 16;  // [j][c0][16 dword lanes]
    alignas(64) float facc[M][NACC];
    alignas(64) __m512i xpat[8][M];
    std::memset(facc, 0, sizeof(facc));
    const __m512i ml = _mm512_set1_epi16(short(MUL1_MULT & 0xFFFF));
    const __m512i mh = _mm512_set1_epi16(short(MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1);
    // activation word of lane L: q-order position 4 (L / 8) + L % 4 of the tile row
    alignas(64) static const uint16_t xidx_tab[32] = {0,  1,  2,  3,  0,  1,  2,  3,  4,  5,  6,  7,  4,  5,  6,  7,
                                                      8,  9,  10, 11, 8,  9,  10, 11, 12, 13, 14, 15, 12, 13, 14, 15};
    const __m512i xidx = _mm512_load_si512(xidx_tab);
    g.start();
    for (int blk = g.r0 / 8; blk < g.r1 / 8; ++blk) {
        const uint8_t* brow = g.block(blk);
        for (int rr = 0; rr < 8; ++rr) {
            for (int t = 0; t < M; ++t) {
                const int16_t* xr = X.xq + t * X.xq_stride + 16 * (8 * blk + rr);
                xpat[rr][t] = _mm512_permutexvar_epi16(
                    xidx, _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))));
            }
        }
        __m512 sc[M];
        for (int t = 0; t < M; ++t) sc[t] = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
        for (int j = 0; j < 8; ++j) {
            g.at(blk, j);
            for (int c0 = 0; c0 < 8; ++c0) {
                if constexpr (RELOAD) __asm__ volatile("" ::: "memory");
                const __m512i perm = _mm512_load_si512(tb.perm16[c0]);
                const __m512i msh = _mm512_load_si512(tb.mshift16[c0]);
                const int vb = VPERMB && TB != 0 ? tb.vperm1_base[c0] : -1;
                const __m512i perm1 = _mm512_load_si512(tb.perm1[c0]);
                __m512i acc[M];
                for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                    __m512i st;
                    if (vb >= 0) {  // [tile + vb, tile + vb + 64) lies inside the tile (vperm1_base)
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutexvar_epi8(perm1, _mm512_loadu_si512(tile + vb)));
                    } else {
                        __m512i z0, z1;
                        load_tile2<TB>(tile, tbytes, m0, m1, z0, z1);
                        st = _mm512_multishift_epi64_epi8(msh, _mm512_permutex2var_epi8(z0, perm, z1));
                    }
                    const __m512i plo = _mm512_mullo_epi16(st, ml);
                    const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                    const __m512i bs = _mm512_add_epi16(_mm512_maddubs_epi16(plo, ones8), _mm512_maddubs_epi16(phi, ones8));
                    for (int t = 0; t < M; ++t) acc[t] = _mm512_dpwssd_epi32(acc[t], bs, xpat[rr][t]);
                }
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 8 + c0) * 16;
                    _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), sc[t], _mm512_load_ps(f)));
                }
            }
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_pair_acc(facc[t], y + 128 * t);
        int_affine(y + 128 * t, X, t);
    }
}


template <int BITS2, bool UNIFORM>
static void band_int1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[8 * 4 * 16];
    alignas(64) int32_t iacc[8 * 4 * 16];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i mult = _mm512_set1_epi32(int32_t(MUL1_MULT));
    const __m512i ones8 = _mm512_set1_epi8(1);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    auto flush = [&](int blk) {
        const __m512 sc = _mm512_set1_ps(X.xs[blk]);
        for (int i = 0; i < 8 * 4 * 16; i += 16) {
            const __m512i v = _mm512_load_si512(iacc + i);
            _mm512_store_ps(facc + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, _mm512_load_ps(facc + i)));
            _mm512_store_si512(iacc + i, _mm512_setzero_si512());
        }
    };
    w.start_rows();
    for (int r = w.r0; r < w.r1; ++r) {
        if (r > w.r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = w.row(r);
        w.fetch_ahead(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        __m512i xp[4];
        for (int q = 0; q < 4; ++q) {
            int64_t v;
            std::memcpy(&v, X.xq + 16 * r + 4 * q, 8);
            const __m512i b = _mm512_set1_epi64(v);
            xp[q] = _mm512_unpacklo_epi16(b, b);
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            int32_t* ia = iacc + j * 64;
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512i acc;
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m512i L2 = slot_window2<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    __m512i v = slot_states16<UNIFORM, 4 * a + q>(L2, tb, sh, mask16);
                    v = _mm512_maddubs_epi16(_mm512_mullo_epi32(v, mult), ones8);
                    acc = q == 0 ? _mm512_madd_epi16(v, xp[q]) : _mm512_dpwssd_epi32(acc, v, xp[q]);
                });
                _mm512_store_si512(ia + a * 16, _mm512_add_epi32(_mm512_load_si512(ia + a * 16), acc));
            });
        }
    }
    flush((w.r1 - 1) / 8);
    reduce_tile_acc(facc, y);
    const float s = MUL1_K_AFF * X.xsum[0];
    if (!X.raw)
        for (int c = 0; c < 128; ++c) y[c] = y[c] * MUL1_K_INV + s;
}

template <int M, int BITS2, bool UNIFORM>
static void band_intm(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    constexpr int NACC = 8 * 4 * 16;  // [j][a][16 lanes = 2 halves x 8]
    alignas(64) float facc[M][NACC];
    alignas(64) int32_t iacc[M][NACC];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    alignas(64) __m512i xpp[M][2];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i mult = _mm512_set1_epi32(int32_t(MUL1_MULT));
    const __m512i ones8 = _mm512_set1_epi8(1);
    const __m512i ones16 = _mm512_set1_epi16(1);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    auto flush = [&](int blk) {
        for (int t = 0; t < M; ++t) {
            const __m512 sc = _mm512_set1_ps(X.xs[t * X.xs_stride + blk]);
            for (int i = 0; i < NACC; i += 16) {
                const __m512i v = _mm512_load_si512(iacc[t] + i);
                _mm512_store_ps(facc[t] + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, _mm512_load_ps(facc[t] + i)));
                _mm512_store_si512(iacc[t] + i, _mm512_setzero_si512());
            }
        }
    };
    w.start_rows();
    for (int r = w.r0; r < w.r1; ++r) {
        if (r > w.r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = w.row(r);
        w.fetch_ahead(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        for (int t = 0; t < M; ++t)
            for (int pq = 0; pq < 2; ++pq) {
                int64_t v0, v1;
                std::memcpy(&v0, X.xq + t * X.xq_stride + 16 * r + 8 * pq, 8);
                std::memcpy(&v1, X.xq + t * X.xq_stride + 16 * r + 8 * pq + 4, 8);
                xpp[t][pq] = _mm512_unpacklo_epi16(_mm512_set1_epi64(v0), _mm512_set1_epi64(v1));
            }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512i acc[M];
                static_for<2>([&](auto PP) CT_LAMBDA_INLINE {
                    constexpr int pq = decltype(PP)::value;
                    constexpr int s0 = 4 * a + 2 * pq, s1 = s0 + 1;
                    __m512i b0 = slot_states16<UNIFORM, s0>(slot_window2<BITS2, s0>(tile, e, wrapv, tb), tb, sh, mask16);
                    __m512i b1 = slot_states16<UNIFORM, s1>(slot_window2<BITS2, s1>(tile, e, wrapv, tb), tb, sh, mask16);
                    b0 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_mullo_epi32(b0, mult), ones8), ones16);
                    b1 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_mullo_epi32(b1, mult), ones8), ones16);
                    const __m512i w = _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16));
                    for (int t = 0; t < M; ++t)
                        acc[t] = pq == 0 ? _mm512_madd_epi16(w, xpp[t][0]) : _mm512_dpwssd_epi32(acc[t], w, xpp[t][1]);
                });
                for (int t = 0; t < M; ++t) {
                    int32_t* pi = iacc[t] + (j * 4 + a) * 16;
                    _mm512_store_si512(pi, _mm512_add_epi32(_mm512_load_si512(pi), acc[t]));
                }
            });
        }
    }
    flush((w.r1 - 1) / 8);
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        int_affine(y + 128 * t, X, t);
    }
}

// ------------------------------------------------------------------- exact MUL1, 1 to 8 tokens, compile-time K
// AVX2's band_exact_mul1 (arch/avx2/kernels.h: the derivation) on 16 lanes, in its block order (the accumulators
// stay in registers over a block's 8 tile rows; band_float below flushes them to memory every row): the values as
// round11(N) + MUL1_N_OFF from Mf = float(1774 bs) by one FMA and two subtracts (Veltkamp's split, the offset folded
// in) instead of the F16C round trip (vcvtps2ph + vcvtph2ps: two uops each on Intel's 512-bit ports), each row's
// offset out of every token's sums at once, the integer decode of the slot one or two ahead issued before this
// slot's rounding and FMAs (32 zmm registers: room for 8 tokens' accumulators). The same fp16 values (decode_exact index
// DECODE_MUL1_SPLIT, checked bit for bit on every state), every product 2^18 times the plain path's.
CT_INLINE __m512 round_half_split16(__m512 f, __m512 c) {
#if !defined(CT_EMU512)
    __asm__("" : "+v"(c));  // c stays the rounded product: no contraction of c - (c - f) into an FMA of it
#endif
    return _mm512_sub_ps(c, _mm512_sub_ps(c, f));
}
// 16 masked states -> Mf = float(1774 bs) = N + MUL1_N_OFF (exact).
CT_INLINE __m512 mul1_shifted16(__m512i s) {
    const __m512i p = _mm512_mullo_epi32(s, _mm512_set1_epi32(int32_t(MUL1_MULT)));
    return _mm512_cvtepi32_ps(
        _mm512_madd_epi16(_mm512_maddubs_epi16(p, _mm512_set1_epi8(1)), _mm512_set1_epi16(short(MUL1_N_MULT))));
}
// Mf = N + MUL1_N_OFF -> round11(N) + MUL1_N_OFF, exactly.
CT_INLINE __m512 round_half_off16(__m512 mf) {
    return round_half_split16(mf, _mm512_fmadd_ps(mf, _mm512_set1_ps(VELTKAMP_HALF),
                                                  _mm512_set1_ps(-VELTKAMP_HALF * float(MUL1_N_OFF))));
}
// The exact values of 16 masked states as band_exact_mul1 computes them (decode_exact's DECODE_MUL1_SPLIT).
CT_INLINE __m512 mul1_split_values16(__m512i s) {
    return _mm512_mul_ps(_mm512_sub_ps(round_half_off16(mul1_shifted16(s)), _mm512_set1_ps(float(MUL1_N_OFF))),
                         _mm512_set1_ps(1.0f / MUL1_N_UNIT));
}
template <int BITS2, bool UNIFORM, int S>
CT_INLINE __m512 sp_decode16(const uint8_t* tile, __m128i wrapv, const TrellisTables& tb, __m512i sh, __m512i mask16) {
    return mul1_shifted16(slot_states16<UNIFORM, S>(slot_window2<BITS2, S>(tile, nullptr, wrapv, tb), tb, sh, mask16));
}

template <int M, int BITS2, bool UNIFORM>
static void band_exact_mul1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = 16 * BITS2;
    static_assert(BITS2 != 0 && M >= 1 && M <= 8, "compile-time window offsets, one to eight tokens");
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[M][8 * 4 * 16];
    alignas(64) __m512 xp[8][M][4];
    alignas(64) __m512 xoff[8][M];  // [row rr][token t]: MUL1_N_OFF x the activations of each lane's 4 rows
    std::memset(facc, 0, sizeof(facc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    const size_t row_stride = w.row_stride;
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr)
            for (int t = 0; t < M; ++t) {
                __m512 xsum = _mm512_setzero_ps();
                for (int q = 0; q < 4; ++q) {
                    xp[rr][t][q] = _mm512_broadcast_f32x4(_mm_loadu_ps(X.xf + t * X.xf_stride + 16 * (8 * blk + rr) + 4 * q));
                    xsum = _mm512_add_ps(xsum, xp[rr][t][q]);
                }
                __m512 off = _mm512_mul_ps(xsum, _mm512_set1_ps(float(MUL1_N_OFF)));
#if !defined(CT_EMU512)
                __asm__("" : "+v"(off));  // a rounded product: never contracted with the row's subtract into an FMA
#endif
                xoff[rr][t] = off;
            }
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512 acc[M];
                for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
                const uint8_t* tile = brow + j * tbytes;
                __m128i wrapv = _mm_setzero_si128();
                if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                // decoded D slots ahead: one at 1 token (1.02-1.07x two there), two from 2 tokens (1.02-1.05x one
                // at 4 and 8; equal at 2 and 3), Zen 4
                constexpr int D = M == 1 ? 1 : 2;
                __m512 cur = sp_decode16<BITS2, UNIFORM, 4 * a>(tile, wrapv, tb, sh, mask16);
                __m512 cur2 = cur;
                if constexpr (D == 2) cur2 = sp_decode16<BITS2, UNIFORM, 4 * a + 1>(tile, wrapv, tb, sh, mask16);
#pragma GCC unroll 1
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* ntile = rr < 7 ? tile + row_stride : tile;
                    __m128i nwrap = _mm_setzero_si128();
                    if constexpr (ct_needs_wrap<BITS2>()) nwrap = wrap_window(ntile, tbytes);
                    static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                        constexpr int q = decltype(QQ)::value;
                        // slot q + D of this row, or of the next (the last row's: its own first slots again, unused)
                        __m512 nxt;
                        if constexpr (q + D < 4) nxt = sp_decode16<BITS2, UNIFORM, 4 * a + q + D>(tile, wrapv, tb, sh, mask16);
                        else nxt = sp_decode16<BITS2, UNIFORM, 4 * a + q + D - 4>(ntile, nwrap, tb, sh, mask16);
                        const __m512 v = round_half_off16(cur);
                        if constexpr (D == 2) {
                            cur = cur2;
                            cur2 = nxt;
                        } else {
                            cur = nxt;
                        }
                        for (int t = 0; t < M; ++t) acc[t] = _mm512_fmadd_ps(v, xp[rr][t][q], acc[t]);
                    });
                    for (int t = 0; t < M; ++t) acc[t] = _mm512_sub_ps(acc[t], xoff[rr][t]);
                    tile = ntile;
                    wrapv = nwrap;
                }
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 4 + a) * 16;
                    _mm512_store_ps(f, _mm512_add_ps(_mm512_load_ps(f), acc[t]));
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        for (int c = 0; c < 128; ++c) y[128 * t + c] *= 1.0f / MUL1_N_UNIT;
    }
}

// M tokens, float activations, values decoded once per slot (exact fp16 values, or without the final fp16 rounding
// for MCG / 3INST "fast"), row order. GENERIC: this loop even where band_exact_mul1 applies (the benchmark's A/B,
// scripts/avx512_kernel_time.cpp).
template <int CB, int M, bool ROUND, int BITS2, bool UNIFORM, bool GENERIC = false>
static void band_float(const MatRef& A, int band, const Acts& X, float* y) {
    if constexpr (!GENERIC && CB == CB_MUL1 && ROUND && BITS2 != 0)
        return band_exact_mul1<M, BITS2, UNIFORM>(A, band, X, y);
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[M][8 * 4 * 16];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    alignas(64) __m512 xp[M][4];
    std::memset(facc, 0, sizeof(facc));
    const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
    const __m512i sh = _mm512_load_si512(tb.shift[0]);
    w.start_rows();
    for (int r = w.r0; r < w.r1; ++r) {
        const uint8_t* row = w.row(r);
        w.fetch_ahead(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        for (int t = 0; t < M; ++t)
            for (int q = 0; q < 4; ++q)
                xp[t][q] = _mm512_broadcast_f32x4(_mm_loadu_ps(X.xf + t * X.xf_stride + 16 * r + 4 * q));
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m512 acc[M];
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m512i L2 = slot_window2<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    const __m512 v = decode_values16<CB, ROUND>(slot_states16<UNIFORM, 4 * a + q>(L2, tb, sh, mask16));
                    for (int t = 0; t < M; ++t)
                        acc[t] = q == 0 ? _mm512_mul_ps(v, xp[t][0]) : _mm512_fmadd_ps(v, xp[t][q], acc[t]);
                });
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 4 + a) * 16;
                    _mm512_store_ps(f, _mm512_add_ps(_mm512_load_ps(f), acc[t]));
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) reduce_tile_acc(facc[t], y + 128 * t);
    if constexpr (CB == CB_MUL1 && !ROUND)
        for (int t = 0; t < M; ++t) {
            int_affine(y + 128 * t, X, t);
        }
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
