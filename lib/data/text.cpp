// Token windows for language modelling: a text corpus read as bytes, or synthetic tokens.
// The sampler treats a window like an image: an index into the split, so global batches,
// sharding over data-parallel ranks and exact resume work as they do for images.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/dataset.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace fs = std::filesystem;

Batch TokenWindows::gather(const torch::Tensor& indices) const {
  // One index_select for the whole batch: rows of seq + 1 consecutive stream positions.
  auto offsets = torch::arange(seq + 1, torch::kInt64);
  auto rows = starts.index_select(0, indices).unsqueeze(1) + offsets;  // [n, seq + 1]
  auto windows = stream.index_select(0, rows.view(-1)).view({indices.size(0), seq + 1});
  return {windows.narrow(1, 0, seq).contiguous(), windows.narrow(1, 1, seq).contiguous()};
}

std::vector<double> TokenWindows::fingerprint() const {
  // The stream's tokens, and weighted by their place (mod a prime, in chunks, so that the
  // weights stay small and no stream-sized temporary is made); then the window starts.
  // Small chunks (0.5 MB in fp64): chunks of 8 MB grew the heap by one each (72 MB on
  // gpt_text, resident to the end of the run), as TensorDataset::fingerprint's did.
  double sum = 0, weighted = 0;
  const int64_t n = stream.size(0), chunk = int64_t(1) << 16;
  for (int64_t lo = 0; lo < n; lo += chunk) {
    const auto part = stream.narrow(0, lo, std::min(chunk, n - lo)).to(torch::kFloat64);
    const auto place = torch::arange(lo, lo + part.size(0), torch::kInt64).remainder(65521).add(1);
    sum += part.sum().item<double>();
    weighted += (part * place.to(torch::kFloat64)).sum().item<double>();
  }
  return {double(size()), sum, weighted, starts.to(torch::kFloat64).sum().item<double>()};
}

namespace {

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw DataError(fmt::format("data.path: cannot read '{}'", p.string()));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Window starts over [begin, end) of a stream: every seq tokens, each window seq + 1 long.
std::vector<int64_t> window_starts(int64_t begin, int64_t end, int64_t seq) {
  std::vector<int64_t> starts;
  for (int64_t s = begin; s + seq + 1 <= end; s += seq) starts.push_back(s);
  return starts;
}

// The bytes of a file, or of every text file in a folder (sorted by name; symbolic links,
// hidden files and files holding a NUL byte, i.e. binary ones, left out), as int64 tokens.
torch::Tensor read_text_bytes(const std::string& path) {
  std::error_code ec;
  std::string text;
  if (fs::is_regular_file(path, ec)) {
    text = read_all(path);
  } else if (fs::is_directory(path, ec)) {
    // Symbolic links (which may loop) and hidden files are skipped unread, binary files
    // (a NUL byte) once read; an empty result says how many of each.
    std::vector<fs::path> files;
    int64_t links = 0, hidden = 0, binary = 0;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      if (e.is_symlink(ec)) ++links;
      else if (e.path().filename().string()[0] == '.') ++hidden;
      else if (e.is_regular_file(ec)) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      auto bytes = read_all(f);
      if (bytes.find('\0') == std::string::npos) text += bytes;  // text, not binary
      else ++binary;
    }
    fail_if<DataError>(text.empty(), "data.path: the folder '{}' holds no text: {} file(s) read, "
                       "{} of them binary; {} symbolic link(s) and {} hidden file(s) skipped",
                       path, files.size(), binary, links, hidden);
  } else {
    const bool shipped = path == "/usr/share/games/fortunes";
    throw DataError(fmt::format("data.path: '{}' is neither a file nor a folder{}", path,
                                shipped ? " (the shipped corpus: apt-get install fortunes)" : ""));
  }
  auto t = torch::empty({int64_t(text.size())}, torch::kInt64);
  auto* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = static_cast<unsigned char>(text[i]);
  return t;
}

}  // namespace

DataSplits load_text(const DataConfig& cfg) {
  auto stream = read_text_bytes(cfg.path);
  const int64_t seq = cfg.seq_len;
  auto all = window_starts(0, stream.size(0), seq);
  const int64_t every = std::max<int64_t>(2, std::llround(1.0 / cfg.eval_fraction));
  std::vector<int64_t> train, test;
  for (size_t i = 0; i < all.size(); ++i)
    (int64_t(i) % every == every - 1 ? test : train).push_back(all[i]);
  fail_if<DataError>(test.empty(), "data.path: '{}' holds {} bytes, too few for windows of {} "
                     "with one in {} held out", cfg.path, stream.size(0), seq + 1, every);
  return {std::make_shared<TokenWindows>(stream, torch::tensor(train, torch::kInt64), seq),
          std::make_shared<TokenWindows>(stream, torch::tensor(test, torch::kInt64), seq), {seq},
          /*classes=*/0, /*vocab=*/256};
}

DataSplits synthetic_tokens(const DataConfig& cfg, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t seq = cfg.seq_len;
  auto make = [&](int64_t windows) {
    auto stream = at::randint(cfg.vocab, {windows * seq + 1}, gen, torch::kInt64);
    const auto starts = torch::tensor(window_starts(0, windows * seq + 1, seq), torch::kInt64);
    return std::make_shared<TokenWindows>(stream, starts, seq);
  };
  // A braced list evaluates in order: the train split draws from the generator first.
  return {make(cfg.samples), make(cfg.test_samples), {seq}, /*classes=*/0, cfg.vocab};
}

}  // namespace dtrain
