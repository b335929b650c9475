// nanobind module of one ISA variant: _native_scalar, _native_avx2, _native_avx512 or _native_avx512emu
// (CPU_TIER_MODULE). Arrays cross as nb::ndarray (numpy, or anything DLPack on the CPU); every wait and every blocking
// compute runs with the GIL released. Validation with clear messages happens in Python (cpu_tier/tier.py); the checks
// here guard the native invariants. The benchmark's probes live in bench_probes.cpp (the `bench` submodule).
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

#include "common.h"
#include "jobs.h"
#include "kernel.h"
#include "runtime.h"
#include "stream_call.h"
#include "tables.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

void bind_bench_probes(nb::module_& m);  // bench_probes.cpp

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


using I32_2D_W = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using I32_2D = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32_2D_R = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8_2D = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The binding of stream_call.h: checks the buffers' shapes once; the Python object keeps the runtime and the
// arrays alive (the caller keeps this object alive while its host functions may run).
class NativeStreamCall {
   public:
    NativeStreamCall(Runtime& rt, NativeLayer& layer, F32_2D_R x, I32_2D ids, F32_2D_R weights, U8_2D hit, F32_2D xrows,
                     F32_2D out, I32_2D_W missing, bool fast, int wave_chunks, int slab_blocks, double deadline_factor,
                     double deadline_floor_s, double fixed_s, std::vector<double> expert_s, int cancel_after_chunks)
        : c_(std::make_unique<StreamCall>()) {
        const int H = layer.layer_->H;
        const size_t T = x.shape(0), K = ids.shape(1);
        if (T == 0 || K == 0) throw std::invalid_argument("x, ids: need at least one row and one pick per row");
        if (x.shape(1) != size_t(H)) throw std::invalid_argument("x: wrong hidden size");
        if (ids.shape(0) != T || weights.shape(0) != T || weights.shape(1) != K || hit.shape(0) != T ||
            hit.shape(1) != K || missing.shape(0) != T || missing.shape(1) != K)
            throw std::invalid_argument("ids, weights, hit, missing: must all be [T, K] with x's T rows");
        if (xrows.shape(0) != T * K || xrows.shape(1) != size_t(H) || out.shape(0) != T * K || out.shape(1) != size_t(H))
            throw std::invalid_argument("xrows, out: must be [T * K, H]");
        if (wave_chunks < 1 || slab_blocks < 0) throw std::invalid_argument("wave_chunks >= 1, slab_blocks >= 0");
        if (!(deadline_factor >= 0) || !(deadline_floor_s >= 0) || !(fixed_s >= 0))
            throw std::invalid_argument("deadline_factor, deadline_floor_s, fixed_s: must be >= 0");
        if (expert_s.size() != size_t(MAXM))
            throw std::invalid_argument("expert_s: one predicted time per token count 1.." + std::to_string(MAXM));
        StreamCall& c = *c_;
        c.layer = layer.layer_;
        c.pool = &rt.pool();
        c.T = int(T);
        c.K = int(K);
        c.H = H;
        c.x = x.data();
        c.ids = ids.data();
        c.weights = weights.data();
        c.hit = hit.data();
        c.xrows = xrows.data();
        c.out = out.data();
        c.missing = missing.data();
        c.fast = fast;
        c.wave_chunks = wave_chunks;
        c.slab_blocks = slab_blocks;
        c.deadline_factor = deadline_factor;
        c.deadline_floor_s = deadline_floor_s;
        c.fixed_s = fixed_s;
        for (int i = 0; i < MAXM; ++i) c.expert_s[i] = expert_s[size_t(i)];
        c.cancel_after_chunks = cancel_after_chunks;
    }
    uintptr_t address() const { return reinterpret_cast<uintptr_t>(c_.get()); }
    void submit() { stream_call_submit(c_.get()); }
    void wait() { stream_call_wait(c_.get()); }
    std::vector<double> counters() const {
        const StreamCall& c = *c_;
        return {double(c.calls.load()), double(c.picks.load()), double(c.deadline_misses.load()),
                double(c.missed_picks.load()), double(c.errors.load()), double(c.run_ns.load()) * 1e-9,
                double(c.wait_ns.load()) * 1e-9, double(c.submit_ns.load()) * 1e-9, double(c.span_ns.load()) * 1e-9,
                double(c.predicted_ns.load()) * 1e-9};
    }
    std::string last_error() const { return c_->last_error; }

   private:
    std::unique_ptr<StreamCall> c_;
};

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier

using namespace cpu_tier::CPU_TIER_NS;

NB_MODULE(CPU_TIER_MODULE, m) {
    m.doc() = "cpu_tier native EXL3 kernels, one ISA variant";
    m.def("isa", [] { return std::string(kernel_table().isa); });
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
    m.def("has_amx_kernels", [] { return kernel_table().amx; });

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


    nb::class_<NativeStreamCall>(m, "StreamCall")
        .def(nb::init<Runtime&, NativeLayer&, F32_2D_R, I32_2D, F32_2D_R, U8_2D, F32_2D, F32_2D, I32_2D_W, bool, int, int,
                      double, double, double, std::vector<double>, int>(),
             nb::arg("runtime"), nb::arg("layer"), nb::arg("x"), nb::arg("ids"), nb::arg("weights"), nb::arg("hit"),
             nb::arg("xrows"), nb::arg("out"), nb::arg("missing"), nb::arg("fast"), nb::arg("wave_chunks"),
             nb::arg("slab_blocks"), nb::arg("deadline_factor"), nb::arg("deadline_floor_s"), nb::arg("fixed_s"),
             nb::arg("expert_s"), nb::arg("cancel_after_chunks") = -1, nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>())
        .def_prop_ro("address", &NativeStreamCall::address)
        .def("submit", &NativeStreamCall::submit, nb::call_guard<nb::gil_scoped_release>())
        .def("wait", &NativeStreamCall::wait, nb::call_guard<nb::gil_scoped_release>())
        .def("counters", &NativeStreamCall::counters)
        .def("last_error", &NativeStreamCall::last_error);
    m.def("stream_call_functions", [] {
        return std::vector<uintptr_t>{reinterpret_cast<uintptr_t>(&stream_call_submit),
                                      reinterpret_cast<uintptr_t>(&stream_call_wait)};
    }, "the addresses of the CUDA host functions (void(void*)) that submit and wait for a StreamCall");

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

    m.def("decode_exact", [](nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> states, int codebook) {
        if (codebook < 0 || codebook > cpu_tier::DECODE_MUL1_SPLIT)
            throw std::invalid_argument("codebook: must be 0 (3inst), 1 (mcg), 2 (mul1) or 3 (mul1 as the exact kernel computes it)");
        if (states.shape(0) % 16) throw std::invalid_argument("states: length must be a multiple of 16");
        auto* data = new std::vector<float>(states.shape(0));
        kernel_table().decode_exact(codebook, states.data(), states.shape(0), data->data());
        nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
        return nb::ndarray<nb::numpy, float, nb::ndim<1>>(data->data(), {data->size()}, owner);
    }, "test hook: the float path's exact codebook values of states, as this variant's kernels decode them");

    bind_bench_probes(m);
}
