// Durable file writes: what a checkpoint relies on to survive a crash or a power cut.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

// Writes `data` to `path` (truncating) and fsyncs it. Throws std::runtime_error with errno.
void write_file_synced(const std::string& path, const std::string& data);
// The same from pieces in memory, one after another, none of them copied (a checkpoint's
// tensors straight from where they are).
using ByteSpan = std::pair<const void*, size_t>;
void write_file_synced(const std::string& path, const std::vector<ByteSpan>& pieces);
// Writes all `size` bytes at `data` to `fd`, at offset `at` (pwrite) or, for at < 0, where
// the file position is, going on after a signal interrupts; false with errno set where it
// cannot (ENOSPC for a write of nothing, a full disk by another name).
bool write_all(int fd, const void* data, size_t size, int64_t at = -1);
// Writes to a temporary name beside `path`, fsyncs, then renames over `path`.
void write_file_atomic(const std::string& path, const std::string& data);
// fsyncs a directory, making renames and creations inside it durable.
void fsync_dir(const std::string& dir);
// The whole file; throws std::runtime_error naming the path.
std::string read_file(const std::string& path);
// zlib CRC-32 of a file's bytes.
uint32_t crc32_of_file(const std::string& path);

// Removes `path` and everything under it (symlinks themselves, never what they point to);
// nothing when it does not exist. Throws std::runtime_error naming what could not be
// removed. dtrain's own, not std::filesystem::remove_all: the CUDA LibTorch 2.x inside
// Python's torch exports a copy of that function that the dynamic linker binds dtrain's
// calls to, and that copy jumps to address 0 (SIGSEGV on an H200, LibTorch 2.11).
// tests/check_symbols.sh keeps the binaries free of it.
void remove_tree(const std::string& path);

// An advisory lock on a folder (flock on DIR/.lock) that the kernel releases when the
// process dies, however it dies: one job per run directory. The file holds the holder's
// pid and host so that a refused job can say who has it.
class DirLock {
 public:
  // Takes the lock, or returns std::nullopt and sets `holder` to what the file says.
  static std::optional<DirLock> try_lock(const std::string& dir, std::string& holder);
  DirLock(DirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  DirLock& operator=(DirLock&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~DirLock();

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace dtrain
