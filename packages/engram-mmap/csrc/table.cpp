#include "table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace engram_mmap {

// ---------------------------------------------------------------------------------------------- Work

void Work::finish(size_t result, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  result_ = result;
  error_ = error;
  done_ = true;
  cv_.notify_all();
}

bool Work::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

size_t Work::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
  return result_;
}

// --------------------------------------------------------------------------------------------- Table

namespace {

constexpr uint64_t kPage = 4096;

void check_span(const TensorSpan& span, uint64_t rows, const char* what) {
  if (!span.mapping || span.mapping->closed()) throw std::invalid_argument(std::string(what) + ": mapping is closed");
  if (span.row_bytes == 0) throw std::invalid_argument(std::string(what) + ": row_bytes must be positive");
  const uint64_t size = span.mapping->size();
  if (rows > (std::numeric_limits<uint64_t>::max() - span.offset) / span.row_bytes ||
      span.offset + rows * span.row_bytes > size)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(rows) + " rows of " +
                                std::to_string(span.row_bytes) + " bytes at offset " + std::to_string(span.offset) +
                                " do not fit in the " + std::to_string(size) + "-byte mapping of '" +
                                span.mapping->path() + "'");
}

}  // namespace

Table::Table(TensorSpan weight, TensorSpan scale, uint64_t rows, int n_threads, bool dedup,
             uint64_t readahead_max_rows, bool resident_scales)
    : weight_(std::move(weight)),
      scale_(std::move(scale)),
      rows_(rows),
      dedup_(dedup),
      readahead_max_rows_(readahead_max_rows),
      cores_(std::max(1, (int)std::thread::hardware_concurrency())),
      // The calling thread takes part in every parallel-for, so the pool holds n_threads - 1.
      pool_(std::max(0, n_threads - 1)) {
  if (n_threads < 1) throw std::invalid_argument("n_threads must be >= 1");
  check_span(weight_, rows_, "weight");
  check_span(scale_, rows_, "scale");
  weight_base_ = weight_.mapping->data() + weight_.offset;
  scale_base_ = scale_.mapping->data() + scale_.offset;
  if (resident_scales && rows_ > 0) {
    const uint64_t bytes = rows_ * scale_.row_bytes;
    const int fd = scale_.mapping->fd();
    // One sequential pass: ask for large readahead, read into the copy, drop the file pages again.
    (void)::posix_fadvise(fd, (off_t)scale_.offset, (off_t)bytes, POSIX_FADV_SEQUENTIAL);
    scale_copy_.resize(bytes);
    constexpr uint64_t kStep = 8 << 20;
    const size_t parts = (bytes + kStep - 1) / kStep;
    pool_.parallel_for(parts, [&](size_t p) {
      const uint64_t begin = p * kStep, len = std::min(kStep, bytes - begin);
      (void)::posix_fadvise(fd, (off_t)(scale_.offset + begin), (off_t)len, POSIX_FADV_WILLNEED);
      std::memcpy(scale_copy_.data() + begin, scale_base_ + begin, len);
    });
    // Back to random access for this fd, and release the file's copy of the scales (unmap our
    // pages of the range first: mapped pages cannot be dropped). Advisory only.
    (void)::posix_fadvise(fd, (off_t)scale_.offset, (off_t)bytes, POSIX_FADV_RANDOM);
    const uint64_t first_page = scale_.offset / kPage * kPage;
    (void)::madvise(const_cast<uint8_t*>(scale_.mapping->data()) + first_page, scale_.offset + bytes - first_page,
                    MADV_DONTNEED);
    (void)::posix_fadvise(fd, (off_t)scale_.offset, (off_t)bytes, POSIX_FADV_DONTNEED);
    scale_base_ = scale_copy_.data();
  }
  driver_ = std::thread([this] { driver_loop(); });
}

Table::~Table() { close(); }

void Table::close() {
  {
    std::lock_guard<std::mutex> lock(driver_mutex_);
    if (driver_stop_) return;
    driver_stop_ = true;  // submit() refuses from now on; the driver drains what is queued
  }
  driver_cv_.notify_all();
  if (driver_.joinable()) driver_.join();
  // Wait for synchronous calls from other threads, then refuse new ones.
  std::unique_lock<std::shared_mutex> lock(use_mutex_);
  closed_ = true;
}

void Table::check_open() const {
  if (closed_) throw std::runtime_error("the Engram table is closed");
}

void Table::check_files() const {
  // A file truncated after it was mapped turns reads past its new end into SIGBUS: refuse instead.
  for (const TensorSpan* span : {&weight_, &scale_}) {
    uint64_t now = span->mapping->current_file_size();
    uint64_t end = span->offset + rows_ * span->row_bytes;
    if (now < end)
      throw std::runtime_error("'" + span->mapping->path() + "' shrank to " + std::to_string(now) +
                               " bytes after it was opened; the table needs " + std::to_string(end));
  }
}

void Table::check_ids(const int64_t* ids, size_t n) const {
  // Branch-free min/max first (the common case is all valid), then locate the offender.
  int64_t lo = 0, hi = 0;
  if (n > 0) lo = hi = ids[0];
  for (size_t i = 1; i < n; ++i) {
    lo = std::min(lo, ids[i]);
    hi = std::max(hi, ids[i]);
  }
  if (n == 0 || (lo >= 0 && (uint64_t)hi < rows_)) return;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || (uint64_t)ids[i] >= rows_)
      throw std::out_of_range("row id " + std::to_string(ids[i]) + " at flat index " + std::to_string(i) +
                              " is outside the table's " + std::to_string(rows_) + " rows");
  }
}

size_t Table::chunk_size(size_t n) const {
  // About four tasks per thread for balance, one row per task when rows are few (a decode step's
  // 24 rows then fault in parallel), at most 512 rows per task.
  size_t threads = (size_t)pool_.size() + 1;
  size_t chunk = (n + 4 * threads - 1) / (4 * threads);
  return std::min<size_t>(512, std::max<size_t>(1, chunk));
}

// first[i] = the smallest j with ids[j] == ids[i]. Open addressing over 2^bits slots split into
// 2^pbits disjoint ranges by the top hash bits; task p inserts only the ids of range p, so the tasks
// need no locks and still see the ids in index order. Returns the number of distinct ids.
size_t Table::dedup(const int64_t* ids, size_t n, int32_t* first) {
  int bits = 6;
  while ((uint64_t(1) << bits) < 2 * (uint64_t)n) ++bits;
  int pbits = 0;
  if (n >= 8192) {
    // Every task scans all ids, so use no more ranges than there are cores to run them.
    const int workers = std::min(pool_.size() + 1, cores_);
    while ((1 << (pbits + 1)) <= workers && pbits + 1 <= bits - 6) ++pbits;
  }
  const uint64_t cap = uint64_t(1) << bits;
  const uint64_t part = cap >> pbits;
  std::vector<int32_t> slots(cap, -1);
  std::atomic<size_t> unique{0};
  std::atomic<bool> overflow{false};
  auto hash = [bits](int64_t id) { return ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> (64 - bits); };
  auto insert_range = [&](uint64_t p, uint64_t parts_log2, uint64_t part_slots) {
    size_t local_unique = 0, local_count = 0;
    for (size_t i = 0; i < n; ++i) {
      uint64_t h = hash(ids[i]);
      if (parts_log2 > 0 && (h >> (bits - parts_log2)) != p) continue;
      const uint64_t base = h & ~(part_slots - 1);
      uint64_t slot = h;
      for (;;) {
        int32_t j = slots[slot];
        if (j < 0) {
          if (++local_count * 2 > part_slots) {  // the range is more than half full: give up
            overflow.store(true);
            return;
          }
          slots[slot] = (int32_t)i;
          first[i] = (int32_t)i;
          ++local_unique;
          break;
        }
        if (ids[j] == ids[i]) {
          first[i] = j;
          break;
        }
        slot = base | ((slot + 1) & (part_slots - 1));
      }
    }
    unique.fetch_add(local_unique);
  };
  pool_.parallel_for(size_t(1) << pbits, [&](size_t p) { insert_range(p, pbits, part); });
  if (!overflow.load()) return unique.load();
  // Skewed hashes filled one range: redo with one range over the whole table (load <= 1/2).
  std::fill(slots.begin(), slots.end(), -1);
  unique.store(0);
  overflow.store(false);
  insert_range(0, 0, cap);
  return unique.load();
}

size_t Table::gather(const int64_t* ids, size_t n, uint8_t* out_weight, uint8_t* out_scale, bool zero_invalid) {
  std::shared_lock<std::shared_mutex> in_use(use_mutex_);
  check_open();
  if (n == 0) return 0;
  if (n > (size_t)std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("at most 2^31 - 1 row ids per gather, got " + std::to_string(n));
  if (!zero_invalid) check_ids(ids, n);
  check_files();

  std::vector<int32_t> first;
  size_t n_unique = n;
  if (dedup_ && n > 1) {
    first.resize(n);
    n_unique = dedup(ids, n, first.data());
  }
  const int32_t* fst = first.empty() ? nullptr : first.data();
  const uint64_t wb = weight_.row_bytes, sb = scale_.row_bytes;
  auto is_first = [fst](size_t i) { return fst == nullptr || fst[i] == (int32_t)i; };
  auto copy_rows = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      if (!is_first(i)) continue;
      if (!valid(ids[i])) {  // only reached with zero_invalid (ids were checked otherwise)
        std::memset(out_weight + i * wb, 0, wb);
        std::memset(out_scale + i * sb, 0, sb);
        continue;
      }
      const uint64_t row = (uint64_t)ids[i];
      std::memcpy(out_weight + i * wb, weight_base_ + row * wb, wb);
      std::memcpy(out_scale + i * sb, scale_base_ + row * sb, sb);
    }
  };
  const size_t chunk = chunk_size(n);
  const size_t tasks = (n + chunk - 1) / chunk;

  if (n_unique <= readahead_max_rows_) {
    // Few rows (a decode step): submit every read, then copy; the copy waits about one device
    // latency in all, and no pool thread needs waking.
    for (size_t i = 0; i < n; ++i)
      if (is_first(i) && valid(ids[i])) advise_row(ids[i]);
    copy_rows(0, n);
  } else if (sample_resident(ids, n)) {
    // Cached rows: the copy is CPU bound, one task per core (more threads only add switches).
    const size_t k = (size_t)std::min(cores_, pool_.size() + 1);
    const size_t per = (n + k - 1) / k;
    pool_.parallel_for(k, [&](size_t t) { copy_rows(t * per, std::min(n, (t + 1) * per)); });
  } else {
    // Rows on disk. Submitting every read with POSIX_FADV_WILLNEED first costs about a third of
    // the CPU of faulting each page synchronously (the kernel batches allocation and submission),
    // and keeps the device queue full; a few submitters suffice since each blocks only when the
    // queue is full. Then all pool threads copy, waiting on pages still in flight.
    const size_t k = (size_t)std::min(4 * cores_, pool_.size() + 1);
    const size_t per = (n + k - 1) / k;
    pool_.parallel_for(k, [&](size_t t) {
      const size_t end = std::min(n, (t + 1) * per);
      for (size_t i = t * per; i < end; ++i)
        if (is_first(i) && valid(ids[i])) advise_row(ids[i]);
    });
    pool_.parallel_for(tasks, [&](size_t t) { copy_rows(t * chunk, std::min(n, (t + 1) * chunk)); });
  }
  if (n_unique < n) {
    auto fill_repeats = [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        if (is_first(i)) continue;
        const size_t j = (size_t)fst[i];
        std::memcpy(out_weight + i * wb, out_weight + j * wb, wb);
        std::memcpy(out_scale + i * sb, out_scale + j * sb, sb);
      }
    };
    // Copies between cached buffers: not worth waking the pool for a few thousand rows.
    if (n <= 4096) {
      fill_repeats(0, n);
    } else {
      pool_.parallel_for(tasks, [&](size_t t) { fill_repeats(t * chunk, std::min(n, (t + 1) * chunk)); });
    }
  }
  return n_unique;
}

bool Table::sample_resident(const int64_t* ids, size_t n) const {
  // mincore on the weight pages of up to 32 evenly spaced rows (their scale pages are 32x denser,
  // so they are resident whenever the weight pages are).
  const size_t samples = std::min<size_t>(32, n);
  const uint8_t* base = weight_.mapping->data();
  for (size_t k = 0; k < samples; ++k) {
    const int64_t id = ids[k * n / samples];
    if (!valid(id)) continue;
    const uint64_t off = weight_.offset + (uint64_t)id * weight_.row_bytes;
    unsigned char vec = 0;
    if (::mincore(const_cast<uint8_t*>(base) + off / kPage * kPage, 1, &vec) != 0 || !(vec & 1)) return false;
  }
  return true;
}

void Table::advise_row(int64_t row) const {
  const uint64_t wb = weight_.row_bytes, sb = scale_.row_bytes;
  (void)::posix_fadvise(weight_.mapping->fd(), (off_t)(weight_.offset + (uint64_t)row * wb), (off_t)wb,
                        POSIX_FADV_WILLNEED);
  if (scale_copy_.empty())
    (void)::posix_fadvise(scale_.mapping->fd(), (off_t)(scale_.offset + (uint64_t)row * sb), (off_t)sb,
                          POSIX_FADV_WILLNEED);
}

void Table::prefetch(const int64_t* ids, size_t n) {
  std::shared_lock<std::shared_mutex> in_use(use_mutex_);
  check_open();
  check_ids(ids, n);
  check_files();
  const int wfd = weight_.mapping->fd(), sfd = scale_.mapping->fd();
  const uint64_t wb = weight_.row_bytes, sb = scale_.row_bytes;
  const uint64_t woff = weight_.offset, soff = scale_.offset;
  const size_t chunk = chunk_size(n);
  pool_.parallel_for((n + chunk - 1) / chunk, [&](size_t t) {
    const size_t end = std::min(n, (t + 1) * chunk);
    uint64_t last_wpage = UINT64_MAX, last_spage = UINT64_MAX;
    for (size_t i = t * chunk; i < end; ++i) {
      const uint64_t w = woff + (uint64_t)ids[i] * wb, s = soff + (uint64_t)ids[i] * sb;
      // Skip the syscall when the previous row of this task started on the same page.
      if (w / kPage != last_wpage) (void)::posix_fadvise(wfd, (off_t)w, (off_t)wb, POSIX_FADV_WILLNEED);
      if (scale_copy_.empty() && s / kPage != last_spage)
        (void)::posix_fadvise(sfd, (off_t)s, (off_t)sb, POSIX_FADV_WILLNEED);
      last_wpage = w / kPage;
      last_spage = s / kPage;
    }
  });
}

std::shared_ptr<Work> Table::submit(std::shared_ptr<Work> work, std::function<size_t()> fn) {
  {
    std::lock_guard<std::mutex> lock(driver_mutex_);
    if (driver_stop_) throw std::runtime_error("the Engram table is closed");
    driver_queue_.emplace_back(work, std::move(fn));
  }
  driver_cv_.notify_one();
  return work;
}

std::shared_ptr<Work> Table::gather_async(const int64_t* ids, size_t n, uint8_t* out_weight, uint8_t* out_scale,
                                          bool zero_invalid) {
  check_open();
  // Validate now, so a bad id raises at the call and not at wait().
  if (!zero_invalid) check_ids(ids, n);
  auto work = std::make_shared<Work>();
  return submit(work, [this, ids, n, out_weight, out_scale, zero_invalid] {
    return gather(ids, n, out_weight, out_scale, zero_invalid);
  });
}

std::shared_ptr<Work> Table::prefetch_async(std::vector<int64_t> ids) {
  check_open();
  check_ids(ids.data(), ids.size());
  auto work = std::make_shared<Work>();
  work->owned_ids = std::move(ids);
  Work* w = work.get();  // the queue entry holds `work`, so w outlives the call
  return submit(work, [this, w] {
    prefetch(w->owned_ids.data(), w->owned_ids.size());
    return w->owned_ids.size();
  });
}

void Table::driver_loop() {
  for (;;) {
    std::pair<std::shared_ptr<Work>, std::function<size_t()>> item;
    {
      std::unique_lock<std::mutex> lock(driver_mutex_);
      driver_cv_.wait(lock, [&] { return driver_stop_ || !driver_queue_.empty(); });
      if (driver_queue_.empty()) return;  // stop requested and everything queued has run
      item = std::move(driver_queue_.front());
      driver_queue_.pop_front();
    }
    size_t result = 0;
    std::exception_ptr error;
    try {
      result = item.second();
    } catch (...) {
      error = std::current_exception();
    }
    item.first->finish(result, error);
  }
}

// ----------------------------------------------------------------------------------- random reads

double random_read(const std::string& path, uint64_t lo, uint64_t hi, uint64_t n_reads, int n_threads,
                   uint64_t block, bool direct, uint64_t seed) {
  if (n_threads < 1) throw std::invalid_argument("n_threads must be >= 1");
  if (block == 0 || block % 512 != 0) throw std::invalid_argument("block must be a positive multiple of 512");
  lo = (lo + block - 1) / block * block;
  if (hi < lo + block) throw std::invalid_argument("the range holds no whole block");
  const uint64_t n_blocks = (hi - lo) / block;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  if (fd < 0) throw std::runtime_error("open('" + path + "') failed: " + std::strerror(errno));
  if (!direct) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex error_mutex;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      void* buf = nullptr;
      if (::posix_memalign(&buf, 4096, block) != 0) {
        failed = true;
        return;
      }
      uint64_t state = seed * 0x9E3779B97F4A7C15ull + (uint64_t)t * 0xBF58476D1CE4E5B9ull + 1;
      const uint64_t mine = n_reads / n_threads + ((uint64_t)t < n_reads % n_threads ? 1 : 0);
      for (uint64_t k = 0; k < mine && !failed.load(std::memory_order_relaxed); ++k) {
        // splitmix64
        state += 0x9E3779B97F4A7C15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const uint64_t off = lo + (z % n_blocks) * block;
        ssize_t got = ::pread(fd, buf, block, (off_t)off);
        if (got != (ssize_t)block) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!failed) error = got < 0 ? std::strerror(errno) : "short read";
          failed = true;
        }
      }
      std::free(buf);
    });
  }
  for (auto& th : threads) th.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  if (failed) throw std::runtime_error("random reads of '" + path + "' failed: " + error);
  return seconds;
}

}  // namespace engram_mmap
