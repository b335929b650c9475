// Scalar (x86-64 baseline) band kernel: the reference variant, every codebook, K and token count in one loop.
#include <vector>

#include "../../kernel.h"

namespace cpu_tier {
namespace CPU_TIER_NS {
namespace {

// Row-major position of trellis element t inside its 16x16 tile.
CT_INLINE int elem_row(int t) { return 2 * ((t >> 3) & 3) + (t & 1) + 8 * ((t >> 1) & 1); }
CT_INLINE int elem_col(int t) { return (t >> 5) + 8 * ((t >> 2) & 1); }

void band_scalar(const MatRef& A, int band, const Acts& X, GemvMode mode, float* y) {
    const TrellisTables& tb = *A.tb;
    const BandWalk w(A, band, X, tb.tile_bytes);
    const int m = X.m;
    std::fill(y, y + size_t(m) * 128, 0.0f);
    float wv[256];
    int32_t bs[256];
    std::vector<int64_t> iacc(size_t(m) * 128, 0);
    for (int r = w.r0; r < w.r1; ++r) {
        const uint8_t* row = w.row(r);
        for (int j = 0; j < 8; ++j) {
            const uint8_t* tile = row + j * w.tbytes;
            for (int t = 0; t < 256; ++t) {
                const uint32_t st = tile_state(tile, tb, t);
                const int pos = elem_row(t) * 16 + elem_col(t);
                if (mode == GemvMode::Int)
                    bs[pos] = int32_t(mul1_bytesum(st));
                else
                    wv[pos] = codebook_value(st, A.codebook, mode == GemvMode::Exact);
            }
            for (int t = 0; t < m; ++t)
                for (int c = 0; c < 16; ++c) {
                    if (mode == GemvMode::Int) {
                        const int16_t* xq = X.xq + t * X.xq_stride + 16 * r;
                        int64_t acc = 0;
                        for (int p = 0; p < 16; ++p) acc += bs[qorder_row(p) * 16 + c] * int32_t(xq[p]);
                        iacc[size_t(t) * 128 + 16 * j + c] += acc;
                    } else {
                        const float* xf = X.xf + t * X.xf_stride + 16 * r;
                        float acc = 0.0f;
                        for (int p = 0; p < 16; ++p) acc += wv[qorder_row(p) * 16 + c] * xf[p];
                        y[t * 128 + 16 * j + c] += acc;
                    }
                }
        }
        if (mode == GemvMode::Int && (r % 8 == 7 || r == w.r1 - 1)) {
            for (int t = 0; t < m; ++t) {
                const float sc = X.xs[t * X.xs_stride + r / 8];
                for (int c = 0; c < 128; ++c) {
                    y[t * 128 + c] += float(iacc[size_t(t) * 128 + c]) * sc;
                    iacc[size_t(t) * 128 + c] = 0;
                }
            }
        }
    }
    if (mode == GemvMode::Int)
        for (int t = 0; t < m; ++t) int_affine(y + 128 * t, X, t);
}

void int_band(const MatRef& A, int band, const Acts& X, float* y) { band_scalar(A, band, X, GemvMode::Int, y); }

// MUL1's float path always rounds (its "fast" precision is the integer path), as in the SIMD variants.
void float_band(const MatRef& A, int band, const Acts& X, bool round, float* y) {
    band_scalar(A, band, X, round || A.codebook == CB_MUL1 ? GemvMode::Exact : GemvMode::Fast, y);
}

void decode_exact(int codebook, const uint16_t* states, size_t n, float* out) {
    if (codebook == DECODE_MUL1_SPLIT) codebook = CB_MUL1;
    for (size_t i = 0; i < n; ++i) out[i] = codebook_value(states[i], codebook, true);
}

}  // namespace

const KernelTable& kernel_table() {
    static const KernelTable t{"scalar", false, false, int_band, {float_band, float_band, float_band}, decode_exact};
    return t;
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
