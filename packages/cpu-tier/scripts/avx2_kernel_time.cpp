// The AVX2 band kernels alone, timed in thread CPU time (other processes' time slices do not count), on one
// gate-sized matrix (k = 5120, n = 2304, K = 3; POOL > 1: that many, streamed from DRAM). A diagnostic, not part of
// the package build. VARIANT 0 = the pair form (default), 1 = the former forms, 2 = the exact float path.
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -DCPU_TIER_NS=avx2 -DCPU_TIER_ISA_AVX2 -Ipackages/cpu-tier/csrc \
//       packages/cpu-tier/scripts/avx2_kernel_time.cpp -o /tmp/kt && /tmp/kt M VARIANT SECONDS [POOL]
#include <time.h>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "arch/avx2/kernels.h"
namespace cpu_tier { namespace avx2 {
// Only the K = 3 kernels measured here (the package's int.cpp instantiates every K and M: minutes to compile).
static void kb_gemv(const MatRef& A, int band, const Acts& X, float* y) {
    if (X.variant == 2) {  // exact: float path, rounded codebook values
        if (X.m == 1) return band_float<CB_MUL1, 1, true, 6, true>(A, band, X, y);
        if (X.m == 2) return band_float<CB_MUL1, 2, true, 6, true>(A, band, X, y);
        if (X.m == 4) return band_float<CB_MUL1, 4, true, 6, true>(A, band, X, y);
        return band_float<CB_MUL1, 8, true, 6, true>(A, band, X, y);
    }
    if (X.variant == 1) {
        if (X.m == 1) return band_int1<6, true>(A, band, X, y);
        if (X.m == 2) return band_intm<2, 6, true>(A, band, X, y);
        if (X.m == 3) return band_intm<3, 6, true>(A, band, X, y);
        if (X.m == 4) return band_intm<4, 6, true>(A, band, X, y);
        return band_intm<8, 6, true>(A, band, X, y);
    }
    if (X.m == 1) return band_pair<1, 6, true>(A, band, X, y);
    if (X.m == 2) return band_pair<2, 6, true>(A, band, X, y);
    if (X.m == 3) return band_pair<3, 6, true>(A, band, X, y);
    if (X.m == 4) return band_pair<4, 6, true>(A, band, X, y);
    return band_pair<8, 6, true>(A, band, X, y);
}
}}
using namespace cpu_tier; using namespace cpu_tier::avx2;
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
    const int M = atoi(argv[1]), variant = atoi(argv[2]); const double secs = atof(argv[3]);
    const int pool = argc > 4 ? atoi(argv[4]) : 1;
    const int k = 5120, n = 2304, bits2 = 6;
    const size_t tb = size_t(k / 16) * (n / 16) * 96;
    std::vector<uint8_t*> mats;
    std::mt19937_64 rng(1);
    for (int p = 0; p < pool; ++p) {
        uint8_t* m = (uint8_t*)aligned_alloc(4096, tb);
        for (size_t i = 0; i < tb; i += 8) { uint64_t v = rng(); memcpy(m + i, &v, 8); }
        mats.push_back(m);
    }
    std::vector<int16_t> xq(size_t(8) * k); std::vector<float> xf(size_t(8) * k, 0.01f); std::vector<float> xs(8 * k / 128, 1.0f / 32639), xsum(8, 0.f);
    for (auto& v : xq) v = int16_t(int(rng() % 65279) - 32639);
    Acts X; X.m = M; X.xq = xq.data(); X.xq_stride = k; X.xs = xs.data(); X.xs_stride = k / 128; X.xsum = xsum.data(); X.variant = variant; X.xf = xf.data(); X.xf_stride = k;
    MatRef A; A.k = k; A.n = n; A.bits2 = bits2; A.codebook = CB_MUL1; A.tb = &trellis_tables(bits2);
    alignas(64) float y[8 * 128]; double sink = 0;
    long bands = 0; A.trellis = mats[0];
    for (int b = 0; b < n / 128; ++b) kb_gemv(A, b, X, y);
    const double t0 = cpu_s(); double t = t0;
    while (t - t0 < secs) {
        for (int p = 0; p < pool; ++p) { A.trellis = mats[p]; for (int b = 0; b < n / 128; ++b) { kb_gemv(A, b, X, y); sink += y[b & 127]; ++bands; } }
        t = cpu_s();
    }
    const double w = double(bands) * k * 128;
    printf("M=%d variant=%d pool=%d: %.3f ns per weight (x M tokens: %.3f) = %.2f Gw/s  [%ld bands, sink %g]\n", M, variant, pool,
           (t - t0) / w * 1e9, (t - t0) / w * 1e9 / M, w / (t - t0) / 1e9, bands, sink);
}
