// Bit-extraction tables for the EXL3 trellis: where each element's 16-bit state lies in a tile.
//
// A tile is 256 elements (trellis order) packed in 256*K bits = 32*K bytes, read as little-endian uint32 words,
// MSB first inside each word. Element t's state is the 16 stream bits ending at end(t) (tail-biting: the window of
// the first elements wraps to the end of the tile). Stream byte q lives at memory byte 4*(q/4) + 3 - q%4.
//
// The SIMD kernels decode 8 consecutive elements (one "group" g, t = 8g..8g+7) per 256-bit vector: they load a
// 16-byte window of the tile (word aligned, never past the tile's end), gather 4 bytes per 32-bit lane with a
// byte shuffle, shift each lane right and mask 16 bits. Group 0's window wraps: [last 4 bytes, first 12 bytes].
// The AVX-512 kernels decode two groups per 512-bit vector from a 32-byte window (pair 0 wraps likewise).
#pragma once

#include <algorithm>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace cpu_tier {

// Window end of element t (stream bits), integer or half-integer K (exllamav3 quant/frac.cu for the latter).
constexpr int ct_end(int bits2, int t) {
    if (bits2 % 2 == 0) return (t + 1) * (bits2 / 2);
    const int ka = (bits2 - 1) / 2;
    int s = 0;
    for (int i = 0; i <= (t & 15); ++i) s += ka + ((0xAAAA >> i) & 1);
    return (t >> 4) * (16 * ka + 8) + s;
}

constexpr int ct_floordiv(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// First and last stream byte needed by the 8 elements of group g.
constexpr int ct_group_lo(int bits2, int g) { return ct_floordiv(ct_end(bits2, 8 * g) - 16, 8); }
constexpr int ct_group_hi(int bits2, int g) {
    int hi = -100;
    for (int j = 0; j < 8; ++j) {
        const int st = ct_end(bits2, 8 * g + j) - 16;
        const int b = ct_floordiv(st, 8);
        const int top = b + (st - 8 * b + 15) / 8;
        hi = top > hi ? top : hi;
    }
    return hi;
}

// The 16-byte window of one group: word aligned, never past the tile's end; -4 = wrapped.
constexpr int ct_window16(int bits2, int g) {
    const int lo = ct_group_lo(bits2, g);
    if (lo < 0) return -4;
    int w = 4 * ct_floordiv(lo, 4);
    if (w + 16 > 16 * bits2) w = 16 * bits2 - 16;
    return w;
}

struct CtSlot {
    int baseA, baseB;
    bool single;
};

// Slot s = 4a + q: groups gA = 8a + q and gB = gA + 4. Prefer one 32-byte load [gA window | gB window].
constexpr CtSlot ct_slot(int bits2, int s) {
    const int gA = 8 * (s / 4) + s % 4, gB = gA + 4;
    const int tbytes = 16 * bits2;
    const int loA = ct_group_lo(bits2, gA), hiA = ct_group_hi(bits2, gA);
    const int loB = ct_group_lo(bits2, gB), hiB = ct_group_hi(bits2, gB);
    for (int a = 0; a + 32 <= tbytes; a += 4)
        if (a <= loA && a + 16 > hiA && a + 16 <= loB && a + 32 > hiB) return CtSlot{a, a + 16, true};
    return CtSlot{ct_window16(bits2, gA), ct_window16(bits2, gB), false};
}

template <int BITS2>
struct CtTables {
    static constexpr CtSlot slot(int s) { return ct_slot(BITS2, s); }
};

struct TrellisTables {
    int bits2 = 0;       // 2 * K (K = bits per weight; 3, 5, 7 = the half-integer K 1.5, 2.5, 3.5)
    int tile_bytes = 0;  // 32 * K
    bool uniform_shift = true;  // the shifts depend on the half h only (integer K)
    int32_t start[256];         // first stream bit of each element's window, in [0, 256*K)
    // Slots s = 4a + q (a = 0..3, q = 0..3) pair group gA = 8a + q (column 2a) with gB = gA + 4 (column 2a + 1).
    // A slot's 32-byte register holds [16-byte window of gA | 16-byte window of gB]; window bases are byte offsets
    // in the tile, -4 = the wrapped window [last 4 bytes, first 12 bytes]. single: baseB == baseA + 16, one load.
    int32_t baseA[16];
    int32_t baseB[16];
    uint8_t single[16];
    // Half h of a slot: lanes 0-3 = elements 4h..4h+3 of gA, lanes 4-7 = elements 4h..4h+3 of gB.
    alignas(64) uint8_t ctrl[16][2][32];  // pshufb control per (slot, half); 0x80 = zero
    alignas(64) uint32_t shift[16][2][8];  // right shift per lane
    // Pair form (the AVX2 integer path): dword d = 4 L + i of slot s holds the two consecutive elements
    // t = 8 g + 2 i and t + 1 (g = gA for lane L = 0, gB for L = 1): rows 2q + 8 (i & 1) and the next one, column
    // g / 4 + 8 (i >> 1). pair_ctrl: pshufb control gathering the 4 stream bytes from t's first byte on, most
    // significant first (0x80 where a byte is not needed); pair_srl: right shift leaving t's state in bits 0..15;
    // pair_sll: left shift putting t + 1's state in bits 16..31 (the same for every slot when uniform_shift).
    alignas(64) uint8_t pair_ctrl[16][32];
    alignas(64) uint32_t pair_srl[16][8];
    alignas(64) uint32_t pair_sll[16][8];
    // AVX-512 16-bit path (tiles <= 128 bytes, K <= 4): states of the 32 elements 32c + L (L = 0..31) in 16-bit
    // lanes. perm16[c]: vpermt2b indices (tile bytes, 0..127) filling each qword k with the 8 stream bytes from
    // the first byte of element 32c + 4k on, most significant first; mshift16[c]: vpmultishiftqb bit offsets of
    // each state's low and high byte in its qword.
    bool has16 = false;
    alignas(64) uint8_t perm16[8][64];
    alignas(64) uint8_t mshift16[8][64];
    // vpermb form (AVX-512 variant 2): when every index of perm16[c] lies in one 64-byte window [b, b + 64) inside
    // the tile (b a multiple of 32), vperm1_base[c] = b and perm1[c] = perm16[c] - b: one load at tile + b and a
    // one-register vpermb replace the two-register vpermt2b. -1 where the pair's stream wraps the tile's end.
    int32_t vperm1_base[8];
    alignas(64) uint8_t perm1[8][64];
    // AMX form (AVX-512 + AMX-INT8, K <= 4): register p = 2 * qp + h (p = 0..7) holds the 32 states of the row pair
    // (2 qp + 8 h, 2 qp + 8 h + 1) = q-order positions (2p, 2p + 1), all 16 columns: qword c = words
    // [(row a, col c), (row b, col c), (row a, col c + 8), (row b, col c + 8)], so dword 2c is column c and dword
    // 2c + 1 column c + 8 (an AMX B-tile row of 16 columns x 2 rows). amx_perm[qp]: vpermt2b indices filling
    // qword c with the 8 stream bytes from the first byte of element 32c + 8qp on (elements 32c + 8qp .. + 7 are
    // the two registers 2qp, 2qp + 1: one vpermt2b serves both); amx_mshift[p]: their vpmultishiftqb offsets.
    bool has_amx = false;
    alignas(64) uint8_t amx_perm[4][64];
    alignas(64) uint8_t amx_mshift[8][64];
};

namespace detail {

inline int floordiv(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Window position of stream byte q in a 16-byte window whose first stream byte is w (word aligned, may be -4).
inline int window_pos(int q, int w) {
    const int d = q - w;
    if (d < 0 || d >= 16) throw std::logic_error("trellis table: byte outside its window");
    return 4 * (d / 4) + 3 - d % 4;
}

// vpermt2b indices filling one qword (dst[0..7]) with the 8 stream bytes from stream byte b on, most significant
// first: qword byte i holds stream byte b + 7 - i (wrapping at the tile's end: tail-biting).
inline void qword_stream_bytes(uint8_t* dst, int b, int tbytes) {
    for (int i = 0; i < 8; ++i) {
        const int q = (((b + 7 - i) % tbytes) + tbytes) % tbytes;
        dst[i] = uint8_t(4 * (q / 4) + 3 - q % 4);
    }
}

// vpmultishiftqb offsets (dst[0] low byte, dst[1] high byte) of the 16-bit state whose window starts pbit stream
// bits after the first byte of such a qword; what names the table in the error when it does not fit.
inline void state_mshift(uint8_t* dst, int pbit, const char* what) {
    if (pbit < 0 || pbit + 16 > 64) throw std::logic_error(std::string("trellis table: ") + what + " outside its qword");
    dst[0] = uint8_t(48 - pbit);
    dst[1] = uint8_t(56 - pbit);
}

struct Span {
    int lo, hi;  // first and last stream byte any element of a group needs
};

inline void build(TrellisTables& tb, int bits2) {
    const bool half = (bits2 & 1) != 0;
    const int nbits = 128 * bits2;  // 256 * K
    tb.bits2 = bits2;
    tb.tile_bytes = nbits / 8;
    tb.uniform_shift = !half;
    int end[256];
    for (int t = 0; t < 256; ++t) end[t] = ct_end(bits2, t);
    if (end[255] != nbits) throw std::logic_error("trellis table: code lengths do not fill the tile");
    int st[256];  // unwrapped window start (negative for the first elements: tail-biting wrap)
    for (int t = 0; t < 256; ++t) {
        st[t] = end[t] - 16;
        tb.start[t] = ((st[t] % nbits) + nbits) % nbits;
    }
    const int tbytes = tb.tile_bytes;
    for (int s = 0; s < 16; ++s) {
        const CtSlot sl = ct_slot(bits2, s);
        tb.baseA[s] = sl.baseA;
        tb.baseB[s] = sl.baseB;
        tb.single[s] = sl.single;
        const int gA = 8 * (s / 4) + s % 4, gB = gA + 4;
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 8; ++l) {
                const int g = l < 4 ? gA : gB;
                const int w = l < 4 ? sl.baseA : sl.baseB;
                const int t = 8 * g + 4 * h + (l & 3);
                const int b = floordiv(st[t], 8);
                const int o = st[t] - 8 * b;
                const int needed = (o + 15) / 8;  // bytes b .. b + needed
                for (int i = 0; i < 4; ++i) {
                    uint8_t c = 0x80;
                    if (i <= needed) c = uint8_t(window_pos(b + i, w));
                    tb.ctrl[s][h][16 * (l / 4) + 4 * (l & 3) + 3 - i] = c;
                }
                tb.shift[s][h][l] = uint32_t(16 - o);
                if (w >= 0 && w + 16 > tbytes) throw std::logic_error("trellis table: window past the tile");
            }
        for (int d = 0; d < 8; ++d) {  // pair form: dword d = 4 L + i
            const int L = d / 4, i = d % 4;
            const int w = L == 0 ? sl.baseA : sl.baseB;
            const int t = 8 * (L == 0 ? gA : gB) + 2 * i;
            const int b = floordiv(st[t], 8);
            const int o = st[t] - 8 * b;
            const int delta = st[t + 1] - st[t];
            if (o + delta + 16 > 32) throw std::logic_error("trellis table: a pair's states span more than 4 bytes");
            const int needed = (o + delta + 16 + 7) / 8;  // bytes b .. b + needed - 1
            for (int k = 0; k < 4; ++k)
                tb.pair_ctrl[s][16 * L + 4 * i + 3 - k] = k < needed ? uint8_t(window_pos(b + k, w)) : uint8_t(0x80);
            tb.pair_srl[s][d] = uint32_t(16 - o);
            tb.pair_sll[s][d] = uint32_t(o + delta);
        }
    }
    tb.has16 = tbytes <= 128;
    if (tb.has16) {
        for (int c = 0; c < 8; ++c)
            for (int k = 0; k < 8; ++k) {
                const int e0 = 32 * c + 4 * k;
                const int b = floordiv(st[e0], 8);
                qword_stream_bytes(&tb.perm16[c][8 * k], b, tbytes);
                for (int l = 0; l < 4; ++l) state_mshift(&tb.mshift16[c][8 * k + 2 * l], st[e0 + l] - 8 * b, "state");
            }
        for (int c = 0; c < 8; ++c) {
            const int lo = *std::min_element(tb.perm16[c], tb.perm16[c] + 64);
            const int hi = *std::max_element(tb.perm16[c], tb.perm16[c] + 64);
            tb.vperm1_base[c] = -1;
            for (int b = 0; b + 64 <= tbytes; b += 32)
                if (lo >= b && hi < b + 64) {
                    tb.vperm1_base[c] = b;
                    break;
                }
            for (int i = 0; i < 64; ++i)
                tb.perm1[c][i] = uint8_t(tb.vperm1_base[c] >= 0 ? tb.perm16[c][i] - tb.vperm1_base[c] : 0);
        }
    }
    tb.has_amx = tb.has16;
    if (tb.has_amx) {
        for (int qp = 0; qp < 4; ++qp)
            for (int c = 0; c < 8; ++c) {
                const int e0 = 32 * c + 8 * qp;
                const int b = floordiv(st[e0], 8);
                qword_stream_bytes(&tb.amx_perm[qp][8 * c], b, tbytes);
                static constexpr int lane_elem[4] = {0, 1, 4, 5};  // + 2h: rows a, b of column c, then c + 8
                for (int h = 0; h < 2; ++h)
                    for (int l = 0; l < 4; ++l)
                        state_mshift(&tb.amx_mshift[2 * qp + h][8 * c + 2 * l], st[e0 + lane_elem[l] + 2 * h] - 8 * b,
                                     "AMX state");
            }
    }
    if (!half)
        for (int s = 0; s < 16; ++s)
            for (int h = 0; h < 2; ++h)
                for (int l = 0; l < 8; ++l)
                    if (tb.shift[s][h][l] != tb.shift[0][h][l]) throw std::logic_error("trellis table: shift not uniform");
    if (!half)
        for (int s = 0; s < 16; ++s)
            for (int d = 0; d < 8; ++d)
                if (tb.pair_srl[s][d] != tb.pair_srl[0][d] || tb.pair_sll[s][d] != tb.pair_sll[0][d])
                    throw std::logic_error("trellis table: pair shifts not uniform");
}

}  // namespace detail

// Tables for bits2 in {2..16} (integer K = bits2/2) and {3, 5, 7} (K = 1.5, 2.5, 3.5).
inline const TrellisTables& trellis_tables(int bits2) {
    static TrellisTables all[17];
    static bool ready = [] {
        for (int b2 = 2; b2 <= 16; ++b2)
            if (b2 % 2 == 0 || b2 == 3 || b2 == 5 || b2 == 7) detail::build(all[b2], b2);
        return true;
    }();
    (void)ready;
    if (bits2 < 2 || bits2 > 16 || all[bits2].bits2 != bits2)
        throw std::invalid_argument("unsupported bits per weight K=" + std::to_string(bits2 / 2.0));
    return all[bits2];
}

}  // namespace cpu_tier
