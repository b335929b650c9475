// The driver of the band-kernel timing harnesses (avx2_kernel_time.cpp, avx512_kernel_time.cpp): one gate-sized
// matrix (k = 5120, n = 2304, K = 3; POOL > 1: that many, streamed from DRAM), random activations, the harness's
// kb_gemv run over every band until SECONDS of thread CPU time (other processes' time slices do not count) have passed.
// Included after the harness's kernels header and kb_gemv, in the global namespace.
#pragma once
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static double kt_cpu_s() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// argv: M VARIANT SECONDS [POOL]; M in 1, 2, 3, 4, 8 (the harnesses' kb_gemv runs 8 for any other count).
template <class Gemv>
static int kernel_time_main(int argc, char** argv, Gemv kb_gemv) {
    using namespace cpu_tier;
    using namespace cpu_tier::CPU_TIER_NS;
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s M VARIANT SECONDS [POOL]\n", argv[0]);
        return 2;
    }
    const int M = std::atoi(argv[1]), variant = std::atoi(argv[2]);
    const double secs = std::atof(argv[3]);
    const int pool = argc > 4 ? std::atoi(argv[4]) : 1;
    if (M < 1 || M > 8 || (M > 4 && M != 8)) {
        std::fprintf(stderr, "M must be 1, 2, 3, 4 or 8, got %d\n", M);
        return 2;
    }
    const int k = 5120, n = 2304, bits2 = 6;
    const size_t tb = size_t(k / 16) * (n / 16) * 96;
    std::vector<uint8_t*> mats;
    std::mt19937_64 rng(1);
    for (int p = 0; p < pool; ++p) {
        uint8_t* m = static_cast<uint8_t*>(aligned_alloc(4096, tb));
        for (size_t i = 0; i < tb; i += 8) {
            const uint64_t v = rng();
            std::memcpy(m + i, &v, 8);
        }
        mats.push_back(m);
    }
    std::vector<int16_t> xq(size_t(8) * k);
    std::vector<float> xf(size_t(8) * k, 0.01f), xs(8 * k / 128, 1.0f / 32639), xsum(8, 0.f);
    for (auto& v : xq) v = int16_t(int(rng() % 65279) - 32639);
    Acts X;
    X.m = M;
    X.xq = xq.data();
    X.xq_stride = k;
    X.xs = xs.data();
    X.xs_stride = k / 128;
    X.xsum = xsum.data();
    X.variant = variant;
    X.xf = xf.data();
    X.xf_stride = k;
    MatRef A;
    A.k = k;
    A.n = n;
    A.bits2 = bits2;
    A.codebook = CB_MUL1;
    A.tb = &trellis_tables(bits2);
    alignas(64) float y[8 * 128];
    double sink = 0;
    long bands = 0;
    A.trellis = mats[0];
    for (int b = 0; b < n / 128; ++b) kb_gemv(A, b, X, y);
    const double t0 = kt_cpu_s();
    double t = t0;
    while (t - t0 < secs) {
        for (int p = 0; p < pool; ++p) {
            A.trellis = mats[p];
            for (int b = 0; b < n / 128; ++b) {
                kb_gemv(A, b, X, y);
                sink += y[b & 127];
                ++bands;
            }
        }
        t = kt_cpu_s();
    }
    const double w = double(bands) * k * 128;
    std::printf("M=%d variant=%d pool=%d: %.3f ns per weight (x M tokens: %.3f) = %.2f Gw/s  [%ld bands, sink %g]\n", M,
                variant, pool, (t - t0) / w * 1e9, (t - t0) / w * 1e9 / M, w / (t - t0) / 1e9, bands, sink);
    return 0;
}
