// The native half of EngramTable: the row gather from two mapped tensors (fp8 rows, e8m0 scales).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "mapping.h"
#include "pool.h"

namespace engram_mmap {

// The completion state of one asynchronous gather or prefetch. Holds no Python objects, so the
// driver thread may drop its reference at any time.
class Work {
 public:
  void finish(size_t result, std::exception_ptr error);
  bool done();
  // Blocks until finished; rethrows the work's exception; returns its result (unique rows read).
  size_t wait();
  std::vector<int64_t> owned_ids;  // prefetch keeps its own copy of the row ids

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  size_t result_ = 0;
  std::exception_ptr error_;
};

// A tensor inside a mapped file: `rows` rows of `row_bytes` bytes starting at byte `offset`.
struct TensorSpan {
  std::shared_ptr<Mapping> mapping;
  uint64_t offset;
  uint64_t row_bytes;
};

class Table {
 public:
  // readahead_max_rows: gathers with at most this many distinct rows first submit POSIX_FADV_WILLNEED
  // for all of them (all reads in flight at once) and then copy on the calling thread alone; larger
  // gathers copy on the pool, whose threads fault pages synchronously (queue depth = threads).
  // resident_scales: copy the whole scale tensor (rows x 8 bytes, 1/33 of the table) into process
  // memory at construction, so that a cold row costs one page read instead of two.
  Table(TensorSpan weight, TensorSpan scale, uint64_t rows, int n_threads, bool dedup, uint64_t readahead_max_rows,
        bool resident_scales);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  uint64_t rows() const { return rows_; }
  uint64_t weight_row_bytes() const { return weight_.row_bytes; }
  uint64_t scale_row_bytes() const { return scale_.row_bytes; }
  bool resident_scales() const { return !scale_copy_.empty(); }
  int n_threads() const { return pool_.size(); }

  // Throws std::out_of_range naming the first id outside [0, rows).
  void check_ids(const int64_t* ids, size_t n) const;

  // Copies row ids[i] to out_weight[i] and out_scale[i]; returns the number of distinct rows read
  // from the mapping. Validates ids first, so an error leaves the outputs untouched. With
  // zero_invalid, an id outside [0, rows) is not an error: its output row and scales are zero bytes
  // (what vLLM's Engram lookup writes for an id it does not own, e.g. a dead token's -1).
  size_t gather(const int64_t* ids, size_t n, uint8_t* out_weight, uint8_t* out_scale, bool zero_invalid = false);

  // Starts reading the rows into the page cache (POSIX_FADV_WILLNEED); returns once the reads are
  // submitted, which may itself wait when the device queue is full.
  void prefetch(const int64_t* ids, size_t n);

  // The same two operations on the table's driver thread, in submission order.
  std::shared_ptr<Work> gather_async(const int64_t* ids, size_t n, uint8_t* out_weight, uint8_t* out_scale,
                                     bool zero_invalid = false);
  std::shared_ptr<Work> prefetch_async(std::vector<int64_t> ids);

  // Waits for queued asynchronous work, stops the threads. Further calls raise.
  void close();
  bool closed() const { return closed_; }

 private:
  void check_open() const;
  void check_files() const;
  size_t dedup(const int64_t* ids, size_t n, int32_t* first);
  size_t chunk_size(size_t n) const;
  void advise_row(int64_t row) const;
  bool sample_resident(const int64_t* ids, size_t n) const;
  bool valid(int64_t id) const { return id >= 0 && (uint64_t)id < rows_; }
  std::shared_ptr<Work> submit(std::shared_ptr<Work> work, std::function<size_t()> fn);
  void driver_loop();

  TensorSpan weight_;
  TensorSpan scale_;
  const uint8_t* weight_base_;
  const uint8_t* scale_base_;
  uint64_t rows_;
  bool dedup_;
  uint64_t readahead_max_rows_;
  int cores_;
  std::vector<uint8_t> scale_copy_;  // the scales, when resident_scales
  bool closed_ = false;
  std::shared_mutex use_mutex_;  // shared by gather/prefetch, exclusive in close()
  ThreadPool pool_;

  std::thread driver_;
  std::mutex driver_mutex_;
  std::condition_variable driver_cv_;
  std::deque<std::pair<std::shared_ptr<Work>, std::function<size_t()>>> driver_queue_;
  bool driver_stop_ = false;
};

// Random reads of `block` bytes at block-aligned offsets in [lo, hi) of `path` from `n_threads`
// threads (pread; O_DIRECT when `direct`). Returns the wall seconds for all `n_reads` reads.
double random_read(const std::string& path, uint64_t lo, uint64_t hi, uint64_t n_reads, int n_threads,
                   uint64_t block, bool direct, uint64_t seed);

}  // namespace engram_mmap
