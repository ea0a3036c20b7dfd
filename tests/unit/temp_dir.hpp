// A fresh folder under the system temp dir for one test, removed with everything in it at the
// end of the scope, so tests never share or leak files. As a static it is a process's folder,
// removed as the process ends (the e2e and fuzz tests' scratch): only by the process that
// made it, since a forked command that ends with std::exit runs the same destructor.
// DTRAIN_KEEP_TEST_DIRS=1 keeps every one, to look at a failed test's files.
#pragma once
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "util/files.hpp"

namespace dtrain::test {

class TempDir {
 public:
  explicit TempDir(const std::string& tag = "dtrain-unit") : owner_(::getpid()) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    dtrain::remove_tree(path_.string());
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    if (::getpid() != owner_ || std::getenv("DTRAIN_KEEP_TEST_DIRS")) return;
    try {
      dtrain::remove_tree(path_.string());
    } catch (const std::exception&) {  // a destructor must not throw
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
  pid_t owner_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace dtrain::test
