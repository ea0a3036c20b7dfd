// IDX files (MNIST, Fashion-MNIST): a 4-byte magic (0, 0, type, ndim), ndim big-endian
// uint32 sizes, then the raw data. zlib's gzread reads .gz and plain files alike.
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>
#include <memory>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/dataset.hpp"
#include "util/error.hpp"

namespace dtrain {

namespace {
struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

// Reads between 1 and `n` bytes to buf + got, adding them to `got`; says why not, against
// the `total` bytes of `what` that were expected.
void read_some(gzFile f, unsigned char* buf, size_t& got, size_t n, size_t total,
               const std::string& path, const char* what) {
  int r = gzread(f, buf + got, static_cast<unsigned>(std::min<size_t>(n, 1u << 30)));
  if (r < 0) {
    int errnum = 0;
    throw DataError(fmt::format("{}: corrupt file ({})", path, gzerror(f, &errnum)));
  }
  if (r == 0)
    throw DataError(fmt::format("{}: truncated {}: expected {} bytes, found {}", path, what, total,
                                got));
  got += static_cast<size_t>(r);
}

void read_header(gzFile f, unsigned char* dst, size_t n, const std::string& path) {
  size_t got = 0;
  while (got < n) read_some(f, dst, got, n - got, n, path, "header");
}
}  // namespace

torch::Tensor read_idx(const std::string& path, int64_t expected_dims) {
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  if (!f) throw DataError(fmt::format("cannot open '{}'", path));
  unsigned char magic[4];
  read_header(f.get(), magic, 4, path);
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08)
    throw DataError(fmt::format("{}: not an unsigned-byte IDX file (bad magic number)", path));
  if (magic[3] != expected_dims)
    throw DataError(fmt::format("{}: expected {} dimensions, the header says {}", path,
                                expected_dims, magic[3]));
  std::vector<int64_t> dims(expected_dims);
  int64_t count = 1;
  for (auto& d : dims) {
    unsigned char b[4];
    read_header(f.get(), b, 4, path);
    d = (int64_t(b[0]) << 24) | (int64_t(b[1]) << 16) | (int64_t(b[2]) << 8) | int64_t(b[3]);
    if (d <= 0 || d > (1 << 28))
      throw DataError(fmt::format("{}: implausible dimension {} in the header", path, d));
    if (count > (int64_t(1) << 34) / d)  // checked before multiplying: no overflow
      throw DataError(fmt::format("{}: the header claims more than 16 GiB of data", path));
    count *= d;
  }
  // The buffer grows with the bytes actually read: a header may promise gigabytes that a
  // short file never holds, and nothing that size is allocated before the bytes are there.
  std::vector<uint8_t> data(std::min<size_t>(size_t(count), size_t(64) << 20));
  size_t got = 0;
  while (got < size_t(count)) {
    if (got == data.size()) data.resize(std::min<size_t>(size_t(count), 2 * data.size()));
    read_some(f.get(), data.data(), got, data.size() - got, size_t(count), path, "data");
  }
  auto t = torch::empty(dims, torch::kUInt8);
  std::memcpy(t.data_ptr<uint8_t>(), data.data(), got);
  unsigned char extra;
  const int more = gzread(f.get(), &extra, 1);
  int errnum = Z_OK;
  const char* why = gzerror(f.get(), &errnum);
  if (more < 0) throw DataError(fmt::format("{}: corrupt file ({})", path, why));
  if (more > 0)
    throw DataError(fmt::format("{}: more data than the header's {} bytes", path, count));
  // zlib's end of input inside a gzip stream: the data is all there but the trailer
  // (its CRC-32) is not, so nothing vouches for it.
  if (errnum == Z_BUF_ERROR)
    throw DataError(fmt::format("{}: truncated gzip stream (it ends before its checksum)", path));
  return t;
}

namespace {

std::string where_to_get(const std::string& dataset) {
  return dataset == "fashion_mnist"
             ? " (Fashion-MNIST comes in Debian's package dataset-fashion-mnist: "
               "apt-get install dataset-fashion-mnist)"
             : " (put the MNIST IDX files there, .gz or plain)";
}

// Debian ships the .gz files; a plain copy next to them works as well.
std::string find_split_file(const std::string& dir, const std::string& stem,
                            const std::string& dataset) {
  namespace fs = std::filesystem;
  for (const auto& name : {stem + ".gz", stem})
    if (fs::exists(fs::path(dir) / name)) return (fs::path(dir) / name).string();
  throw DataError(fmt::format("data.path: cannot find '{}.gz' in '{}'{}", stem, dir,
                              where_to_get(dataset)));
}

std::shared_ptr<TensorDataset> load_idx_split(const std::string& dir, const std::string& prefix,
                                              const std::string& dataset, double mean, double std) {
  auto images_path = find_split_file(dir, prefix + "-images-idx3-ubyte", dataset);
  auto labels_path = find_split_file(dir, prefix + "-labels-idx1-ubyte", dataset);
  auto images = read_idx(images_path, 3);
  auto labels = read_idx(labels_path, 1);
  if (images.size(0) != labels.size(0))
    throw DataError(fmt::format("{}: {} labels for {} images in '{}'", labels_path,
                                labels.size(0), images.size(0), images_path));
  if (labels.max().item<int64_t>() > 9)
    throw DataError(fmt::format("{}: a label above 9", labels_path));
  auto x = images.to(torch::kFloat32).div_(255.0).sub_(mean).div_(std).unsqueeze(1).contiguous();
  return std::make_shared<TensorDataset>(x, labels.to(torch::kInt64));
}

// Random inputs labelled by a fixed random linear teacher, so a model can learn them.
DataSplits synthetic(const DataConfig& cfg, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Ints shape = cfg.input_shape;
  int64_t features = 1;
  for (auto s : shape) features *= s;
  auto teacher = at::randn({features, cfg.classes}, gen);
  auto make = [&](int64_t n) {
    auto x = at::randn({n, features}, gen);
    auto y = x.mm(teacher).argmax(1);
    Ints full{n};
    full.insert(full.end(), shape.begin(), shape.end());
    return std::make_shared<TensorDataset>(x.view(full).contiguous(), y);
  };
  // A braced list evaluates in order: the train split draws from the generator first.
  return {make(cfg.samples), make(cfg.test_samples), shape, cfg.classes};
}

}  // namespace

std::vector<double> TensorDataset::fingerprint() const {
  if (size() == 0) return {0, 0, 0, 0};
  // Each sample's sum, then those weighted by the sample's place; the labels likewise. A
  // chunk of samples at a time: summing in fp64 converts its input to fp64 first, which for
  // all of Fashion-MNIST at once held 376 MB besides the 188 MB of the data (the main
  // job's peak memory). Each chunk's sums go into one tensor made first, and a chunk is
  // small (1.6 MB in fp64): with 4096 samples, a small result allocated after each chunk's
  // 25 MB conversion kept the next one from reusing its space, and the heap grew by a
  // chunk each time (367 MB, resident to the end of the run: glibc keeps its heap).
  const auto flat = x.reshape({size(), -1});
  auto rows = torch::empty({size()}, torch::kFloat64);
  for (int64_t at = 0; at < size(); at += 256) {
    const int64_t n = std::min<int64_t>(256, size() - at);
    auto out = rows.narrow(0, at, n);
    at::sum_out(out, flat.narrow(0, at, n), 1, /*keepdim=*/false, torch::kFloat64);
  }
  const auto place = torch::arange(1, size() + 1, torch::kFloat64);
  return {double(size()), rows.sum().item<double>(), (rows * place).sum().item<double>(),
          (y.to(torch::kFloat64) * place).sum().item<double>()};
}

DataKind data_kind(const DataConfig& cfg) {
  const auto& d = cfg.dataset;
  if (d == "text" || d == "tokens" || d == "synthetic_tokens") return {true, {cfg.seq_len}, 0};
  if (d == "fashion_mnist" || d == "mnist") return {false, {1, 28, 28}, 10};
  return {false, cfg.input_shape, cfg.classes};
}

namespace {
class EvenlySpaced : public Dataset {
 public:
  EvenlySpaced(std::shared_ptr<const Dataset> split, int64_t n) : split_(std::move(split)), n_(n) {}
  int64_t size() const override { return n_; }
  Batch gather(const torch::Tensor& indices) const override {
    return split_->gather((indices.to(torch::kInt64) * split_->size()).div(n_, "floor"));
  }
  std::vector<double> fingerprint() const override {
    auto f = split_->fingerprint();
    f.push_back(double(n_));
    return f;
  }

 private:
  std::shared_ptr<const Dataset> split_;
  int64_t n_;
};
}  // namespace

std::shared_ptr<const Dataset> evenly_spaced(std::shared_ptr<const Dataset> split, int64_t n) {
  if (n <= 0 || split->size() <= n) return split;
  return std::make_shared<EvenlySpaced>(std::move(split), n);
}

DataSplits load_data(const DataConfig& cfg, uint64_t seed, const ReadTogether& together) {
  if (cfg.dataset == "synthetic") return synthetic(cfg, seed);
  if (cfg.dataset == "text") return load_text(cfg);
  if (cfg.dataset == "tokens") return load_tokens(cfg, together);
  if (cfg.dataset == "synthetic_tokens") return synthetic_tokens(cfg, seed);
  // Per-dataset pixel statistics (the usual published values).
  const bool fashion = cfg.dataset == "fashion_mnist";
  const double mean = fashion ? 0.2860 : 0.1307, std = fashion ? 0.3530 : 0.3081;
  if (!std::filesystem::is_directory(cfg.path))
    throw DataError(fmt::format("data.path: '{}' is not a folder{}", cfg.path,
                                where_to_get(cfg.dataset)));
  const auto train = load_idx_split(cfg.path, "train", cfg.dataset, mean, std);
  const Ints shape{1, train->x.size(2), train->x.size(3)};
  return {train, load_idx_split(cfg.path, "t10k", cfg.dataset, mean, std), shape, /*classes=*/10};
}

}  // namespace dtrain
