// A MoE layer call that a GPU stream drives, with no host thread of the caller in the loop: the caller queues, in
// stream order, the copies of its inputs into pinned buffers, a host function running `stream_call_submit` (builds
// the picks from the routing and starts the job on the pool), its own GPU work, a host function running
// `stream_call_wait` (waits for the job up to its deadline; the picks it did not compute are listed for the GPU)
// and the copies of the results back. Both functions have the signature of a CUDA host function (void(void*)) and
// take the StreamCall as their argument; they run on the driver's thread, one after the other, never concurrently
// for one StreamCall, and never throw.
//
// Inputs (row-major, pinned or any host memory; read between submit and wait):
//   x [T][H] f32, ids [T][K] i32 (< 0: no pick), weights [T][K] f32, hit [T][K] u8 (non-zero: the GPU computes it).
// Outputs:
//   out [T*K][H] f32: row t*K+j = weights[t][j] * expert(ids[t][j])(x[t]) for every pick the CPU tier computed,
//     zeros in every other row (a GPU adds its own picks' rows: the sum is the same whatever computed which pick);
//   missing [T][K] i32: the expert id of each CPU pick not computed (deadline, error, closed pool), -1 elsewhere;
//   xrows [T*K][H] f32: scratch (each CPU pick's input row).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "jobs.h"
#include "pool.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

struct StreamCall {
    // fixed at construction
    std::shared_ptr<const Layer> layer;
    Pool* pool = nullptr;  // the runtime's pool (the Python object keeps the runtime alive)
    int T = 0, K = 0, H = 0;
    const float* x = nullptr;
    const int32_t* ids = nullptr;
    const float* weights = nullptr;
    const uint8_t* hit = nullptr;
    float* xrows = nullptr;
    float* out = nullptr;
    int32_t* missing = nullptr;
    bool fast = false;
    int wave_chunks = 64, slab_blocks = 0;
    int cancel_after_chunks = -1;  // test hook (MoeJob's): each job cancels itself after this many chunks
    // deadline = factor * (fixed_s + sum over distinct experts of expert_s[min(m, 8) - 1]) + floor_s; factor 0: none
    double deadline_factor = 0.0, deadline_floor_s = 0.0, fixed_s = 0.0;
    double expert_s[MAXM] = {};

    // touched by the stream's host thread only (submit, then wait)
    std::shared_ptr<MoeJob> job;
    std::vector<int32_t> tokens, experts, flat;
    std::vector<float> wts;
    std::vector<int> per_expert;
    uint64_t submitted_ns = 0;
    double predicted_s = 0.0;
    int invalid = 0;  // picks with an expert id out of range (listed as missing, never computed)

    // counters (read by the caller at any time)
    std::atomic<uint64_t> calls{0}, picks{0}, deadline_misses{0}, missed_picks{0}, errors{0};
    std::atomic<uint64_t> run_ns{0}, wait_ns{0}, submit_ns{0}, span_ns{0}, predicted_ns{0};
    std::string last_error;  // (written by the host thread; read after the stream is synchronized)

    void do_submit() {
        const uint64_t t0 = now_ns();
        const int E = int(layer->experts.size());
        const size_t P = size_t(T) * size_t(K);
        tokens.clear();
        experts.clear();
        wts.clear();
        flat.clear();
        invalid = 0;
        std::fill(missing, missing + P, -1);
        per_expert.assign(size_t(E), 0);
        for (size_t p = 0; p < P; ++p) {
            const int32_t e = ids[p];
            if (e < 0 || hit[p]) continue;
            if (e >= E) {  // never computed: the GPU gets it (and the error is counted)
                missing[p] = e;
                ++invalid;
                continue;
            }
            const size_t t = p / size_t(K);
            std::memcpy(xrows + p * size_t(H), x + t * size_t(H), size_t(H) * sizeof(float));
            tokens.push_back(int32_t(p));
            experts.push_back(e);
            wts.push_back(weights[p]);
            flat.push_back(int32_t(p));
            ++per_expert[size_t(e)];
        }
        if (invalid) {
            errors.fetch_add(1);
            last_error = "expert id out of range [0, " + std::to_string(E) + ")";
        }
        predicted_s = 0.0;
        if (!experts.empty()) {
            predicted_s = fixed_s;
            for (int c : per_expert)
                if (c) predicted_s += expert_s[std::min(c, MAXM) - 1];
        }
        job.reset();
        bool started = false;
        uint64_t handed = 0;  // when the job went to the workers: its span and deadline count from there
        if (!experts.empty() && !pool->stopping()) {
            auto j = std::make_shared<MoeJob>();
            j->layer = layer;
            j->x = xrows;
            j->out = out;
            j->T = int(P);
            j->tokens = tokens.data();
            j->experts = experts.data();
            j->weights = wts.data();
            j->P = int(experts.size());
            j->fast = fast;
            j->wave_chunks = wave_chunks;
            j->slab_blocks = slab_blocks;
            j->cancel_after_chunks = cancel_after_chunks;
            try {
                handed = now_ns();
                pool->submit(j);
                job = std::move(j);
                started = true;
            } catch (const std::exception& e) {
                last_error = e.what();
            }
        }
        if (!started) {
            std::memset(out, 0, P * size_t(H) * sizeof(float));
            if (!experts.empty()) {  // the pool is closed: the GPU computes every pick
                errors.fetch_add(1);
                if (pool->stopping()) last_error = "the worker pool is closed";
                for (size_t i = 0; i < flat.size(); ++i) missing[flat[i]] = experts[i];
                missed_picks.fetch_add(flat.size());
            }
        }
        calls.fetch_add(1);
        picks.fetch_add(experts.size());
        predicted_ns.fetch_add(uint64_t(predicted_s * 1e9));
        const uint64_t t1 = now_ns();
        submitted_ns = started ? handed : t1;  // (the workers may finish before this thread gets here)
        submit_ns.fetch_add(t1 - t0);
    }

    // What a failure inside submit leaves: every CPU pick listed for the GPU, zeros in out.
    void fail_all() noexcept {
        const size_t P = size_t(T) * size_t(K);
        for (size_t p = 0; p < P; ++p) missing[p] = (ids[p] >= 0 && !hit[p]) ? ids[p] : -1;
        std::memset(out, 0, P * size_t(H) * sizeof(float));
        job.reset();
        errors.fetch_add(1);
    }

    void do_wait() {
        const uint64_t t0 = now_ns();
        if (!job) return;
        bool done = true;
        if (deadline_factor > 0) {
            const double limit = deadline_factor * predicted_s + deadline_floor_s;
            const double left = limit - double(t0 - submitted_ns) * 1e-9;
            done = job->wait(std::max(left, 0.0));
        } else {
            job->wait(-1);
        }
        if (!done) {
            job->cancelled.store(true);
            job->wait(-1);
            deadline_misses.fetch_add(1);
        }
        const bool failed = !job->error.empty();
        if (failed) {
            errors.fetch_add(1);
            last_error = job->error;
        }
        uint64_t lost = 0;
        const auto& comp = job->computed;
        for (size_t i = 0; i < flat.size(); ++i) {
            if (!failed && i < comp.size() && comp[i]) continue;
            missing[flat[i]] = experts[i];
            std::memset(out + size_t(flat[i]) * size_t(H), 0, size_t(H) * sizeof(float));
            ++lost;
        }
        missed_picks.fetch_add(lost);
        if (job->t_end_ns > job->t_start_ns) run_ns.fetch_add(job->t_end_ns - job->t_start_ns);
        const uint64_t t1 = now_ns();
        wait_ns.fetch_add(t1 - t0);
        span_ns.fetch_add(t1 - submitted_ns);
        job.reset();
    }
};

// CUDA host functions (CUhostFn / cudaHostFn_t): never throw.
inline void stream_call_submit(void* p) noexcept {
    auto* c = static_cast<StreamCall*>(p);
    try {
        c->do_submit();
    } catch (...) {
        c->fail_all();
    }
}

inline void stream_call_wait(void* p) noexcept {
    auto* c = static_cast<StreamCall*>(p);
    try {
        c->do_wait();
    } catch (...) {
        c->errors.fetch_add(1);
    }
}

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
