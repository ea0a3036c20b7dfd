// Tokenized corpora: the shards people already have, memory-mapped, never read whole.
//   llm.c     a header of 256 little-endian int32 (magic 20240520, version 1, the token
//             count), then that many uint16 tokens (llm.c's dev/data scripts)
//   nanogpt   raw little-endian uint16 tokens (nanoGPT's prepare.py: train.bin, val.bin)
// Windows are cut within each shard (seq + 1 tokens every seq, as for text) and sampled,
// sharded and resumed like any other samples. Loading reads every shard once, in order,
// for what a shard cannot be trusted with: the token ids against the vocabulary (the
// first id out of range is named, with its file and position) and the fingerprint the
// ranks compare.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/dataset.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// A file mapped read-only for the life of the data set (the loader's threads read it).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError(fmt::format("data.path: cannot open '{}': {}", path, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw DataError(fmt::format("data.path: '{}' is not a regular file", path));
    }
    size_ = int64_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_t(size_), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw DataError(fmt::format("data.path: cannot map '{}': {}", path, std::strerror(errno)));
      }
      data_ = static_cast<const unsigned char*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_t(size_));
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::string& path() const { return path_; }
  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

// One shard: its file and where its tokens are in it.
struct TokenShard {
  std::shared_ptr<MappedFile> file;
  int64_t offset = 0;  // bytes before the first token
  int64_t count = 0;   // tokens
  // Tokens [from, from + n) into `out`, widened (little-endian, as x86 and ARM).
  void read(int64_t from, int64_t n, int64_t* out) const {
    const unsigned char* p = file->data() + offset + 2 * from;
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  }
};

TokenShard open_shard(const std::string& path, const std::string& format) {
  TokenShard s;
  s.file = std::make_shared<MappedFile>(path);
  const int64_t bytes = s.file->size();
  int32_t header[3] = {0, 0, 0};
  if (bytes >= 12) std::memcpy(header, s.file->data(), sizeof header);
  const bool llmc = format == "llmc" || (format == "auto" && header[0] == kLlmcMagic);
  if (llmc) {
    fail_if<DataError>(bytes < kLlmcHeaderBytes, "data.path: '{}' holds {} bytes, less than an "
                       "llm.c shard's header of {}", path, bytes, kLlmcHeaderBytes);
    fail_if<DataError>(header[0] != kLlmcMagic, "data.path: '{}' is not an llm.c shard: its "
                       "header starts with {}, not the magic number {} (data.token_format: "
                       "nanogpt reads raw uint16 tokens)", path, header[0], kLlmcMagic);
    fail_if<DataError>(header[1] != 1, "data.path: '{}' is an llm.c shard of version {}; dtrain "
                       "reads version 1 (uint16 tokens)", path, header[1]);
    const int64_t held = (bytes - kLlmcHeaderBytes) / 2;
    fail_if<DataError>(header[2] < 0 || (bytes - kLlmcHeaderBytes) != 2 * int64_t(header[2]),
                       "data.path: '{}' is truncated or damaged: its header says {} tokens, the "
                       "file holds {} bytes after the header ({} tokens)", path, header[2],
                       bytes - kLlmcHeaderBytes, held);
    s.offset = kLlmcHeaderBytes;
    s.count = header[2];
  } else {
    fail_if<DataError>(bytes % 2 != 0, "data.path: '{}' is truncated: {} bytes is not a whole "
                       "number of uint16 tokens", path, bytes);
    s.count = bytes / 2;
  }
  return s;
}

// The files `path` names: a file, every file of a folder (sorted; hidden ones skipped), or
// the matches of a glob pattern (sorted).
std::vector<std::string> shard_paths(const std::string& key, const std::string& path) {
  std::error_code ec;
  std::vector<std::string> out;
  if (fs::is_regular_file(path, ec)) return {path};
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.path().filename().string()[0] != '.' && e.is_regular_file(ec))
        out.push_back(e.path().string());
    std::sort(out.begin(), out.end());
    fail_if<DataError>(out.empty(), "{}: the folder '{}' holds no shard files", key, path);
    return out;
  }
  if (path.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(path.c_str(), 0, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    fail_if<DataError>(out.empty(), "{}: no file matches '{}'", key, path);
    return out;  // glob sorts
  }
  throw DataError(fmt::format("{}: '{}' is neither a file, a folder nor a pattern that matches",
                              key, path));
}

// Windows of token shards: window i is seq + 1 tokens of shard shard[i] from start[i].
class TokenShards : public Dataset {
 public:
  // `print`: the shards' token count, sum and weighted sum (scan()).
  TokenShards(std::vector<TokenShard> shards, std::vector<std::pair<int32_t, int64_t>> windows,
              int64_t seq, const std::vector<double>& print)
      : shards_(std::move(shards)), windows_(std::move(windows)), seq_(seq) {
    double keys = 0;
    for (const auto& [s, start] : windows_) keys += double(s) * 1e9 + double(start);
    // As the other data sets': the size, a sum, a weighted sum, the windows (4 values).
    fingerprint_ = {double(size()), print[1] + print[0], print[2], keys};
  }
  int64_t size() const override { return int64_t(windows_.size()); }
  Batch gather(const torch::Tensor& indices) const override {
    const auto idx = indices.contiguous().to(torch::kInt64);
    const int64_t n = idx.size(0);
    auto x = torch::empty({n, seq_}, torch::kInt64), y = torch::empty({n, seq_}, torch::kInt64);
    auto* px = x.data_ptr<int64_t>();
    auto* py = y.data_ptr<int64_t>();
    const auto* pi = idx.data_ptr<int64_t>();
    std::vector<int64_t> window(size_t(seq_ + 1));
    for (int64_t r = 0; r < n; ++r) {  // each token read once: x the first seq, y the last
      const auto& [s, start] = windows_[size_t(pi[r])];
      shards_[size_t(s)].read(start, seq_ + 1, window.data());
      std::copy(window.begin(), window.end() - 1, px + r * seq_);
      std::copy(window.begin() + 1, window.end(), py + r * seq_);
    }
    return {x, y};
  }
  std::vector<double> fingerprint() const override { return fingerprint_; }

 private:
  std::vector<TokenShard> shards_;
  std::vector<std::pair<int32_t, int64_t>> windows_;
  int64_t seq_;
  std::vector<double> fingerprint_;
};

// Reads every shard once: each id against `vocab` (the first one out of range is exit 3,
// naming the file and the token's position), and the fingerprint's sums.
std::vector<double> scan(const std::vector<TokenShard>& shards, int64_t vocab,
                         const std::string& key) {
  double tokens = 0, sum = 0, weighted = 0;
  for (const auto& s : shards) {
    const auto* p = s.file->data() + s.offset;
    for (int64_t i = 0; i < s.count; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      if (v >= vocab)
        throw DataError(fmt::format("{}: '{}' holds token id {} at position {} (token {} of the "
                                    "shard), outside the vocabulary of {} (data.vocab, else "
                                    "model.vocab)", key, s.file->path(), v,
                                    s.offset + 2 * i, i, vocab));
      sum += v;
      weighted += double(v) * double(i % 65521 + 1);
    }
    tokens += double(s.count);
  }
  return {tokens, sum, weighted};
}

std::vector<TokenShard> open_shards(const std::string& key, const std::string& path,
                                    const std::string& format) {
  std::vector<TokenShard> shards;
  for (const auto& p : shard_paths(key, path)) shards.push_back(open_shard(p, format));
  return shards;
}

}  // namespace

DataSplits load_tokens(const DataConfig& cfg) {
  const int64_t seq = cfg.seq_len;
  auto windows_of = [&](const std::vector<TokenShard>& shards) {
    std::vector<std::pair<int32_t, int64_t>> out;
    for (size_t s = 0; s < shards.size(); ++s)
      for (int64_t at = 0; at + seq + 1 <= shards[s].count; at += seq) out.emplace_back(int32_t(s), at);
    return out;
  };
  auto train_shards = open_shards("data.path", cfg.path, cfg.token_format);
  auto train_print = scan(train_shards, cfg.vocab, "data.path");
  auto all = windows_of(train_shards);
  std::vector<std::pair<int32_t, int64_t>> train, test;
  DataSplits s;
  if (cfg.eval_path.empty()) {
    // Every n-th window held out, spread over the corpus (as for text).
    const int64_t every = std::max<int64_t>(2, std::llround(1.0 / cfg.eval_fraction));
    for (size_t i = 0; i < all.size(); ++i)
      (int64_t(i) % every == every - 1 ? test : train).push_back(all[i]);
    fail_if<DataError>(test.empty(), "data.path: '{}' holds {} tokens, too few for windows of {} "
                       "with one in {} held out", cfg.path, int64_t(train_print[0]), seq + 1, every);
    s.train = std::make_shared<TokenShards>(train_shards, train, seq, train_print);
    s.test = std::make_shared<TokenShards>(train_shards, test, seq, train_print);
  } else {
    fail_if<DataError>(all.empty(), "data.path: '{}' holds {} tokens, too few for one window of {}",
                       cfg.path, int64_t(train_print[0]), seq + 1);
    auto eval_shards = open_shards("data.eval_path", cfg.eval_path, cfg.token_format);
    auto eval_print = scan(eval_shards, cfg.vocab, "data.eval_path");
    test = windows_of(eval_shards);
    fail_if<DataError>(test.empty(), "data.eval_path: '{}' holds {} tokens, too few for one "
                       "window of {}", cfg.eval_path, int64_t(eval_print[0]), seq + 1);
    s.train = std::make_shared<TokenShards>(train_shards, all, seq, train_print);
    s.test = std::make_shared<TokenShards>(eval_shards, test, seq, eval_print);
  }
  s.sample_shape = {seq};
  s.vocab = cfg.vocab;
  return s;
}

}  // namespace dtrain
