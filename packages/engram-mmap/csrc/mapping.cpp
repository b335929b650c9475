#include "mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace engram_mmap {

namespace {

constexpr uint64_t kPage = 4096;

std::runtime_error os_error(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " failed for '" + path + "': " + std::strerror(errno));
}

}  // namespace

Mapping::Mapping(int fd, uint64_t size, const std::string& path, bool random_access) : size_(size), path_(path) {
  if (size == 0) throw std::invalid_argument("cannot map the empty file '" + path + "'");
  struct stat st;
  if (::fstat(fd, &st) != 0) throw os_error("fstat", path);
  if ((uint64_t)st.st_size < size)
    throw std::invalid_argument("'" + path + "' holds " + std::to_string(st.st_size) + " bytes, fewer than the " +
                                std::to_string(size) + " to map");
  fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) throw os_error("dup", path);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int saved = errno;
    ::close(fd_);
    fd_ = -1;
    errno = saved;
    throw os_error("mmap", path);
  }
  base_ = static_cast<uint8_t*>(p);
  if (random_access) {
    // Advisory only: failures change performance, never results.
    (void)::madvise(base_, size_, MADV_RANDOM);
    (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
  }
}

Mapping::~Mapping() { close(); }

void Mapping::close() {
  if (base_ != nullptr) {
    ::munmap(base_, size_);
    base_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

uint64_t Mapping::current_file_size() const {
  if (closed()) throw std::runtime_error("the mapping of '" + path_ + "' is closed");
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw os_error("fstat", path_);
  return (uint64_t)st.st_size;
}

void Mapping::evict() const {
  if (closed()) throw std::runtime_error("the mapping of '" + path_ + "' is closed");
  if (::madvise(base_, size_, MADV_DONTNEED) != 0) throw os_error("madvise(MADV_DONTNEED)", path_);
  if (::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED) != 0) throw os_error("posix_fadvise(DONTNEED)", path_);
}

void Mapping::resident(uint64_t offset, uint64_t length, uint64_t* resident_pages, uint64_t* total_pages) const {
  if (closed()) throw std::runtime_error("the mapping of '" + path_ + "' is closed");
  if (offset > size_ || length > size_ - offset)
    throw std::out_of_range("range [" + std::to_string(offset) + ", +" + std::to_string(length) + ") is outside the " +
                            std::to_string(size_) + "-byte mapping of '" + path_ + "'");
  *resident_pages = 0;
  *total_pages = 0;
  if (length == 0) return;
  uint64_t first = offset / kPage * kPage;
  uint64_t end = offset + length;
  uint64_t pages = (end - first + kPage - 1) / kPage;
  // mincore in slices so the vector stays small for a 100 GiB mapping.
  constexpr uint64_t kSlice = 1 << 20;
  std::vector<unsigned char> vec(kSlice);
  uint64_t count = 0;
  for (uint64_t done = 0; done < pages; done += kSlice) {
    uint64_t n = pages - done < kSlice ? pages - done : kSlice;
    uint64_t bytes = n * kPage;
    uint64_t start = first + done * kPage;
    if (start + bytes > size_) bytes = size_ - start;
    if (::mincore(base_ + start, bytes, vec.data()) != 0) throw os_error("mincore", path_);
    for (uint64_t i = 0; i < n; ++i) count += vec[i] & 1;
  }
  *resident_pages = count;
  *total_pages = pages;
}

}  // namespace engram_mmap
