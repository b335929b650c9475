// The production runtime of one ISA variant: a worker pool (pool.h) that runs the jobs of jobs.h, and the checked
// construction of a kernel's matrix from the arrays Python passes. Shared by module.cpp (the bindings) and
// bench_probes.cpp (the benchmark's probes, which run on the same pool).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "amx.h"
#include "jobs.h"
#include "kernel.h"
#include "pool.h"
#include "tables.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

namespace nb = nanobind;


using F32_2D = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32_1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32_1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16_1D = nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I16_3D = nb::ndarray<const int16_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

inline MatRef make_mat(const I16_3D& trellis, const U16_1D& suh, const U16_1D& svh, nb::object bias, int codebook,
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
            const KernelTable& kt = kernel_table();
            if (!kt.amx)
                throw std::invalid_argument("amx: this kernel variant (" + std::string(kt.isa) + ") has no AMX kernels");
            if (!kt.emulated) {
                const std::string why = amx_request_permission();
                if (!why.empty()) throw std::runtime_error("amx: " + why);
            }
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

    std::unique_ptr<Pool> pool_;
};

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
