// The benchmark's probes (cpu_tier.bench), kept off the production runtime: jobs that measure the host (streaming
// read bandwidth, the band kernels' read pattern, the core clock, the vector ports' rate) and the band kernel's
// compute rate alone, run on a Runtime's pool. Bound as the variant module's `bench` submodule: functions that take
// the Runtime as their first argument.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "clock_probe.h"
#include "runtime.h"

namespace cpu_tier {
namespace CPU_TIER_NS {
namespace {

// Streaming read of a buffer by every worker. seg == 0: 4 MiB contiguous pieces. seg > 0: the band kernels' access
// pattern, without their compute: the buffer is a row of matrices of `rows` rows of `stride` bytes, one unit = one
// band = `seg` bytes (a multiple of 128) of every row of one matrix, rows in order, with the kernels' software
// prefetch (8 rows ahead, 64-byte lines).
struct BandwidthJob : JobBase {
    const uint8_t* buf = nullptr;
    size_t bytes = 0;
    size_t seg = 0, stride = 0, rows = 0;
    double checksum = 0;
    size_t pattern_bytes() const {  // the bytes one pass reads
        return seg == 0 ? bytes : bytes / (rows * stride) * rows * stride;
    }
    void run(Pool& pool) override {
        const size_t piece = size_t(1) << 22;  // 4 MiB per unit
        const size_t mats = seg ? bytes / (rows * stride) : 0, bands = seg ? stride / seg : 0;
        const int units = seg ? int(mats * bands) : int((bytes + piece - 1) / piece);
        std::vector<double> part(size_t(units), 0.0);
        pool.parallel_for(units, [&](int u, int) {
            if (seg) {
                const uint8_t* b = buf + size_t(u) / bands * rows * stride + size_t(u) % bands * seg;
                double acc = 0.0;
                for (size_t r = 0; r < rows; ++r) {
                    if (r + 8 < rows)
                        for (size_t o = 0; o < seg; o += 64) __builtin_prefetch(b + (r + 8) * stride + o, 0, 3);
                    acc += sum_bytes(b + r * stride, seg);
                }
                part[size_t(u)] = acc;
                return;
            }
            part[size_t(u)] = sum_bytes(buf + size_t(u) * piece, std::min(piece, bytes - size_t(u) * piece));
        });
        checksum = 0;
        for (double d : part) checksum += d;
    }
    // A checksum of n bytes at p (n a multiple of 128 for the SIMD variants).
    static double sum_bytes(const uint8_t* p, size_t n) {
#if !defined(__AVX2__)
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (size_t i = 0; i + 32 <= n; i += 32) {
            uint64_t v[4];
            std::memcpy(v, p + i, 32);
            a0 += v[0];
            a1 ^= v[1];
            a2 += v[2];
            a3 ^= v[3];
        }
        return double((a0 + a1 + a2 + a3) & 0xFFFF);
#else
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i + 128 <= n; i += 128) {
            a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
            a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
        }
        alignas(32) uint64_t v[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(v),
                           _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
        return double((v[0] + v[1] + v[2] + v[3]) & 0xFFFF);
#endif
    }
};

// Start line of the benchmark jobs that run one unit per worker at once: a unit waits (spinning) until every unit
// has started, so a worker cannot take two units and all of them measure together. Gives up waiting after 2 s (a
// worker that never came: the measurement is then not simultaneous, but it ends).
struct StartLine {
    std::atomic<int> arrived{0};
    void wait(int n) {
        arrived.fetch_add(1, std::memory_order_acq_rel);
        const uint64_t t0 = now_ns();
        while (arrived.load(std::memory_order_acquire) < n && now_ns() - t0 < 2000000000ull) CT_PAUSE();
    }
};

// Vector-port rate of every worker, all at once (clock_probe.h: port_rate).
struct PortRateJob : JobBase {
    double sec = 0.03;
    std::vector<double> rate;
    StartLine start;
    void run(Pool& pool) override {
        const int W = pool.threads();
        rate.assign(size_t(W), 0.0);
        pool.parallel_for(W, [&](int u, int) {
            start.wait(W);
            rate[size_t(u)] = cpu_tier_clock::port_rate(sec);
        });
    }
};

// Core clock of every worker at once (clock_probe.h; the clock with that many cores busy, scalar code).
struct ClockJob : JobBase {
    int units = 1;
    std::vector<double> ghz;
    void run(Pool& pool) override {
        ghz.assign(size_t(units), 0.0);
        pool.parallel_for(units, [&](int u, int) { ghz[size_t(u)] = cpu_tier_clock::core_ghz(2000000, uint64_t(u)); });
    }
};


// Kernel-only rate (benchmark): every worker at once computes bands of `trellis` (band (w + i) % bands, i = 0, 1, ...)
// with synthetic prepared activations (m tokens), no transforms. One band of a k = 5120, K = 3 matrix is 240 KiB
// (L2 resident): the kernel's compute rate with that many cores busy. The workers start together and every one
// keeps computing until the last one has done `iters` bands, so all of them are busy over each one's measured time
// (a worker that stopped early would leave its core's ports to an SMT sibling). Returns, per worker, seconds per
// band.
struct KernelRateJob : JobBase {
    MatRef A;
    int m = 1, bands = 1, iters = 1, variant = 0;
    bool fast = true;
    std::vector<double> sec;
    StartLine start;
    std::atomic<int> finished{0};  // workers that have done `iters` bands
    void run(Pool& pool) override {
        const int W = pool.threads();
        sec.assign(size_t(W), 0.0);
        pool.parallel_for(W, [&](int u, int) {
            const int kb = A.k / 128;
            std::vector<float> xf(size_t(MAXM) * A.k), xs(size_t(MAXM) * kb, 1.0f / float(XQ_MAX));
            std::vector<int16_t> xq(size_t(MAXM) * A.k);
            uint32_t r = 12345u + uint32_t(u);
            for (size_t i = 0; i < xq.size(); ++i) {
                r = r * 1664525u + 1013904223u;
                xq[i] = int16_t((int32_t(r >> 16) - 32768) % (XQ_MAX + 1));  // |xq| <= XQ_MAX, as prep_block_int makes them
                xf[i] = float(xq[i]) / float(XQ_MAX);
            }
            float xsum[MAXM] = {};
            Acts X;
            X.m = m;
            X.xf = xf.data();
            X.xf_stride = size_t(A.k);
            X.xq = xq.data();
            X.xq_stride = size_t(A.k);
            X.xs = xs.data();
            X.xs_stride = size_t(kb);
            X.xsum = xsum;
            X.variant = variant;
            X.amx = pool.amx_for(m);
            X.pf_blocks = pool.prefetch_blocks();
            const GemvMode mode = gemv_mode(A, fast, m);
            alignas(64) float y[MAXM * 128];
            float sink = 0.0f;
            gemv_band(A, u % bands, X, mode, y);  // warm-up
            start.wait(W);
            const uint64_t t0 = now_ns();
            long it = 0;
            uint64_t t_iters = 0;  // when this worker had done its `iters` bands
            do {
                gemv_band(A, int((u + it) % bands), X, mode, y);
                sink += y[it & 127];
                if (++it == iters) {
                    finished.fetch_add(1, std::memory_order_acq_rel);
                    t_iters = now_ns();
                }
                // keep going while others have not done theirs, for at most 2 s more (a worker that never came)
            } while (it < iters ||
                     (finished.load(std::memory_order_acquire) < W && now_ns() - t_iters < 2000000000ull));
            const double s = double(now_ns() - t0) * 1e-9 / double(it);
            sec[size_t(u)] = sink == 12345.678f ? s * 1.000001 : s;  // keeps the results live
        });
    }
};


// Per-worker vector-port rate (chain steps per ns, port_rate) with all workers busy at once.
std::vector<double> port_rates(Runtime& rt, double sec) {
    if (!(sec > 0.0 && sec <= 10.0)) throw std::invalid_argument("sec: must be in (0, 10]");
    auto job = std::make_shared<PortRateJob>();
    job->sec = sec;
    rt.run_blocking(job);
    return job->rate;
}

// Per-worker clock (GHz) with all workers busy at once.
std::vector<double> clock_ghz(Runtime& rt) {
    auto job = std::make_shared<ClockJob>();
    job->units = rt.pool().threads();
    rt.run_blocking(job);
    return job->ghz;
}

std::vector<double> kernel_band_seconds(Runtime& rt, const I16_3D& trellis, const U16_1D& suh, const U16_1D& svh,
                                        int codebook, bool fast, int m, int bands, int iters, int variant) {
    auto job = std::make_shared<KernelRateJob>();
    job->A = make_mat(trellis, suh, svh, nb::none(), codebook, "tensor");
    if (m < 1 || m > MAXM) throw std::invalid_argument("m: must be in 1..8");
    if (bands < 1 || bands > job->A.n / 128) throw std::invalid_argument("bands: must be in 1..n/128");
    if (iters < 1) throw std::invalid_argument("iters: must be >= 1");
    job->m = m;
    job->bands = bands;
    job->iters = iters;
    job->fast = fast;
    job->variant = variant;
    rt.run_blocking(job);
    return job->sec;
}

// Read bandwidth (bytes/s, best of iters) over a fresh buffer of `bytes`: contiguous (seg = 0), or in the band
// kernels' pattern (BandwidthJob).
double read_bandwidth(Runtime& rt, size_t bytes, int iters, size_t seg, size_t stride, size_t rows) {
    if (seg && (seg % 128 || stride < seg || stride % seg || rows < 1 || rows > bytes / stride ||
                bytes / (rows * stride) * (stride / seg) >= (size_t(1) << 20)))
        throw std::invalid_argument("read_bandwidth: seg must be a multiple of 128 dividing stride, rows >= 1, "
                                    "bytes >= rows * stride, fewer than 2^20 bands in all");
    Pool& p = rt.pool();
    nb::gil_scoped_release nogil;
    bytes &= ~size_t(127);
    void* mem = nullptr;
    if (posix_memalign(&mem, 4096, bytes) != 0) throw std::bad_alloc();
    std::unique_ptr<void, void (*)(void*)> hold(mem, std::free);
    // Touch with all threads, nonzero data.
    {
        struct Fill : JobBase {
            uint8_t* buf;
            size_t bytes;
            void run(Pool& pool) override {
                const size_t piece = size_t(1) << 22;
                const int units = int((bytes + piece - 1) / piece);
                pool.parallel_for(units, [&](int u, int) {
                    const size_t o = size_t(u) * piece;
                    std::memset(buf + o, 0x5A ^ (u & 0xFF), std::min(piece, bytes - o));
                });
            }
        };
        auto f = std::make_shared<Fill>();
        f->buf = static_cast<uint8_t*>(mem);
        f->bytes = bytes;
        p.submit(f);
        f->wait(-1);
    }
    double best = 0;
    for (int it = 0; it < std::max(1, iters); ++it) {
        auto job = std::make_shared<BandwidthJob>();
        job->buf = static_cast<const uint8_t*>(mem);
        job->bytes = bytes;
        job->seg = seg;
        job->stride = stride;
        job->rows = rows;
        const uint64_t t0 = now_ns();
        p.submit(job);
        job->wait(-1);
        const double s = double(now_ns() - t0) * 1e-9;
        if (!job->error.empty()) throw std::runtime_error(job->error);
        best = std::max(best, double(job->pattern_bytes()) / s);
    }
    return best;  // bytes per second, best of iters
}

}  // namespace

void bind_bench_probes(nb::module_& m) {
    nb::module_ b = m.def_submodule("bench", "the benchmark's probes (cpu_tier.bench), run on a Runtime's pool");
    b.def("read_bandwidth", &read_bandwidth, nb::arg("runtime"), nb::arg("bytes"), nb::arg("iters"), nb::arg("seg") = 0,
          nb::arg("stride") = 0, nb::arg("rows") = 0);
    b.def("clock_ghz", &clock_ghz, nb::arg("runtime"));
    b.def("port_rates", &port_rates, nb::arg("runtime"), nb::arg("sec") = 0.03);
    b.def("kernel_band_seconds", &kernel_band_seconds, nb::arg("runtime"), nb::arg("trellis"), nb::arg("suh"),
          nb::arg("svh"), nb::arg("codebook"), nb::arg("fast"), nb::arg("m"), nb::arg("bands"), nb::arg("iters"),
          nb::arg("variant") = 0);
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
