// Persistent worker pool: one coordinator thread runs queued jobs, phase after phase; helper threads join every
// phase's parallel-for. Idle threads spin for spin_us, then park on a condition variable. Threads are pinned to
// the configured cores (worker w -> cpus[w % len(cpus)]).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define CT_PAUSE() _mm_pause()
#else
#define CT_PAUSE() std::this_thread::yield()
#endif

namespace cpu_tier {
namespace CPU_TIER_NS {

inline uint64_t now_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
}

class Pool;

// A job: run() executes its phases through pool.parallel_for on the coordinator thread.
class JobBase {
   public:
    virtual ~JobBase() = default;
    virtual void run(Pool& pool) = 0;
    std::atomic<bool> cancelled{false};

    bool done() const { return done_.load(std::memory_order_acquire); }
    // Wait until the job is done; timeout_s < 0 waits forever. True when done.
    bool wait(double timeout_s) {
        if (done()) return true;
        std::unique_lock<std::mutex> lk(mu_);
        if (timeout_s < 0) {
            cv_.wait(lk, [&] { return done(); });
            return true;
        }
        return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done(); });
    }
    void finish() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            done_.store(true, std::memory_order_release);
        }
        cv_.notify_all();
    }
    std::string error;  // set when run() threw

   private:
    std::atomic<bool> done_{false};
    std::mutex mu_;
    std::condition_variable cv_;
};

class Pool {
   public:
    // amx_min_tokens > 0: jobs on this pool run the AMX kernels for chunks of at least that many tokens where they
    // apply (the caller checked the host and the OS grant); 0: never.
    // prefetch_blocks: the kernels' software prefetch distance (Acts::pf_blocks).
    Pool(int threads, std::vector<int> cpus, int spin_us, int amx_min_tokens = 0, int prefetch_blocks = 1)
        : nthreads_(threads),
          cpus_(std::move(cpus)),
          spin_us_(spin_us),
          amx_min_tokens_(amx_min_tokens),
          prefetch_blocks_(prefetch_blocks) {
        if (threads < 1) throw std::invalid_argument("threads must be >= 1");
        for (int w = 0; w < nthreads_; ++w) workers_.emplace_back([this, w] { w == 0 ? coordinator_main() : helper_main(w); });
    }
    ~Pool() { shutdown(); }

    void shutdown() {
        {
            std::lock_guard<std::mutex> lk(qmu_);
            if (stop_) return;
            stop_ = true;
        }
        qcv_.notify_all();
        {
            std::lock_guard<std::mutex> lk(park_mu_);
            stopping_.store(true, std::memory_order_seq_cst);
        }
        park_cv_.notify_all();
        for (auto& t : workers_)
            if (t.joinable()) t.join();
        workers_.clear();
        // Jobs never started still get finished (as cancelled), so no waiter hangs.
        std::deque<std::shared_ptr<JobBase>> left;
        {
            std::lock_guard<std::mutex> lk(qmu_);
            left.swap(queue_);
        }
        for (auto& j : left) {
            j->cancelled.store(true);
            j->error = "the worker pool was shut down before the job ran";
            j->finish();
        }
    }

    void submit(std::shared_ptr<JobBase> job) {
        {
            std::lock_guard<std::mutex> lk(qmu_);
            if (stop_) throw std::runtime_error("the worker pool is closed");
            queue_.push_back(std::move(job));
            qcount_.fetch_add(1);
        }
        qcv_.notify_one();
    }

    int threads() const { return nthreads_; }
    const std::vector<int>& cpus() const { return cpus_; }
    int amx_min_tokens() const { return amx_min_tokens_; }
    bool amx_for(int m) const { return amx_min_tokens_ > 0 && m >= amx_min_tokens_; }
    int prefetch_blocks() const { return prefetch_blocks_; }
    bool stopping() const { return stopping_.load(std::memory_order_relaxed); }

    // Run fn(unit, worker) for unit in [0, n) on every worker; only the coordinator thread may call this.
    void parallel_for(int n, const std::function<void(int, int)>& fn) {
        if (n <= 0) return;
        if (n >= (1 << 20)) throw std::invalid_argument("parallel_for: too many work units");
        if (nthreads_ == 1 || n == 1) {
            for (int i = 0; i < n; ++i) fn(i, 0);
            return;
        }
        unit_failed_.store(false);
        task_fn_ = &fn;
        task_n_ = n;
        done_.store(0, std::memory_order_relaxed);
        const uint64_t gen = (gen_ + 1) & 0xFFFFFFu;
        gen_ = gen;
        // claim word: generation (24 bits) | n (20 bits) | next (20 bits)
        claim_.store((gen << 40) | (uint64_t(n) << 20), std::memory_order_seq_cst);
        if (parked_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lk(park_mu_);
            park_cv_.notify_all();
        }
        run_units(0);
        while (done_.load(std::memory_order_acquire) < n) CT_PAUSE();
        // Close the phase so that late helpers cannot claim anything from it.
        claim_.store((gen << 40) | (uint64_t(n) << 20) | uint64_t(n), std::memory_order_seq_cst);
        task_fn_ = nullptr;
        if (unit_failed_.load()) throw std::runtime_error("a work unit failed");
    }

    // Scratch memory for the running job (jobs run one at a time on the coordinator), reused across jobs.
    uint8_t* scratch(size_t bytes) {
        if (scratch_.size() < bytes) scratch_.resize(bytes + bytes / 4);
        return scratch_.data();
    }

   private:
    bool run_units(int w) {
        bool any = false;
        for (;;) {
            uint64_t c = claim_.load(std::memory_order_acquire);
            const uint64_t n = (c >> 20) & 0xFFFFFu, next = c & 0xFFFFFu;
            if (next >= n) return any;
            if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
            // A successful claim of unit `next` pins this phase: it cannot end before our done_ increment.
            try {
                (*task_fn_)(int(next), w);
            } catch (...) {
                unit_failed_.store(true);
            }
            done_.fetch_add(1, std::memory_order_acq_rel);
            any = true;
        }
    }

    void pin(int w) {
        if (cpus_.empty()) return;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus_[size_t(w) % cpus_.size()], &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a refused pin is not fatal
    }

    uint64_t spin_ns() const { return uint64_t(spin_us_) * 1000u; }

    bool claimable() const {
        const uint64_t c = claim_.load(std::memory_order_seq_cst);
        return (c & 0xFFFFFu) < ((c >> 20) & 0xFFFFFu);
    }

    void helper_main(int w) {
        pin(w);
        for (;;) {
            if (run_units(w)) continue;
            // Nothing to claim: spin for spin_us, then park until a phase is published.
            const uint64_t t0 = now_ns();
            bool fresh = false;
            while (now_ns() - t0 < spin_ns()) {
                for (int i = 0; i < 32; ++i) CT_PAUSE();
                if (claimable()) {
                    fresh = true;
                    break;
                }
                if (stopping()) return;
            }
            if (fresh) continue;
            std::unique_lock<std::mutex> lk(park_mu_);
            parked_.fetch_add(1, std::memory_order_seq_cst);
            park_cv_.wait(lk, [&] { return claimable() || stopping(); });
            parked_.fetch_sub(1, std::memory_order_seq_cst);
            if (stopping()) return;
        }
    }

    void coordinator_main() {
        pin(0);
        for (;;) {
            std::shared_ptr<JobBase> job;
            {
                // Spin on the queue for spin_us, then park.
                const uint64_t t0 = now_ns();
                for (;;) {
                    if (qcount_.load(std::memory_order_acquire) > 0 || stopping()) {
                        std::lock_guard<std::mutex> lk(qmu_);
                        if (!queue_.empty()) {
                            job = std::move(queue_.front());
                            queue_.pop_front();
                            qcount_.fetch_sub(1);
                            break;
                        }
                        if (stop_) return;
                    }
                    if (now_ns() - t0 >= spin_ns()) {
                        std::unique_lock<std::mutex> lk(qmu_);
                        qcv_.wait(lk, [&] { return !queue_.empty() || stop_; });
                        if (queue_.empty()) return;
                        job = std::move(queue_.front());
                        queue_.pop_front();
                        qcount_.fetch_sub(1);
                        break;
                    }
                    for (int i = 0; i < 64; ++i) CT_PAUSE();
                }
            }
            try {
                job->run(*this);
            } catch (const std::exception& e) {
                job->error = e.what();
            } catch (...) {
                job->error = "unknown error in a native job";
            }
            job->finish();
        }
    }

    int nthreads_;
    std::vector<int> cpus_;
    int spin_us_;
    int amx_min_tokens_ = 0;
    int prefetch_blocks_ = 1;
    std::vector<std::thread> workers_;

    std::mutex qmu_;
    std::condition_variable qcv_;
    std::deque<std::shared_ptr<JobBase>> queue_;
    bool stop_ = false;
    std::atomic<int> qcount_{0};

    const std::function<void(int, int)>* task_fn_ = nullptr;
    int task_n_ = 0;
    uint64_t gen_ = 0;
    std::atomic<uint64_t> claim_{0};
    std::atomic<int> done_{0};
    std::atomic<bool> unit_failed_{false};
    std::vector<uint8_t> scratch_;

    std::mutex park_mu_;
    std::condition_variable park_cv_;
    std::atomic<int> parked_{0};
    std::atomic<bool> stopping_{false};
};

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
