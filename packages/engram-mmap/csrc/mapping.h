// A read-only shared memory map of one whole file, plus the page-cache controls the gather needs.
#pragma once

#include <cstdint>
#include <string>

namespace engram_mmap {

class Mapping {
 public:
  // Maps `size` bytes of the open file `fd` (the mapping owns a dup of fd). `random_access` sets
  // MADV_RANDOM and POSIX_FADV_RANDOM: without them every page fault reads around the faulting page
  // (read_ahead_kb, often 128 KiB to 8 MiB) for a 264-byte row.
  Mapping(int fd, uint64_t size, const std::string& path, bool random_access);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool closed() const { return base_ == nullptr; }
  void close();

  // Current size of the file on disk (fstat); the gather refuses to run if the file has shrunk
  // below a tensor's end, which would turn reads into SIGBUS.
  uint64_t current_file_size() const;

  // Drops this file's pages: unmaps them from this process (MADV_DONTNEED) and asks the kernel to
  // evict clean cached pages (POSIX_FADV_DONTNEED). Other processes' mappings may keep some.
  void evict() const;

  // Resident pages of [offset, offset + length) according to mincore, and the page count.
  void resident(uint64_t offset, uint64_t length, uint64_t* resident_pages, uint64_t* total_pages) const;

 private:
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
};

}  // namespace engram_mmap
