// nanobind module of one ISA variant: _native_scalar, _native_avx2 or _native_avx512 (CPU_TIER_MODULE).
// Arrays cross as nb::ndarray (numpy, or anything DLPack on the CPU); every wait and every blocking compute runs
// with the GIL released. Validation with clear messages happens in Python (cpu_tier/tier.py); the checks here
// guard the native invariants.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "clock_probe.h"
#include "common.h"
#include "jobs.h"
#include "kernels.h"
#include "pool.h"
#include "tables.h"

namespace nb = nanobind;

namespace cpu_tier {
namespace CPU_TIER_NS {

using F32_2D = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32_1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32_1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16_1D = nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I16_3D = nb::ndarray<const int16_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

static MatRef make_mat(const I16_3D& trellis, const U16_1D& suh, const U16_1D& svh, nb::object bias, int codebook,
                       const char* what) {
    MatRef A;
    const size_t tk = trellis.shape(0), tn = trellis.shape(1), words = trellis.shape(2);
    A.k = int(tk * 16);
    A.n = int(tn * 16);
    if (A.k % 128 || A.n % 128 || A.k == 0 || A.n == 0)
        throw std::invalid_argument(std::string(what) + ": k and n must be positive multiples of 128");
    if (words % 8) throw std::invalid_argument(std::string(what) + ": trellis last dimension must be 16*K");
    A.bits2 = int(words / 8);
    A.tb = &trellis_tables(A.bits2);
    if (codebook < 0 || codebook > 2) throw std::invalid_argument(std::string(what) + ": bad codebook");
    if (codebook != CB_MUL1 && (A.bits2 & 1))
        throw std::invalid_argument(std::string(what) + ": half-integer K is MUL1 only");
    A.codebook = codebook;
    if (suh.shape(0) != size_t(A.k) || svh.shape(0) != size_t(A.n))
        throw std::invalid_argument(std::string(what) + ": suh/svh length mismatch");
    A.trellis = reinterpret_cast<const uint8_t*>(trellis.data());
    A.suh = suh.data();
    A.svh = svh.data();
    if (!bias.is_none()) {
        U16_1D b = nb::cast<U16_1D>(bias);
        if (b.shape(0) != size_t(A.n)) throw std::invalid_argument(std::string(what) + ": bias length mismatch");
        A.bias = b.data();
    }
    return A;
}

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
#if defined(CPU_TIER_ISA_SCALAR)
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

class Runtime {
   public:
    // amx = true: the MUL1 integer path ("fast", K <= 4) runs the AMX kernel for chunks of at least amx_min_tokens
    // tokens. Needs a build with AMX kernels (the avx512 variant, or the emulated one) and, on hardware, the OS
    // grant, requested here.
    // prefetch_blocks: the kernels' software prefetch distance in 128-row blocks (Acts::pf_blocks).
    Runtime(int threads, std::vector<int> cpus, int spin_us, bool amx, int amx_min_tokens, int prefetch_blocks) {
        if (amx_min_tokens < 1 || amx_min_tokens > MAXM + 1)
            throw std::invalid_argument("amx_min_tokens: must be in 1..9 (9 = never)");
        if (prefetch_blocks < 0 || prefetch_blocks > 4)
            throw std::invalid_argument("prefetch_blocks: must be in 0..4 (0 = no software prefetch)");
        if (amx) {
#if !defined(CT_HAVE_AMX)
            throw std::invalid_argument("amx: this kernel variant (" + std::string(ISA_NAME) + ") has no AMX kernels");
#elif !defined(CT_EMU512)
            const std::string why = amx_request_permission();
            if (!why.empty()) throw std::runtime_error("amx: " + why);
#endif
        }
        pool_ = std::make_unique<Pool>(threads, std::move(cpus), spin_us, amx ? amx_min_tokens : 0, prefetch_blocks);
    }
    bool amx() { return pool().amx_min_tokens() > 0; }
    int amx_min_tokens() { return pool().amx_min_tokens(); }
    int prefetch_blocks() { return pool().prefetch_blocks(); }
    ~Runtime() { close(); }
    void close() {
        if (pool_) {
            nb::gil_scoped_release nogil;
            pool_->shutdown();
        }
    }
    Pool& pool() {
        if (!pool_ || pool_->stopping()) throw std::runtime_error("cpu_tier runtime is closed");
        return *pool_;
    }
    // Run a job to completion on the pool with the GIL released; rethrow what its run() threw.
    void run_blocking(const std::shared_ptr<JobBase>& job) {
        Pool& p = pool();
        {
            nb::gil_scoped_release nogil;
            p.submit(job);
            job->wait(-1);
        }
        if (!job->error.empty()) throw std::runtime_error(job->error);
    }
    int threads() { return pool().threads(); }
    std::vector<int> cpus() { return pool().cpus(); }

    void matmul(F32_2D x, const I16_3D& trellis, const U16_1D& suh, const U16_1D& svh, nb::object bias, int codebook,
                bool fast, F32_2D out, int variant) {
        auto job = std::make_shared<LinearJob>();
        job->A = make_mat(trellis, suh, svh, bias, codebook, "tensor");
        if (x.shape(1) != size_t(job->A.k)) throw std::invalid_argument("x: wrong number of columns");
        if (out.shape(0) != x.shape(0) || out.shape(1) != size_t(job->A.n)) throw std::invalid_argument("out: wrong shape");
        job->x = x.data();
        job->out = out.data();
        job->m = int(x.shape(0));
        job->fast = fast;
        job->variant = variant;
        run_blocking(job);
    }

    // Per-worker vector-port rate (chain steps per ns, port_rate) with all workers busy at once.
    std::vector<double> port_rates(double sec) {
        if (!(sec > 0.0 && sec <= 10.0)) throw std::invalid_argument("sec: must be in (0, 10]");
        auto job = std::make_shared<PortRateJob>();
        job->sec = sec;
        run_blocking(job);
        return job->rate;
    }

    // Per-worker clock (GHz) with all workers busy at once.
    std::vector<double> clock_ghz() {
        Pool& p = pool();
        auto job = std::make_shared<ClockJob>();
        job->units = p.threads();
        run_blocking(job);
        return job->ghz;
    }

    std::vector<double> kernel_band_seconds(const I16_3D& trellis, const U16_1D& suh, const U16_1D& svh, int codebook,
                                            bool fast, int m, int bands, int iters, int variant) {
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
        run_blocking(job);
        return job->sec;
    }

    // Read bandwidth (bytes/s, best of iters) over a fresh buffer of `bytes`: contiguous (seg = 0), or in the band
    // kernels' pattern (BandwidthJob).
    double read_bandwidth(size_t bytes, int iters, size_t seg, size_t stride, size_t rows) {
        if (seg && (seg % 128 || stride < seg || stride % seg || rows < 1 || rows > bytes / stride ||
                    bytes / (rows * stride) * (stride / seg) >= (size_t(1) << 20)))
            throw std::invalid_argument("read_bandwidth: seg must be a multiple of 128 dividing stride, rows >= 1, "
                                        "bytes >= rows * stride, fewer than 2^20 bands in all");
        Pool& p = pool();
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

    std::unique_ptr<Pool> pool_;
};

class NativeLayer {
   public:
    NativeLayer(int H, int I, float limit) : layer_(std::make_shared<Layer>()) {
        if (H <= 0 || I <= 0 || H % 128 || I % 128) throw std::invalid_argument("H and I must be positive multiples of 128");
        layer_->H = H;
        layer_->I = I;
        layer_->limit = std::isnan(limit) ? std::numeric_limits<float>::infinity() : limit;
    }
    void add_expert(const I16_3D& gt, const U16_1D& gs, const U16_1D& gv, nb::object gb, int gcb,   //
                    const I16_3D& ut, const U16_1D& us, const U16_1D& uv, nb::object ub, int ucb,   //
                    const I16_3D& dt, const U16_1D& ds, const U16_1D& dv, nb::object db, int dcb) {
        ExpertMats e;
        e.gate = make_mat(gt, gs, gv, gb, gcb, "gate");
        e.up = make_mat(ut, us, uv, ub, ucb, "up");
        e.down = make_mat(dt, ds, dv, db, dcb, "down");
        const int H = layer_->H, I = layer_->I;
        if (e.gate.k != H || e.gate.n != I || e.up.k != H || e.up.n != I || e.down.k != I || e.down.n != H)
            throw std::invalid_argument("expert shapes do not match the layer's H and I");
        layer_->experts.push_back(e);
    }
    int num_experts() const { return int(layer_->experts.size()); }
    std::shared_ptr<Layer> layer_;
};

class NativeJob {
   public:
    std::shared_ptr<MoeJob> job;
    bool done() const { return job->done(); }
    bool wait(double timeout_s) { return job->wait(timeout_s); }
    void cancel() { job->cancelled.store(true); }
    std::string error() const { return job->done() ? job->error : std::string(); }
    // Per pick: 1 when included in out. Only meaningful once done.
    nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> computed() const {
        if (!job->done()) throw std::runtime_error("job is not done");
        auto* data = new std::vector<uint8_t>(job->computed);
        nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(data->data(), {data->size()}, owner);
    }
    double elapsed_s() const { return job->done() ? double(job->t_end_ns - job->t_start_ns) * 1e-9 : 0.0; }
    std::vector<double> phase_s() const {
        std::vector<double> r;
        if (job->done())
            for (uint64_t v : job->phase_ns) r.push_back(double(v) * 1e-9);
        return r;
    }
};

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier

using namespace cpu_tier::CPU_TIER_NS;

NB_MODULE(CPU_TIER_MODULE, m) {
    m.doc() = "cpu_tier native EXL3 kernels, one ISA variant";
    m.def("isa", [] { return std::string(ISA_NAME); });
    m.def("max_tokens_per_chunk", [] { return MAXM; });
#if defined(CT_EMU512)
    m.def("_emu_amx_fault", [](bool on) { cpu_tier::emu::tile_fault_injection().store(on); },
          "test hook: the emulated TDPBSUD drops its last K group while on");
    m.def(
        "_emu_prefetch_stats",
        [] {
            return std::vector<long>{emu_prefetch_calls().exchange(0), emu_prefetch_outside().exchange(0)};
        },
        "test hook: [band prefetches issued, of them outside their matrix] since the last call (then zeroed)");
#endif
#if defined(CT_HAVE_AMX)
    m.def("has_amx_kernels", [] { return true; });
#else
    m.def("has_amx_kernels", [] { return false; });
#endif

    nb::class_<Runtime>(m, "Runtime")
        .def(nb::init<int, std::vector<int>, int, bool, int, int>(), nb::arg("threads"), nb::arg("cpus"),
             nb::arg("spin_us"), nb::arg("amx") = false, nb::arg("amx_min_tokens") = 1, nb::arg("prefetch_blocks") = 1)
        .def_prop_ro("threads", &Runtime::threads)
        .def_prop_ro("amx", &Runtime::amx)
        .def_prop_ro("amx_min_tokens", &Runtime::amx_min_tokens)
        .def_prop_ro("prefetch_blocks", &Runtime::prefetch_blocks)
        .def_prop_ro("cpus", &Runtime::cpus)
        .def("close", &Runtime::close)
        .def("matmul", &Runtime::matmul, nb::arg("x"), nb::arg("trellis"), nb::arg("suh"), nb::arg("svh"),
             nb::arg("bias").none(), nb::arg("codebook"), nb::arg("fast"), nb::arg("out"), nb::arg("variant") = 0)
        .def("read_bandwidth", &Runtime::read_bandwidth, nb::arg("bytes"), nb::arg("iters"), nb::arg("seg") = 0,
             nb::arg("stride") = 0, nb::arg("rows") = 0)
        .def("clock_ghz", &Runtime::clock_ghz)
        .def("port_rates", &Runtime::port_rates, nb::arg("sec") = 0.03)
        .def("kernel_band_seconds", &Runtime::kernel_band_seconds, nb::arg("trellis"), nb::arg("suh"), nb::arg("svh"),
             nb::arg("codebook"), nb::arg("fast"), nb::arg("m"), nb::arg("bands"), nb::arg("iters"), nb::arg("variant") = 0)
        .def(
            "submit_moe",
            [](Runtime& rt, NativeLayer& layer, F32_2D x, I32_1D tokens, I32_1D experts, F32_1D weights, F32_2D out,
               bool fast, int wave_chunks, int slab_blocks, int cancel_after_chunks) {
                auto job = std::make_shared<MoeJob>();
                job->layer = layer.layer_;
                const int H = layer.layer_->H;
                if (x.shape(1) != size_t(H)) throw std::invalid_argument("x: wrong hidden size");
                if (out.shape(0) != x.shape(0) || out.shape(1) != size_t(H)) throw std::invalid_argument("out: wrong shape");
                const size_t P = tokens.shape(0);
                if (experts.shape(0) != P || weights.shape(0) != P) throw std::invalid_argument("picks: length mismatch");
                const int T = int(x.shape(0));
                const int E = layer.num_experts();
                for (size_t i = 0; i < P; ++i) {
                    if (tokens.data()[i] < 0 || tokens.data()[i] >= T) throw std::invalid_argument("picks: token out of range");
                    if (experts.data()[i] < 0 || experts.data()[i] >= E) throw std::invalid_argument("picks: expert out of range");
                }
                job->x = x.data();
                job->out = out.data();
                job->T = T;
                job->tokens = tokens.data();
                job->experts = experts.data();
                job->weights = weights.data();
                job->P = int(P);
                job->fast = fast;
                job->wave_chunks = wave_chunks;
                if (slab_blocks < 0) throw std::invalid_argument("slab_blocks: must be >= 0");
                job->slab_blocks = slab_blocks;
                job->cancel_after_chunks = cancel_after_chunks;
                rt.pool().submit(job);
                NativeJob nj;
                nj.job = job;
                return nj;
            },
            nb::arg("layer"), nb::arg("x"), nb::arg("tokens"), nb::arg("experts"), nb::arg("weights"), nb::arg("out"),
            nb::arg("fast"), nb::arg("wave_chunks"), nb::arg("slab_blocks"), nb::arg("cancel_after_chunks") = -1);

    nb::class_<NativeLayer>(m, "Layer")
        .def(nb::init<int, int, float>(), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("limit"))
        .def("add_expert", &NativeLayer::add_expert, nb::arg("gate_trellis"), nb::arg("gate_suh"), nb::arg("gate_svh"),
             nb::arg("gate_bias").none(), nb::arg("gate_codebook"), nb::arg("up_trellis"), nb::arg("up_suh"),
             nb::arg("up_svh"), nb::arg("up_bias").none(), nb::arg("up_codebook"), nb::arg("down_trellis"),
             nb::arg("down_suh"), nb::arg("down_svh"), nb::arg("down_bias").none(), nb::arg("down_codebook"))
        .def_prop_ro("num_experts", &NativeLayer::num_experts);

    nb::class_<NativeJob>(m, "Job")
        .def("done", &NativeJob::done)
        .def("wait", &NativeJob::wait, nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>())
        .def("cancel", &NativeJob::cancel)
        .def("error", &NativeJob::error)
        .def("computed", &NativeJob::computed)
        .def("elapsed_s", &NativeJob::elapsed_s)
        .def("phase_s", &NativeJob::phase_s);

    // Test hooks: the decoded tile of the kernels' own state extraction (scalar path) for cross-checks.
    m.def("tile_states", [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tile, int bits2) {
        const cpu_tier::TrellisTables& tb = cpu_tier::trellis_tables(bits2);
        if (tile.shape(0) != size_t(tb.tile_bytes)) throw std::invalid_argument("tile: wrong size");
        auto* data = new std::vector<uint16_t>(256);
        for (int t = 0; t < 256; ++t) (*data)[size_t(t)] = uint16_t(tile_state(tile.data(), tb, t));
        nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<uint16_t>*>(p); });
        return nb::ndarray<nb::numpy, uint16_t, nb::ndim<1>>(data->data(), {data->size()}, owner);
    });
}
