// AVX2 (+ FMA + F16C) band kernels: Haswell / Zen and newer.
#pragma once

#include "../x86/common.h"

namespace cpu_tier {
namespace CPU_TIER_NS {


// f rounded to fp16's precision (11 significant bits, to nearest, ties to even), given c = f * 8193 rounded to fp32:
// Veltkamp's split, c - (c - f) (VELTKAMP_HALF, x86/common.h). Two FP subtracts and (round_half) one multiply
// instead of the F16C round trip (cvtps2ph + cvtph2ps): exact kernel 1.05-1.14x faster on Zen 5 (results/devbox_zen5_exact_rounding.txt).
// Equal to the fp16 conversion for every value the codebooks produce (none is below fp16's normal range, where
// fewer bits remain): all 65,536 states of MCG and 3INST and the 1,021 MUL1 byte sums, checked bit for bit
// (tests/test_cpu_tier_kernels.py::test_exact_codebook_values_bit_for_bit).
CT_INLINE __m256 round_half_split(__m256 f, __m256 c) {
    __asm__("" : "+x"(c));  // c stays the rounded product: no contraction of c - (c - f) into an FMA of it
    return _mm256_sub_ps(c, _mm256_sub_ps(c, f));
}

CT_INLINE __m256 round_half(__m256 f) { return round_half_split(f, _mm256_mul_ps(f, _mm256_set1_ps(VELTKAMP_HALF))); }

// Float values of 8 masked states. MUL1 without rounding: the byte sum itself (the caller applies the affine map).
template <int CB, bool ROUND>
CT_INLINE __m256 decode_values(__m256i s) {
    if constexpr (CB == CB_MUL1) {
        __m256i p = _mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(MUL1_MULT)));
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(p, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
        if constexpr (ROUND) {  // f = bs K_INV + K_AFF is exact in fp32, so one FMA of bs also gives c = RN(8193 f)
            const __m256 b = _mm256_cvtepi32_ps(p);
            return round_half_split(_mm256_fmadd_ps(b, _mm256_set1_ps(MUL1_K_INV), _mm256_set1_ps(MUL1_K_AFF)),
                                    _mm256_fmadd_ps(b, _mm256_set1_ps(MUL1_K_INV * VELTKAMP_HALF),
                                                    _mm256_set1_ps(MUL1_K_AFF * VELTKAMP_HALF)));
        } else
            return _mm256_cvtepi32_ps(p);
    } else {
        __m256i x = CB == CB_MCG ? _mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(MCG_MULT)))
                                 : _mm256_add_epi32(_mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(INST3_MULT))),
                                                    _mm256_set1_epi32(int32_t(INST3_ADD)));
        x = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(LOP3_AND))),
                             _mm256_set1_epi32(int32_t(LOP3_XOR)));
        // Both fp16 halves to fp32 by moving their bits (all values are normal, exponent 12..15), * 2^112.
        const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
        const __m256i manexp = _mm256_set1_epi32(0x0FFFE000);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(x, sign), _mm256_and_si256(_mm256_srli_epi32(x, 3), manexp));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(x, 16), sign),
                                           _mm256_and_si256(_mm256_slli_epi32(x, 13), manexp));
        const __m256 f = _mm256_mul_ps(_mm256_add_ps(_mm256_castsi256_ps(hi), _mm256_castsi256_ps(lo)),
                                       _mm256_set1_ps(5.192296858534828e33f));  // 2^112
        return ROUND ? round_half(f) : f;
    }
}


// 8 masked states of (slot S, half H) from the slot register.
template <bool UNIFORM, int S, int H>
CT_INLINE __m256i slot_states(__m256i L, const TrellisTables& tb, __m256i sh, __m256i mask16) {
    __m256i v = _mm256_shuffle_epi8(L, _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.ctrl[S][H])));
    v = _mm256_srlv_epi32(v, UNIFORM ? sh : _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[S][H])));
    return _mm256_and_si256(v, mask16);
}

// ------------------------------------------------------------------------------------------------ pair form
// The MUL1 integer path (the default for every K and token count; band_int1 / band_intm below are the former forms,
// kept as the benchmark's A/B variant 1). Per slot (16 weights): one vpshufb gathers, in each dword, the 4 stream
// bytes that hold two consecutive elements t, t + 1 (rows 2p, 2p + 1 of one column: TrellisTables::pair_ctrl);
// vpsrlvd leaves t's state in bits 0..15, vpsllvd puts t + 1's in bits 16..31, vpblendw keeps both (4 ops for 16
// states, no mask); s * 0x83DCD12D from three 16-bit multiplies (low half lo16(s * 0xD12D), high half
// hi16(s * 0xD12D) + lo16(s * 0x83DC)); two vpmaddubsw + one add give the byte sums bs as int16; one vpmaddwd per
// token multiplies a row pair by its two int16 activations and adds them. 13 vector ops per 16 weights at one token
// (the former form: 14), 6 of them multiplies, + 2 per further token (former: 3.5).
// Block order: for each 128-row block (8 tile rows, L1 resident) every (tile, column pair-pair a) sums its 8 rows x 4
// slots in registers, flushed once with the block's per-token scale. Exact int32 sums: a dword lane accumulates
// 64 rows of a block, |sum| <= 64 * 1005 * 32639 = 2.10e9 < 2^31 (1005: the largest byte sum of any state).
struct PairConsts {
    __m256i mlo, mhi, ones8, srl, sll;
};

// The 16 states of slot S, as int16 byte sums bs (dword d = 4 L + i: [bs(t) | bs(t + 1)], see pair_ctrl).
template <int BITS2, bool UNIFORM, int S>
CT_INLINE __m256i pair_bytesums(const uint8_t* tile, const uint8_t* e, int tbytes, const TrellisTables& tb,
                                const PairConsts& K) {
    __m128i wrapv = _mm_setzero_si128();
    if constexpr (BITS2 != 0) {
        constexpr CtSlot sl = ct_slot(BITS2, S);
        if constexpr (!sl.single && (sl.baseA < 0 || sl.baseB < 0)) wrapv = wrap_window(tile, tbytes);
    }
    (void)tbytes;
    const __m256i L = slot_window<BITS2, S>(tile, e, wrapv, tb);
    const __m256i v = _mm256_shuffle_epi8(L, _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.pair_ctrl[S])));
    const __m256i lo = _mm256_srlv_epi32(v, UNIFORM ? K.srl : _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.pair_srl[S])));
    const __m256i hi = _mm256_sllv_epi32(v, UNIFORM ? K.sll : _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.pair_sll[S])));
    const __m256i st = _mm256_blend_epi16(lo, hi, 0xAA);
    const __m256i plo = _mm256_mullo_epi16(st, K.mlo);
    const __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, K.mlo), _mm256_mullo_epi16(st, K.mhi));
    return _mm256_add_epi16(_mm256_maddubs_epi16(plo, K.ones8), _mm256_maddubs_epi16(phi, K.ones8));
}

template <int M, int BITS2, bool UNIFORM>
static void band_pair(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    const size_t row_stride = w.row_stride;
    alignas(64) float facc[M][8][4][8];            // [token][tile j][a][dword]
    alignas(64) __m256i xb[8][4][M];                // [row rr][q][token]: (x_2q, x_2q+1, x_2q+8, x_2q+9) x 4
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * 8 * EXT_STRIDE : 16];
    std::memset(facc, 0, sizeof(facc));
    PairConsts K;
    K.mlo = _mm256_set1_epi16(short(MUL1_MULT & 0xFFFF));
    K.mhi = _mm256_set1_epi16(short(MUL1_MULT >> 16));
    K.ones8 = _mm256_set1_epi8(1);
    K.srl = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.pair_srl[0]));
    K.sll = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.pair_sll[0]));
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr) {
            if constexpr (BITS2 == 0) copy_row_ext(brow + rr * row_stride, tbytes, ext + rr * 8 * EXT_STRIDE);
            for (int q = 0; q < 4; ++q)
                for (int t = 0; t < M; ++t) {
                    int64_t v;
                    std::memcpy(&v, X.xq + t * X.xq_stride + 16 * (8 * blk + rr) + 4 * q, 8);
                    xb[rr][q][t] = _mm256_set1_epi64x(v);
                }
        }
        __m256 sc[M];
        for (int t = 0; t < M; ++t) sc[t] = _mm256_set1_ps(X.xs[t * X.xs_stride + blk]);
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);  // block blk + D, one row per tile column, spread over the block's work
            // AG column pair-pairs (a, ..., a + AG - 1) at a time: 4 AG independent slots per row (AG = 2 up to two
            // tokens; with more tokens the AG x M accumulators would not fit the 16 registers)
            constexpr int AG = M <= 2 ? 2 : 1;
            // Software pipelining: each slot's byte sums are computed D = 2 slots ahead of their multiply-adds (a
            // ring of D registers; a row's last slots decode the next row's first ones). Zen 4, the kernel alone
            // against no pipelining: D = 1 1.03x / 0.99x / 1.02x / 1.03x / 1.05x at m = 1 / 2 / 3 / 4 / 8, D = 2
            // 1.05x / 1.02x / 1.06x / 1.08x / 1.10x, D = 4 1.05x / 1.00x / 1.06x / 1.08x / 1.07x
            // (results/devbox_zen4_pair_pipelined.txt).
            constexpr int NS = 4 * AG;  // slots per row, (q, h) with h fastest
            constexpr int D = 2;
            static_assert(D >= 1 && NS % D == 0, "the pipeline depth must divide the slots per row");
            static_for<4 / AG>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a0 = AG * decltype(AA)::value;
                __m256i acc[AG][M];
                for (int h = 0; h < AG; ++h)
                    for (int t = 0; t < M; ++t) acc[h][t] = _mm256_setzero_si256();
                const uint8_t* tile = brow + j * tbytes;
                const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
                __m256i ring[D];
                static_for<D>([&](auto KK) CT_LAMBDA_INLINE {
                    constexpr int k = decltype(KK)::value;
                    ring[k] = pair_bytesums<BITS2, UNIFORM, 4 * (a0 + k % AG) + k / AG>(tile, e, tbytes, tb, K);
                });
                // rows in a loop, the slots of a row unrolled
#pragma GCC unroll 1
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* ntile = rr < 7 ? tile + row_stride : tile;
                    const uint8_t* ne = rr < 7 ? e + (BITS2 == 0 ? 8 * EXT_STRIDE : 0) : e;
                    static_for<NS>([&](auto II) CT_LAMBDA_INLINE {
                        constexpr int i = decltype(II)::value;
                        constexpr int q = i / AG, h = i % AG;
                        const __m256i bs = ring[i % D];
                        constexpr int n = i + D;  // the slot decoded in its place
                        if constexpr (n < NS)
                            ring[i % D] = pair_bytesums<BITS2, UNIFORM, 4 * (a0 + n % AG) + n / AG>(tile, e, tbytes, tb, K);
                        else if (rr < 7)
                            ring[i % D] = pair_bytesums<BITS2, UNIFORM, 4 * (a0 + (n - NS) % AG) + (n - NS) / AG>(
                                ntile, ne, tbytes, tb, K);
                        for (int t = 0; t < M; ++t) {
                            acc[h][t] = _mm256_add_epi32(acc[h][t], _mm256_madd_epi16(bs, xb[rr][q][t]));
                            // keep each sum in one register, in order (GCC otherwise reassociates the integer
                            // adds into trees whose partial sums spill to the stack)
                            __asm__("" : "+x"(acc[h][t]));
                        }
                    });
                    tile = ntile;
                    e = ne;
                }
                for (int h = 0; h < AG; ++h)
                    for (int t = 0; t < M; ++t) {
                        float* f = facc[t][j][a0 + h];
                        _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][t]), sc[t], _mm256_load_ps(f)));
                    }
            });
        }
    }
    for (int t = 0; t < M; ++t) {
        // dword d = 4 L + i of (j, a): column 2a + L + 8 (i >> 1), rows of class i & 1 (added here)
        for (int j = 0; j < 8; ++j)
            for (int a = 0; a < 4; ++a)
                for (int L = 0; L < 2; ++L)
                    for (int h = 0; h < 2; ++h) {
                        const float* v = facc[t][j][a] + 4 * L + 2 * h;
                        y[t * 128 + 16 * j + 2 * a + L + 8 * h] = v[0] + v[1];
                    }
        int_affine(y + 128 * t, X, t);
    }
}

// ------------------------------------------------------------------------------- former forms (variant 1)
// One token, MUL1, int16 activations (per 128-block scale), int32 sums per block.
template <int BITS2, bool UNIFORM>
static void band_int1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[8 * 4 * 2 * 8];
    alignas(64) int32_t iacc[8 * 4 * 2 * 8];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * EXT_STRIDE : 16];
    std::memset(facc, 0, sizeof(facc));
    std::memset(iacc, 0, sizeof(iacc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
    const __m256i mult = _mm256_set1_epi32(int32_t(MUL1_MULT));
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    auto flush = [&](int blk) {
        const __m256 sc = _mm256_set1_ps(X.xs[blk]);
        for (int i = 0; i < 8 * 4 * 2 * 8; i += 8) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(iacc + i));
            _mm256_store_ps(facc + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, _mm256_load_ps(facc + i)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(iacc + i), _mm256_setzero_si256());
        }
    };
    w.start_rows();
    for (int r = w.r0; r < w.r1; ++r) {
        if (r > w.r0 && r % 8 == 0) flush(r / 8 - 1);
        const uint8_t* row = w.row(r);
        w.fetch_ahead(r);
        if constexpr (BITS2 == 0) copy_row_ext(row, tbytes, ext);
        __m256i xp[4];
        for (int q = 0; q < 4; ++q) {
            int64_t v;
            std::memcpy(&v, X.xq + 16 * r + 4 * q, 8);
            const __m256i b = _mm256_set1_epi64x(v);
            xp[q] = _mm256_unpacklo_epi16(b, b);
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * tbytes;
            const uint8_t* e = ext + (BITS2 == 0 ? j * EXT_STRIDE : 0);
            __m128i wrapv = _mm_setzero_si128();
            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
            int32_t* ia = iacc + j * 64;
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m256i acc0, acc1;
                static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                    constexpr int q = decltype(QQ)::value;
                    const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                    __m256i v0 = slot_states<UNIFORM, 4 * a + q, 0>(L, tb, sh0, mask16);
                    __m256i v1 = slot_states<UNIFORM, 4 * a + q, 1>(L, tb, sh1, mask16);
                    v0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v0, mult), ones8), xp[q]);
                    v1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(v1, mult), ones8), xp[q]);
                    acc0 = q == 0 ? v0 : _mm256_add_epi32(acc0, v0);
                    acc1 = q == 0 ? v1 : _mm256_add_epi32(acc1, v1);
                });
                __m256i* p0 = reinterpret_cast<__m256i*>(ia + a * 16);
                _mm256_store_si256(p0, _mm256_add_epi32(_mm256_load_si256(p0), acc0));
                _mm256_store_si256(p0 + 1, _mm256_add_epi32(_mm256_load_si256(p0 + 1), acc1));
            });
        }
    }
    flush((w.r1 - 1) / 8);
    reduce_tile_acc(facc, y);
    const float s = MUL1_K_AFF * X.xsum[0];
    if (!X.raw)
        for (int c = 0; c < 128; ++c) y[c] = y[c] * MUL1_K_INV + s;
}

// One (tile j, column pair a, half h) of a block: 8 rows x 2 packed pairs, M token accumulators in registers.
struct IntConsts {
    __m256i mask16, mult, ones8, ones16, sh0, sh1;
};

template <int M, int BITS2, bool UNIFORM, int A, int H>
CT_INLINE void intm_cell_t(const uint8_t* brow, size_t row_stride, int j, int tbytes, const uint8_t* ext,
                           const TrellisTables& tb, const __m256i (*xpp)[M][2], const __m256* sc, float* facc0,
                           const IntConsts& K) {
    __m256i acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_si256();
    for (int rr = 0; rr < 8; ++rr) {
        const uint8_t* tile = brow + rr * row_stride + j * tbytes;
        const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
        __m128i wrapv = _mm_setzero_si128();
        if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
        {
            constexpr int s0 = 4 * A, s1 = s0 + 1;
            __m256i b0 = slot_states<UNIFORM, s0, H>(slot_window<BITS2, s0>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            __m256i b1 = slot_states<UNIFORM, s1, H>(slot_window<BITS2, s1>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            b0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b0, K.mult), K.ones8), K.ones16);
            b1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b1, K.mult), K.ones8), K.ones16);
            const __m256i w = _mm256_or_si256(b0, _mm256_slli_epi32(b1, 16));
            for (int t = 0; t < M; ++t) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, xpp[rr][t][0]));
        }
        {
            constexpr int s0 = 4 * A + 2, s1 = s0 + 1;
            __m256i b0 = slot_states<UNIFORM, s0, H>(slot_window<BITS2, s0>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            __m256i b1 = slot_states<UNIFORM, s1, H>(slot_window<BITS2, s1>(tile, e, wrapv, tb), tb, H ? K.sh1 : K.sh0, K.mask16);
            b0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b0, K.mult), K.ones8), K.ones16);
            b1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(b1, K.mult), K.ones8), K.ones16);
            const __m256i w = _mm256_or_si256(b0, _mm256_slli_epi32(b1, 16));
            for (int t = 0; t < M; ++t) acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, xpp[rr][t][1]));
        }
    }
    for (int t = 0; t < M; ++t) {
        float* f = facc0 + t * (8 * 4 * 2 * 8) + ((j * 4 + A) * 2 + H) * 8;
        _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), sc[t], _mm256_load_ps(f)));
    }
}

template <int M, int BITS2, bool UNIFORM>
static void intm_cell(const uint8_t* brow, size_t row_stride, int j, int ah, int tbytes, const uint8_t* ext,
                      const TrellisTables& tb, const __m256i (*xpp)[M][2], const __m256* sc, float* facc0,
                      const IntConsts& K) {
    switch (ah) {
        case 0: return intm_cell_t<M, BITS2, UNIFORM, 0, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 1: return intm_cell_t<M, BITS2, UNIFORM, 0, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 2: return intm_cell_t<M, BITS2, UNIFORM, 1, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 3: return intm_cell_t<M, BITS2, UNIFORM, 1, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 4: return intm_cell_t<M, BITS2, UNIFORM, 2, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 5: return intm_cell_t<M, BITS2, UNIFORM, 2, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        case 6: return intm_cell_t<M, BITS2, UNIFORM, 3, 0>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
        default: return intm_cell_t<M, BITS2, UNIFORM, 3, 1>(brow, row_stride, j, tbytes, ext, tb, xpp, sc, facc0, K);
    }
}

// M >= 2 tokens, MUL1, int16 activations. Two groups (q = 2p, 2p + 1) of a column pair are packed into one
// register of int16 pairs [bs(q0), bs(q1)], so each token costs one vpmaddwd per two groups. Block order: for
// each 128-row block (8 tile rows, L1 resident), every (tile, column pair, half) accumulates its 8 rows in
// registers and is flushed once with the block's per-token scale.
template <int M, int BITS2, bool UNIFORM>
static void band_intm(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    constexpr int NACC = 8 * 4 * 2 * 8;  // [j][a][h][8 lanes]
    alignas(64) float facc[M][NACC];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * 8 * EXT_STRIDE : 16];
    alignas(64) __m256i xpp[8][M][2];
    std::memset(facc, 0, sizeof(facc));
    IntConsts K;
    K.mask16 = _mm256_set1_epi32(0xFFFF);
    K.mult = _mm256_set1_epi32(int32_t(MUL1_MULT));
    K.ones8 = _mm256_set1_epi8(1);
    K.ones16 = _mm256_set1_epi16(1);
    K.sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    K.sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    const size_t row_stride = w.row_stride;
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr) {
            if constexpr (BITS2 == 0) copy_row_ext(brow + rr * row_stride, tbytes, ext + rr * 8 * EXT_STRIDE);
            for (int t = 0; t < M; ++t)
                for (int pq = 0; pq < 2; ++pq) {
                    int64_t v0, v1;
                    const int16_t* xr = X.xq + t * X.xq_stride + 16 * (8 * blk + rr) + 8 * pq;
                    std::memcpy(&v0, xr, 8);
                    std::memcpy(&v1, xr + 4, 8);
                    xpp[rr][t][pq] = _mm256_unpacklo_epi16(_mm256_set1_epi64x(v0), _mm256_set1_epi64x(v1));
                }
        }
        __m256 sc[M];
        for (int t = 0; t < M; ++t) sc[t] = _mm256_set1_ps(X.xs[t * X.xs_stride + blk]);
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);  // block blk + D, one row per tile column, spread over the block's work
            for (int ah = 0; ah < 8; ++ah) intm_cell<M, BITS2, UNIFORM>(brow, row_stride, j, ah, tbytes, ext, tb, xpp, sc, facc[0], K);
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        int_affine(y + 128 * t, X, t);
    }
}

// ------------------------------------------------------------------- exact MUL1, 1 to 3 tokens, compile-time K
// The exact path's decode chain is long (~25 cycles per 8 weights: window, states, hash, byte sums, convert, affine,
// fp16 rounding, FMA) and its ports are not full: the scheduler holds too few chains. Three changes:
// * software pipelining: the integer decode of the slot two ahead is issued before this slot's rounding and FMA, so
//   the float ops find their inputs ready when dispatched (two ahead: 1.02x one ahead on Zen 4, session 24; the last
//   row decodes its next row's first slots again, unused: guarding that with rr < 7 was 0.93x);
// * the rounding works on N = 1774 bs - 905216 = f 2^18 (exact in fp32) instead of f: the byte sums' multiply-add
//   gives M = 1774 bs = N + 905216 for free (weights 1774 instead of 1). N rounded to 11 significant bits is the fp16
//   value times 2^18 (a power of two: every product below is exactly 2^18 times the plain path's, absent overflow and
//   subnormal products);
// * the offset folded into the split: from Mf = float(M), c = FMA(Mf, 8193, -8193 * 905216) = RN(8193 N) and
//   c - RN(c - Mf) = round11(N) + 905216 (RN(c - N - 905216) = RN(c - N) - 905216 for all 1,021 byte sums:
//   decode_exact's index 3, tests/test_cpu_tier_kernels.py::test_exact_codebook_values_bit_for_bit), so no integer
//   subtract (22.5 vector ops per 16 weights instead of 24); each lane subtracts 905216 x its 4 activations once per
//   tile row instead (once per 128-row block would be faster still, but its sums would carry the offset for 32
//   rows: 10x the fp32 error; per row, most inputs stay at 2-6e-7 relative, all-positive ones reach ~2e-6).
// The first two: 1.00-1.14x per round the generic band_float loop on Zen 4 (median 1.05-1.06x,
// results/devbox_zen4_exact_variants.txt); the third: 1.05-1.08x more (median 1.07x; jobs 1.80-1.83x fast's at
// b4bda55, 1.85x against the pipelined pair kernel, results/devbox_zen4_exact_offset_split.txt). At 2 and 3 tokens
// (a token's accumulators each; each row's offset out of every token's sums; each half's FMAs right after its
// rounding; at 3 tokens one slot ahead, 1.02-1.05x two): 1.11-1.24x / 1.06-1.16x the generic loop, exact 1.78x / 1.94x
// fast's time (kernel alone, Zen 4); at 4
// and 8 tokens no faster than the generic loop (the per-row offset subtracts grow with M while the FMA saved per 8
// weights does not), which runs them (results/devbox_zen4_exact_mn.txt).
// 8 masked states -> Mf = float(1774 bs) = N + MUL1_N_OFF (exact).
CT_INLINE __m256 mul1_shifted(__m256i s) {
    const __m256i p = _mm256_mullo_epi32(s, _mm256_set1_epi32(int32_t(MUL1_MULT)));
    return _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(p, _mm256_set1_epi8(1)), _mm256_set1_epi16(short(MUL1_N_MULT))));
}
struct SpDec {
    __m256 b0, b1;
};
// Slot S's 16 values as M = N + MUL1_N_OFF (fp32, exact), before the rounding.
template <int BITS2, bool UNIFORM, int S>
CT_INLINE SpDec sp_decode(const uint8_t* tile, __m128i wrapv, const TrellisTables& tb, __m256i sh0,
                            __m256i sh1, __m256i mask16) {
    const __m256i L = slot_window<BITS2, S>(tile, nullptr, wrapv, tb);
    return {mul1_shifted(slot_states<UNIFORM, S, 0>(L, tb, sh0, mask16)),
            mul1_shifted(slot_states<UNIFORM, S, 1>(L, tb, sh1, mask16))};
}
// Mf = N + MUL1_N_OFF (a slot's sp_decode) -> round11(N) + MUL1_N_OFF, exactly.
CT_INLINE __m256 round_half_off(__m256 mf) {
    return round_half_split(mf, _mm256_fmadd_ps(mf, _mm256_set1_ps(VELTKAMP_HALF),
                                                _mm256_set1_ps(-VELTKAMP_HALF * float(MUL1_N_OFF))));
}
// The exact values of 8 masked states as band_exact_mul1 computes them (the decode_exact test hook, index
// DECODE_MUL1_SPLIT): (round11(N) + MUL1_N_OFF - MUL1_N_OFF) * 2^-18, exact.
CT_INLINE __m256 mul1_split_values(__m256i s) {
    return _mm256_mul_ps(_mm256_sub_ps(round_half_off(mul1_shifted(s)), _mm256_set1_ps(float(MUL1_N_OFF))),
                         _mm256_set1_ps(1.0f / MUL1_N_UNIT));
}

template <int M, int BITS2, bool UNIFORM>
static void band_exact_mul1(const MatRef& A, int band, const Acts& X, float* y) {
    const TrellisTables& tb = *A.tb;
    const int tbytes = 16 * BITS2;
    static_assert(BITS2 != 0 && M >= 1 && M <= 3, "compile-time window offsets, one to three tokens");
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[M][8 * 4 * 2 * 8];
    alignas(64) __m256 xp[8][M][4];
    alignas(64) __m256 xoff[8][M];  // [row rr][token t]: MUL1_N_OFF x the activations of each lane's 4 rows
    std::memset(facc, 0, sizeof(facc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    const size_t row_stride = w.row_stride;
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr)
            for (int t = 0; t < M; ++t) {
                __m256 xsum = _mm256_setzero_ps();
                for (int q = 0; q < 4; ++q) {
                    xp[rr][t][q] = _mm256_broadcast_ps(
                        reinterpret_cast<const __m128*>(X.xf + t * X.xf_stride + 16 * (8 * blk + rr) + 4 * q));
                    xsum = _mm256_add_ps(xsum, xp[rr][t][q]);
                }
                __m256 off = _mm256_mul_ps(xsum, _mm256_set1_ps(float(MUL1_N_OFF)));
                __asm__("" : "+x"(off));  // a rounded product: never contracted with the row's subtract into an FMA
                xoff[rr][t] = off;
            }
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                __m256 acc0[M], acc1[M];
                for (int t = 0; t < M; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
                const uint8_t* tile = brow + j * tbytes;
                __m128i wrapv = _mm_setzero_si128();
                if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                // decoded D slots ahead: two at 1 and 2 tokens, one at 3 (6 accumulators leave too few registers)
                constexpr int D = M == 3 ? 1 : 2;
                SpDec cur = sp_decode<BITS2, UNIFORM, 4 * a>(tile, wrapv, tb, sh0, sh1, mask16);
                SpDec cur2 = cur;
                if constexpr (D == 2) cur2 = sp_decode<BITS2, UNIFORM, 4 * a + 1>(tile, wrapv, tb, sh0, sh1, mask16);
#pragma GCC unroll 1
                for (int rr = 0; rr < 8; ++rr) {
                    const uint8_t* ntile = rr < 7 ? tile + row_stride : tile;
                    __m128i nwrap = _mm_setzero_si128();
                    if constexpr (ct_needs_wrap<BITS2>()) nwrap = wrap_window(ntile, tbytes);
                    static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                        constexpr int q = decltype(QQ)::value;
                        // slot q + D of this row, or of the next (the last row's: its own first slots again, unused)
                        SpDec nxt;
                        if constexpr (q + D < 4) nxt = sp_decode<BITS2, UNIFORM, 4 * a + q + D>(tile, wrapv, tb, sh0, sh1, mask16);
                        else nxt = sp_decode<BITS2, UNIFORM, 4 * a + q + D - 4>(ntile, nwrap, tb, sh0, sh1, mask16);
                        const SpDec d = cur;
                        if constexpr (D == 2) {
                            cur = cur2;
                            cur2 = nxt;
                        } else
                            cur = nxt;
                        const __m256 v0 = round_half_off(d.b0);
                        for (int t = 0; t < M; ++t) acc0[t] = _mm256_fmadd_ps(v0, xp[rr][t][q], acc0[t]);
                        const __m256 v1 = round_half_off(d.b1);
                        for (int t = 0; t < M; ++t) acc1[t] = _mm256_fmadd_ps(v1, xp[rr][t][q], acc1[t]);
                    });
                    for (int t = 0; t < M; ++t) {
                        acc0[t] = _mm256_sub_ps(acc0[t], xoff[rr][t]);
                        acc1[t] = _mm256_sub_ps(acc1[t], xoff[rr][t]);
                    }
                    tile = ntile;
                    wrapv = nwrap;
                }
                for (int t = 0; t < M; ++t) {
                    float* f = facc[t] + (j * 4 + a) * 16;
                    _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f), acc0[t]));
                    _mm256_store_ps(f + 8, _mm256_add_ps(_mm256_load_ps(f + 8), acc1[t]));
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) {
        reduce_tile_acc(facc[t], y + 128 * t);
        for (int c = 0; c < 128; ++c) y[128 * t + c] *= 1.0f / MUL1_N_UNIT;
    }
}

// M tokens, float activations, values decoded once per group (exact fp16 values, or without the final fp16
// rounding for MCG / 3INST "fast"). Block order as band_intm: accumulators stay in registers over 8 tile rows.
// GENERIC: this loop even where band_exact_mul1 applies (the benchmark's A/B, scripts/avx2_kernel_time.cpp).
template <int CB, int M, bool ROUND, int BITS2, bool UNIFORM, bool GENERIC = false>
static void band_float(const MatRef& A, int band, const Acts& X, float* y) {
    if constexpr (!GENERIC && CB == CB_MUL1 && M <= 3 && ROUND && BITS2 != 0)
        return band_exact_mul1<M, BITS2, UNIFORM>(A, band, X, y);
    const TrellisTables& tb = *A.tb;
    const int tbytes = BITS2 != 0 ? 16 * BITS2 : tb.tile_bytes;
    const BandWalk w(A, band, X, tbytes);
    alignas(64) float facc[M][8 * 4 * 2 * 8];
    alignas(64) uint8_t ext[BITS2 == 0 ? 8 * 8 * EXT_STRIDE : 16];
    alignas(64) __m256 xp[8][M][4];
    std::memset(facc, 0, sizeof(facc));
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
    const __m256i sh0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][0]));
    const __m256i sh1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(tb.shift[0][1]));
    const size_t row_stride = w.row_stride;
    w.start();
    for (int blk = w.r0 / 8; blk < w.r1 / 8; ++blk) {
        const uint8_t* brow = w.block(blk);
        for (int rr = 0; rr < 8; ++rr) {
            if constexpr (BITS2 == 0) copy_row_ext(brow + rr * row_stride, tbytes, ext + rr * 8 * EXT_STRIDE);
            for (int t = 0; t < M; ++t)
                for (int q = 0; q < 4; ++q)
                    xp[rr][t][q] = _mm256_broadcast_ps(
                        reinterpret_cast<const __m128*>(X.xf + t * X.xf_stride + 16 * (8 * blk + rr) + 4 * q));
        }
        for (int j = 0; j < 8; ++j) {
            w.at(blk, j);
            static_for<4>([&](auto AA) CT_LAMBDA_INLINE {
                constexpr int a = decltype(AA)::value;
                if constexpr (M <= 3) {
                    __m256 acc0[M], acc1[M];
                    for (int t = 0; t < M; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
                    for (int rr = 0; rr < 8; ++rr) {
                        const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                        const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
                        __m128i wrapv = _mm_setzero_si128();
                        if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                        static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                            constexpr int q = decltype(QQ)::value;
                            const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                            const __m256 v0 = decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, 0>(L, tb, sh0, mask16));
                            const __m256 v1 = decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, 1>(L, tb, sh1, mask16));
                            for (int t = 0; t < M; ++t) {
                                acc0[t] = _mm256_fmadd_ps(v0, xp[rr][t][q], acc0[t]);
                                acc1[t] = _mm256_fmadd_ps(v1, xp[rr][t][q], acc1[t]);
                            }
                        });
                    }
                    for (int t = 0; t < M; ++t) {
                        float* f = facc[t] + (j * 4 + a) * 16;
                        _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f), acc0[t]));
                        _mm256_store_ps(f + 8, _mm256_add_ps(_mm256_load_ps(f + 8), acc1[t]));
                    }
                } else {
                    static_for<2>([&](auto HH) CT_LAMBDA_INLINE {
                        constexpr int h = decltype(HH)::value;
                        __m256 acc[M];
                        for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
                        for (int rr = 0; rr < 8; ++rr) {
                            const uint8_t* tile = brow + rr * row_stride + j * tbytes;
                            const uint8_t* e = ext + (BITS2 == 0 ? (rr * 8 + j) * EXT_STRIDE : 0);
                            __m128i wrapv = _mm_setzero_si128();
                            if constexpr (ct_needs_wrap<BITS2>()) wrapv = wrap_window(tile, tbytes);
                            static_for<4>([&](auto QQ) CT_LAMBDA_INLINE {
                                constexpr int q = decltype(QQ)::value;
                                const __m256i L = slot_window<BITS2, 4 * a + q>(tile, e, wrapv, tb);
                                const __m256 v =
                                    decode_values<CB, ROUND>(slot_states<UNIFORM, 4 * a + q, h>(L, tb, h ? sh1 : sh0, mask16));
                                for (int t = 0; t < M; ++t) acc[t] = _mm256_fmadd_ps(v, xp[rr][t][q], acc[t]);
                            });
                        }
                        for (int t = 0; t < M; ++t) {
                            float* f = facc[t] + (j * 4 + a) * 16 + 8 * h;
                            _mm256_store_ps(f, _mm256_add_ps(_mm256_load_ps(f), acc[t]));
                        }
                    });
                }
            });
        }
    }
    for (int t = 0; t < M; ++t) reduce_tile_acc(facc[t], y + 128 * t);
}


}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
