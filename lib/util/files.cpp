#include "util/files.hpp"

#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "util/process.hpp"

namespace dtrain {

namespace {
std::runtime_error sys_error(const char* what, const std::string& path) {
  return std::runtime_error(fmt::format("cannot {} '{}': {}", what, path, std::strerror(errno)));
}
}  // namespace

void write_file_synced(const std::string& path, const std::string& data) {
  write_file_synced(path, std::vector<ByteSpan>{{data.data(), data.size()}});
}

bool write_all(int fd, const void* data, size_t size, int64_t at) {
  for (size_t done = 0; done < size;) {
    const char* from = static_cast<const char*>(data) + done;
    const ssize_t n = at < 0 ? ::write(fd, from, size - done)
                             : ::pwrite(fd, from, size - done, off_t(at) + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ENOSPC;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

void write_file_synced(const std::string& path, const std::vector<ByteSpan>& pieces) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw sys_error("create", path);
  for (const auto& [data, size] : pieces)
    if (!write_all(fd, data, size)) {
      ::close(fd);
      throw sys_error("write", path);
    }
  if (::fsync(fd) != 0) {
    ::close(fd);
    throw sys_error("fsync", path);
  }
  if (::close(fd) != 0) throw sys_error("close", path);
}

void write_file_atomic(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  try {
    write_file_synced(tmp, data);
  } catch (const std::exception&) {
    ::unlink(tmp.c_str());  // a partial file would only fill the disk
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    auto e = sys_error("rename", tmp);
    ::unlink(tmp.c_str());
    throw e;
  }
  auto slash = path.rfind('/');
  fsync_dir(slash == std::string::npos ? "." : path.substr(0, slash));
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw sys_error("open folder", dir);
  ::fsync(fd);  // some file systems refuse fsync on folders; the rename is then as durable as it gets
  ::close(fd);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw sys_error("read", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint32_t crc32_of_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw sys_error("read", path);
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(in.gcount()));
  }
  return static_cast<uint32_t>(crc);
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw sys_error("remove", path);
  }
  // Children first (FTW_DEPTH), without following symlinks (FTW_PHYS).
  static thread_local std::string failed;
  failed.clear();
  auto remove_one = [](const char* p, const struct stat*, int, FTW*) -> int {
    if (::remove(p) != 0 && errno != ENOENT) {
      failed = p;
      return 1;
    }
    return 0;
  };
  const int rc = ::nftw(path.c_str(), remove_one, 64, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) throw sys_error("remove", failed.empty() ? path : failed);
}

std::optional<DirLock> DirLock::try_lock(const std::string& dir, std::string& holder) {
  const std::string path = dir + "/.lock";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw sys_error("create", path);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[256] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) {
      errno = err;
      throw sys_error("lock", path);
    }
    holder = n > 0 ? std::string(buf, size_t(n)) : "another process";
    holder.erase(holder.find_last_not_of(" \n") + 1);
    return std::nullopt;
  }
  const std::string who = fmt::format("pid {} on host {}\n", ::getpid(), host_name());
  // Best effort: the lock itself is what counts; the text only names the holder.
  [[maybe_unused]] const bool named =
      ::ftruncate(fd, 0) == 0 && ::pwrite(fd, who.data(), who.size(), 0) == ssize_t(who.size());
  return DirLock(fd);
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace dtrain
