// A small fixed thread pool with a blocking parallel-for in which the calling thread takes part.
//
// Engram gathers are I/O bound when the table is not in the page cache: every row is one or two
// synchronous page faults, so the pool is sized by the I/O queue depth wanted (tens of threads), not
// by the core count. The threads never touch Python objects.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace engram_mmap {

// One parallel-for: `n_tasks` calls of `fn(task)`, claimed dynamically by whoever runs `run_some`.
class Batch {
 public:
  Batch(size_t n_tasks, std::function<void(size_t)> fn) : n_tasks_(n_tasks), fn_(std::move(fn)) {}

  bool exhausted() const { return next_.load(std::memory_order_relaxed) >= n_tasks_; }

  void run_some() {
    for (;;) {
      size_t task = next_.fetch_add(1, std::memory_order_relaxed);
      if (task >= n_tasks_) return;
      try {
        fn_(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_tasks_) {
        std::lock_guard<std::mutex> lock(mutex_);
        finished_ = true;
        cv_.notify_all();
      }
    }
  }

  // Blocks until every task has finished, then rethrows the first task exception, if any.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return finished_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  const size_t n_tasks_;
  std::function<void(size_t)> fn_;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> done_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::exception_ptr error_;
};

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads) {
    for (int i = 0; i < n_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return (int)workers_.size(); }

  // Runs fn(0) .. fn(n_tasks - 1) on the pool and the calling thread; returns when all are done.
  void parallel_for(size_t n_tasks, std::function<void(size_t)> fn) {
    if (n_tasks == 0) return;
    if (n_tasks == 1 || workers_.empty()) {
      for (size_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    auto batch = std::make_shared<Batch>(n_tasks, std::move(fn));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(batch);
    }
    // The caller runs one share itself, so at most n_tasks - 1 helpers are useful.
    if (n_tasks - 1 >= workers_.size()) {
      cv_.notify_all();
    } else {
      for (size_t i = 0; i + 1 < n_tasks; ++i) cv_.notify_one();
    }
    batch->run_some();
    batch->wait();
  }

 private:
  void worker_loop() {
    for (;;) {
      std::shared_ptr<Batch> batch;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        batch = queue_.front();
        if (batch->exhausted()) {
          queue_.pop_front();
          continue;
        }
      }
      batch->run_some();
    }
  }

  std::vector<std::thread> workers_;
  std::deque<std::shared_ptr<Batch>> queue_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace engram_mmap
