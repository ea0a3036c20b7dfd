// Tokenized corpora: the shards people already have, memory-mapped, never read whole.
//   llm.c     a header of 256 little-endian int32 (magic 20240520, version 1, the token
//             count), then that many uint16 tokens (llm.c's dev/data scripts)
//   nanogpt   raw little-endian uint16 tokens (nanoGPT's prepare.py: train.bin, val.bin)
// Windows are cut within each shard (seq + 1 tokens every seq, as for text) and sampled,
// sharded and resumed like any other samples. A shard is scanned once for what it cannot
// be trusted with: the token ids against the vocabulary (the first id out of range is
// named, with its file and position) and the sums of the fingerprint the ranks compare.
// The ranks scan together, each its share of the tokens, and rank 0 records every shard's
// scan in the run directory (token-scan.json, keyed by the shard's path, size,
// modification time and first KiB), so a restart, a rejoin or a requeue reads no corpus
// before its first step: a start costs the shards' headers, whatever their size.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <zlib.h>

#include "data/dataset.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

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
    mtime_ns_ = int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec);
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
  int64_t mtime_ns() const { return mtime_ns_; }
  // CRC-32 of `n` bytes from `at` (clipped to the file).
  uint32_t crc(int64_t at, int64_t n) const {
    at = std::clamp<int64_t>(at, 0, size_);
    n = std::clamp<int64_t>(n, 0, size_ - at);
    return uint32_t(crc32(0, data_ ? data_ + at : nullptr, uInt(n)));
  }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0, mtime_ns_ = 0;
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

// Which windows of the shards, end to end, a split holds: all of them, or of every
// `every` the last (held out) or the others (trained on). Computed, never listed: a
// corpus of billions of tokens has hundreds of millions of windows.
struct WindowSplit {
  int64_t every = 0;  // 0: every window
  bool held_out = false;
  int64_t size(int64_t windows) const {
    if (every == 0) return windows;
    return held_out ? windows / every : windows - windows / every;
  }
  // The split's i-th window's place among all the windows.
  int64_t global(int64_t i) const {
    if (every == 0) return i;
    return held_out ? i * every + every - 1 : (i / (every - 1)) * every + i % (every - 1);
  }
};

// Windows of token shards: seq + 1 tokens every seq within each shard, a split of them.
class TokenShards : public Dataset {
 public:
  // `print`: the shards' token count, sums and weighted sums (scan_shards()), and their
  // first and last KiB's checksums, read by this rank. `vocab`: every id read is below it.
  TokenShards(std::vector<TokenShard> shards, WindowSplit split, int64_t seq, int64_t vocab,
              const std::vector<double>& print, std::string key)
      : shards_(std::move(shards)), split_(split), seq_(seq), vocab_(vocab), key_(std::move(key)) {
    double keys = 0;  // the shards' sizes by their place: what the windows are cut from
    for (size_t s = 0; s < shards_.size(); ++s) {
      first_.push_back(total_);
      total_ += windows(shards_[s]);
      keys += double(s + 1) * double(shards_[s].count);
    }
    // The size, a sum, a weighted sum, the windows' shards, the shards' own ends.
    fingerprint_ = {double(size()), print[1] + print[0], print[2], keys, print[3]};
  }
  int64_t windows(const TokenShard& sh) const { return sh.count > seq_ ? (sh.count - 1) / seq_ : 0; }
  int64_t size() const override { return split_.size(total_); }
  Batch gather(const torch::Tensor& indices) const override {
    const auto idx = indices.contiguous().to(torch::kInt64);
    const int64_t n = idx.size(0);
    auto x = torch::empty({n, seq_}, torch::kInt64), y = torch::empty({n, seq_}, torch::kInt64);
    auto* px = x.data_ptr<int64_t>();
    auto* py = y.data_ptr<int64_t>();
    const auto* pi = idx.data_ptr<int64_t>();
    std::vector<int64_t> window(size_t(seq_ + 1));
    for (int64_t r = 0; r < n; ++r) {  // each token read once: x the first seq, y the last
      const int64_t g = split_.global(pi[r]);
      const size_t s = size_t(std::upper_bound(first_.begin(), first_.end(), g) - first_.begin() - 1);
      const int64_t from = (g - first_[s]) * seq_;
      shards_[s].read(from, seq_ + 1, window.data());
      // The scan (or the record of one) vouched for the shard as it was: a shard rewritten
      // since with the same size, start and time is caught here, not by the embedding.
      for (int64_t i = 0; i <= seq_; ++i)
        if (window[size_t(i)] >= vocab_)
          throw DataError(fmt::format(
              "{}: '{}' holds token id {} at token {} of the shard, outside the vocabulary of {} "
              "(data.vocab, else model.vocab); it changed since it was scanned", key_,
              shards_[s].file->path(), window[size_t(i)], from + i, vocab_));
      std::copy(window.begin(), window.end() - 1, px + r * seq_);
      std::copy(window.begin() + 1, window.end(), py + r * seq_);
    }
    return {x, y};
  }
  std::vector<double> fingerprint() const override { return fingerprint_; }

 private:
  std::vector<TokenShard> shards_;
  WindowSplit split_;
  int64_t seq_, vocab_;
  std::string key_;             // the job key naming the shards: data.path or data.eval_path
  std::vector<int64_t> first_;  // each shard's first window among all
  int64_t total_ = 0;           // windows of every shard
  std::vector<double> fingerprint_;
};

// What a scan of a shard's tokens (or of a range of them) found: the fingerprint's sums,
// the largest id, and where the first id outside the vocabulary is.
struct ShardScan {
  double sum = 0, weighted = 0;
  int64_t max_id = -1;
  int64_t bad_at = -1;  // the token index of the first id >= vocab (-1: none)
  int64_t bad_id = 0;
};

ShardScan scan_range(const TokenShard& s, int64_t from, int64_t to, int64_t vocab) {
  ShardScan out;
  for (int64_t i = from; i < to; ++i) {
    int64_t v;
    s.read(i, 1, &v);
    if (v >= vocab && out.bad_at < 0) out.bad_at = i, out.bad_id = v;
    out.max_id = std::max<int64_t>(out.max_id, v);
    out.sum += v;
    out.weighted += double(v) * double(i % 65521 + 1);
  }
  return out;
}

// A shard as the record knows it: where it is, its size, when it was last written and its
// first KiB (an llm.c header, or the first tokens): a shard rewritten since does not match.
std::string record_key(const TokenShard& s) {
  std::error_code ec;
  const auto where = fs::absolute(s.file->path(), ec).lexically_normal().string();
  return fmt::format("{}|{}|{}|{:08x}", where, s.file->size(), s.file->mtime_ns(),
                     s.file->crc(0, 1024));
}

std::map<std::string, ShardScan> read_record(const std::string& path) {
  std::map<std::string, ShardScan> out;
  std::error_code ec;
  if (path.empty() || !fs::exists(path, ec)) return out;
  try {  // a record that cannot be read is no record: the shards are scanned again
    const auto j = nlohmann::json::parse(read_file(path));
    if (j.value("format", "") != "dtrain-token-scan" || j.value("version", 0) != 1) return out;
    for (const auto& e : j.at("shards"))
      out[e.at("key").get<std::string>()] = ShardScan{
          e.at("sum").get<double>(), e.at("weighted").get<double>(), e.at("max_id").get<int64_t>()};
  } catch (const std::exception&) {
    out.clear();
  }
  return out;
}

void write_record(const std::string& path, const std::vector<const TokenShard*>& shards,
                  const std::vector<ShardScan>& scans) {
  nlohmann::json j{{"format", "dtrain-token-scan"}, {"version", 1}, {"shards", nlohmann::json::array()}};
  for (size_t i = 0; i < shards.size(); ++i)
    j["shards"].push_back({{"key", record_key(*shards[i])}, {"sum", scans[i].sum},
                           {"weighted", scans[i].weighted}, {"max_id", scans[i].max_id}});
  try {
    fs::create_directories(fs::path(path).parent_path());
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception& e) {  // the next start scans again
    std::cerr << fmt::format("dtrain: warning: cannot record the token shards' scan in '{}': {}\n",
                             path, first_line(e.what()));
  }
}

// Every shard's scan, the same on every rank: from the record where every rank's holds the
// shard as it is now (rank 0's values), else read by the ranks together, each its share
// of those shards' tokens, and combined in rank order (the first bad id is the first
// rank's that saw one).
std::vector<ShardScan> scan_shards(const std::vector<const TokenShard*>& shards, int64_t vocab,
                                   const ReadTogether& together) {
  const size_t n = shards.size();
  auto gather = [&](const std::vector<double>& mine) {
    return together.all_gather ? together.all_gather(mine) : mine;
  };
  const auto recorded = read_record(together.record);
  std::vector<double> known(4 * n, 0);  // per shard: recorded, sum, weighted, max id
  for (size_t i = 0; i < n; ++i)
    if (auto it = recorded.find(record_key(*shards[i]));
        it != recorded.end() && it->second.max_id < vocab)
      known[4 * i] = 1, known[4 * i + 1] = it->second.sum, known[4 * i + 2] = it->second.weighted,
      known[4 * i + 3] = double(it->second.max_id);
  const auto all_known = gather(known);
  const size_t ranks = n > 0 ? all_known.size() / (4 * n) : 1;
  std::vector<ShardScan> scans(n);
  std::vector<size_t> todo;  // the shards some rank lacks
  for (size_t i = 0; i < n; ++i) {
    bool everywhere = true;
    for (size_t r = 0; r < ranks; ++r) everywhere = everywhere && all_known[r * 4 * n + 4 * i] > 0;
    if (!everywhere) {
      todo.push_back(i);
      continue;
    }
    scans[i].sum = all_known[4 * i + 1], scans[i].weighted = all_known[4 * i + 2];
    scans[i].max_id = int64_t(all_known[4 * i + 3]);
  }
  if (todo.empty()) return scans;
  // This rank's share: tokens [total r / N, total (r + 1) / N) of the shards to scan,
  // end to end.
  int64_t total = 0;
  for (size_t i : todo) total += shards[i]->count;
  const int64_t r = together.all_gather ? together.rank : 0, nr = together.all_gather ? together.ranks : 1;
  const int64_t first = total * r / nr, last = total * (r + 1) / nr;
  std::vector<double> mine;  // per shard to scan: sum, weighted, max id, bad at, bad id
  int64_t at = 0;
  for (size_t i : todo) {
    const int64_t from = std::clamp(first - at, int64_t(0), shards[i]->count);
    const int64_t to = std::clamp(last - at, int64_t(0), shards[i]->count);
    const auto sc = from < to ? scan_range(*shards[i], from, to, vocab) : ShardScan{};
    mine.insert(mine.end(), {sc.sum, sc.weighted, double(sc.max_id), double(sc.bad_at), double(sc.bad_id)});
    at += shards[i]->count;
  }
  const auto all = gather(mine);
  for (size_t k = 0; k < todo.size(); ++k) {
    ShardScan& sc = scans[todo[k]];
    for (size_t q = 0; q < size_t(nr); ++q) {
      const double* v = all.data() + q * mine.size() + 5 * k;
      sc.sum += v[0], sc.weighted += v[1];
      sc.max_id = std::max(sc.max_id, int64_t(v[2]));
      if (sc.bad_at < 0 && v[3] >= 0) sc.bad_at = int64_t(v[3]), sc.bad_id = int64_t(v[4]);
    }
  }
  if (r == 0 && !together.record.empty()) write_record(together.record, shards, scans);
  return scans;
}

std::vector<TokenShard> open_shards(const std::string& key, const std::string& path,
                                    const std::string& format) {
  std::vector<TokenShard> shards;
  for (const auto& p : shard_paths(key, path)) shards.push_back(open_shard(p, format));
  return shards;
}

}  // namespace

DataSplits load_tokens(const DataConfig& cfg, const ReadTogether& together) {
  const int64_t seq = cfg.seq_len;
  auto train_shards = open_shards("data.path", cfg.path, cfg.token_format);
  std::vector<TokenShard> eval_shards;
  if (!cfg.eval_path.empty()) eval_shards = open_shards("data.eval_path", cfg.eval_path, cfg.token_format);
  std::vector<const TokenShard*> every;
  for (const auto* list : {&train_shards, &eval_shards})
    for (const auto& sh : *list) every.push_back(&sh);
  const auto scans = scan_shards(every, cfg.vocab, together);
  // The first id outside the vocabulary, in the shards' order; the split's sums and the
  // shards' own identity (each rank's own reading of its files, which the scan shared out).
  auto print_of = [&](size_t from, size_t to) {
    std::vector<double> print{0, 0, 0, 0};
    for (size_t i = from; i < to; ++i) {
      const auto& sh = *every[i];
      const auto& sc = scans[i];
      if (sc.max_id >= cfg.vocab)
        throw DataError(fmt::format("{}: '{}' holds token id {} at position {} (token {} of the "
                                    "shard), outside the vocabulary of {} (data.vocab, else "
                                    "model.vocab)", i < train_shards.size() ? "data.path" : "data.eval_path",
                                    sh.file->path(), sc.bad_id, sh.offset + 2 * sc.bad_at,
                                    sc.bad_at, cfg.vocab));
      print[0] += double(sh.count), print[1] += sc.sum, print[2] += sc.weighted;
      print[3] += double(sh.file->crc(0, 1024)) + double(sh.file->crc(sh.file->size() - 1024, 1024));
    }
    return print;
  };
  const auto train_print = print_of(0, train_shards.size());
  DataSplits s;
  if (cfg.eval_path.empty()) {
    // Every n-th window held out, spread over the corpus (as for text).
    const int64_t every = std::max<int64_t>(2, std::llround(1.0 / cfg.eval_fraction));
    s.train = std::make_shared<TokenShards>(train_shards, WindowSplit{every, false}, seq, cfg.vocab,
                                            train_print, "data.path");
    s.test = std::make_shared<TokenShards>(train_shards, WindowSplit{every, true}, seq, cfg.vocab,
                                           train_print, "data.path");
    fail_if<DataError>(s.test->size() == 0, "data.path: '{}' holds {} tokens, too few for windows "
                       "of {} with one in {} held out", cfg.path, int64_t(train_print[0]), seq + 1,
                       every);
  } else {
    auto whole = [&](const std::vector<TokenShard>& shards, const std::vector<double>& print,
                     const char* key, const std::string& path) {
      auto split = std::make_shared<TokenShards>(shards, WindowSplit{}, seq, cfg.vocab, print, key);
      fail_if<DataError>(split->size() == 0, "{}: '{}' holds {} tokens, too few for one window "
                         "of {}", key, path, int64_t(print[0]), seq + 1);
      return split;
    };
    s.train = whole(train_shards, train_print, "data.path", cfg.path);
    s.test = whole(eval_shards, print_of(train_shards.size(), every.size()), "data.eval_path",
                   cfg.eval_path);
  }
  s.sample_shape = {seq};
  s.vocab = cfg.vocab;
  return s;
}

}  // namespace dtrain
