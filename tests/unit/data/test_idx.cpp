// IDX files written at test time (plain and gzip): the right shape and bytes, and every kind of
// damage reported as a DataError that names the file.
#include <doctest/doctest.h>
#include <zlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "data/dataset.hpp"
#include "temp_dir.hpp"
#include "util/error.hpp"

namespace unit_data_idx {

using namespace dtrain;

namespace {
const TensorDataset& train_of(const DataSplits& s) { return dynamic_cast<const TensorDataset&>(*s.train); }
const TensorDataset& test_of(const DataSplits& s) { return dynamic_cast<const TensorDataset&>(*s.test); }
}  // namespace
using dtrain::test::TempDir;

namespace {

// The IDX layout, spelled out here rather than taken from the reader: magic 0 0 type ndim,
// big-endian uint32 sizes, then the data.
std::string idx_bytes(const std::vector<uint32_t>& dims, const std::string& data,
                      unsigned char type = 0x08) {
  std::string out{'\0', '\0', static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((d >> shift) & 0xff));
  return out + data;
}

std::string pattern(size_t n, unsigned mul = 37, unsigned add = 11) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * mul + add) & 0xff);
  return s;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

// Writes `bytes` as `name` (plain) or `name.gz` and returns the path.
std::string write_idx(const TempDir& dir, const std::string& name, const std::string& bytes,
                      bool gz) {
  std::string path = gz ? dir / (name + ".gz") : dir / name;
  if (gz) write_gz(path, bytes); else test::write_bytes(path, bytes);
  return path;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// read_idx must throw DataError (exit 3) whose message names the file and says `why`.
void check_bad_idx(const std::string& path, int64_t dims, const std::string& why) {
  CAPTURE(path);
  try {
    read_idx(path, dims);
    FAIL("no DataError for " << path);
  } catch (const DataError& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(e.code == kExitBadData);
    CHECK(contains(msg, path));
    CHECK(contains(msg, why));
  }
}

}  // namespace

TEST_CASE("idx: a valid images file and labels file, plain and gzip") {
  TempDir dir;
  for (bool gz : {false, true}) {
    CAPTURE(gz);
    const std::string pixels = pattern(4 * 3 * 2);  // includes bytes above 127
    auto images = read_idx(write_idx(dir, "images", idx_bytes({4, 3, 2}, pixels), gz), 3);
    CHECK((images.scalar_type() == torch::kUInt8));
    CHECK(images.sizes() == torch::IntArrayRef{4, 3, 2});
    REQUIRE(images.is_contiguous());
    CHECK(std::string(reinterpret_cast<const char*>(images.data_ptr<uint8_t>()), pixels.size()) ==
          pixels);
    // Row-major: element [i][j][k] is byte i*6 + j*2 + k.
    CHECK(images[2][1][0].item<int>() == static_cast<unsigned char>(pixels[2 * 6 + 1 * 2 + 0]));

    const std::string labels = std::string{0, 9, 3, 3, 7};
    auto y = read_idx(write_idx(dir, "labels", idx_bytes({5}, labels), gz), 1);
    CHECK(y.sizes() == torch::IntArrayRef{5});
    CHECK(torch::equal(y, torch::tensor({0, 9, 3, 3, 7}, torch::kUInt8)));
  }
}

TEST_CASE("idx: damaged files throw DataError naming the file") {
  TempDir dir;
  const std::string good_data = pattern(24);
  for (bool gz : {false, true}) {
    CAPTURE(gz);
    const std::string sfx = gz ? "-gz" : "-plain";
    // not unsigned bytes (0x0D = float)
    check_bad_idx(write_idx(dir, "float" + sfx, idx_bytes({4, 3, 2}, pattern(96), 0x0D), gz), 3,
                  "magic");
    std::string lead = idx_bytes({4, 3, 2}, good_data);
    lead[0] = 0x1f;
    check_bad_idx(write_idx(dir, "lead" + sfx, lead, gz), 3, "magic");
    check_bad_idx(write_idx(dir, "ndim" + sfx, idx_bytes({4, 3, 2}, good_data), gz), 1,
                  "dimensions");
    check_bad_idx(write_idx(dir, "labels-as-images" + sfx, idx_bytes({24}, good_data), gz), 3,
                  "dimensions");
    check_bad_idx(write_idx(dir, "short-header" + sfx, idx_bytes({4, 3, 2}, "").substr(0, 9), gz),
                  3, "truncated");
    check_bad_idx(write_idx(dir, "empty" + sfx, "", gz), 3, "truncated");
    check_bad_idx(write_idx(dir, "short" + sfx, idx_bytes({4, 3, 2}, good_data.substr(0, 20)), gz),
                  3, "truncated");
    check_bad_idx(write_idx(dir, "long" + sfx, idx_bytes({4, 3, 2}, good_data + "x"), gz), 3,
                  "more data");
    check_bad_idx(write_idx(dir, "zero" + sfx, idx_bytes({4, 0, 2}, ""), gz), 3, "dimension");
  }
}

TEST_CASE("idx: a corrupt gzip stream throws DataError naming the file") {
  TempDir dir;
  const std::string content = idx_bytes({8, 16, 16}, pattern(8 * 16 * 16, 13, 5));

  SUBCASE("valid gzip header, then garbage") {
    const std::string path = dir / "garbage.gz";
    write_gz(path, content);
    std::string b = test::read_bytes(path);
    REQUIRE(b.size() > 30);
    REQUIRE(static_cast<unsigned char>(b[0]) == 0x1f);
    REQUIRE(static_cast<unsigned char>(b[1]) == 0x8b);
    // Keep the 10-byte gzip header; the deflate stream after it becomes junk (0xff bytes
    // start with a reserved block type, so inflate cannot read past them).
    for (size_t i = 10; i < b.size(); ++i) b[i] = static_cast<char>(0xff);
    test::write_bytes(path, b);
    check_bad_idx(path, 3, "corrupt");
  }
  SUBCASE("a gzip stream whose checksum does not match") {
    const std::string path = dir / "crc.gz";
    write_gz(path, content);
    std::string b = test::read_bytes(path);
    // The gzip trailer is CRC-32 then length, 4 bytes each: damage the CRC only.
    b[b.size() - 8] = static_cast<char>(b[b.size() - 8] ^ 0x5a);
    test::write_bytes(path, b);
    check_bad_idx(path, 3, "corrupt");
  }
  SUBCASE("a gzip stream cut short inside its 8-byte trailer") {
    // Every data byte is there, but the checksum that would vouch for them is not: a
    // truncated download, which must not pass as a good file.
    const std::string path = dir / "cut.gz";
    write_gz(path, content);
    const std::string b = test::read_bytes(path);
    for (size_t cut : {1, 4, 8}) {
      CAPTURE(cut);
      test::write_bytes(path, b.substr(0, b.size() - cut));
      check_bad_idx(path, 3, "truncated");
    }
  }
}

TEST_CASE("idx: read_idx on a missing file names it") {
  TempDir dir;
  check_bad_idx(dir / "nothing-here", 3, "nothing-here");
}

TEST_CASE("idx: load_data reads an MNIST-layout folder and normalises it") {
  TempDir dir;
  // 6 training images 2x3, 4 test images, labels in 0..9; the train set has a plain labels
  // file next to gzipped images (both forms are accepted).
  const std::string train_px = pattern(6 * 2 * 3, 53, 1), test_px = pattern(4 * 2 * 3, 7, 200);
  write_gz(dir / "train-images-idx3-ubyte.gz", idx_bytes({6, 2, 3}, train_px));
  test::write_bytes(dir / "train-labels-idx1-ubyte", idx_bytes({6}, std::string{1, 2, 3, 4, 5, 9}));
  write_gz(dir / "t10k-images-idx3-ubyte.gz", idx_bytes({4, 2, 3}, test_px));
  write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx_bytes({4}, std::string{0, 0, 8, 9}));

  DataConfig cfg;
  cfg.dataset = "mnist";
  cfg.path = dir.path().string();
  DataSplits splits = load_data(cfg, /*seed=*/1);
  CHECK(splits.train->size() == 6);
  CHECK(splits.test->size() == 4);
  const auto& s = splits;
  CHECK(s.sample_shape == Ints{1, 2, 3});
  CHECK(s.classes == 10);
  CHECK(train_of(s).x.sizes() == torch::IntArrayRef{6, 1, 2, 3});
  CHECK((train_of(s).x.scalar_type() == torch::kFloat32));
  CHECK((train_of(s).y.scalar_type() == torch::kInt64));
  CHECK(torch::equal(test_of(s).y, torch::tensor({0, 0, 8, 9}, torch::kInt64)));
  // MNIST's published statistics: mean 0.1307, std 0.3081 of pixel/255.
  for (int i : {0, 7, 35}) {
    const double px = static_cast<unsigned char>(train_px[i]);
    const double want = (px / 255.0 - 0.1307) / 0.3081;
    CHECK(train_of(s).x.flatten()[i].item<double>() == doctest::Approx(want).epsilon(1e-5));
  }

  SUBCASE("labels and images disagree in count") {
    write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx_bytes({3}, std::string{0, 0, 8}));
    CHECK_THROWS_AS(load_data(cfg, 1), DataError);
  }
  SUBCASE("a label above 9") {
    write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx_bytes({4}, std::string{0, 10, 8, 9}));
    CHECK_THROWS_AS(load_data(cfg, 1), DataError);
  }
  SUBCASE("a missing split file") {
    std::filesystem::remove(dir / "t10k-images-idx3-ubyte.gz");
    try {
      load_data(cfg, 1);
      FAIL("no DataError");
    } catch (const DataError& e) {
      CHECK(contains(e.what(), "t10k-images-idx3-ubyte"));
    }
  }
}

TEST_CASE("idx: fashion_mnist in a missing folder points at the Debian package") {
  DataConfig cfg;
  cfg.dataset = "fashion_mnist";
  cfg.path = "/nonexistent/dtrain-test/fashion-mnist";
  try {
    load_data(cfg, 1);
    FAIL("no DataError");
  } catch (const DataError& e) {
    CHECK(e.code == kExitBadData);
    CHECK(contains(e.what(), "/nonexistent/dtrain-test/fashion-mnist"));
    CHECK(contains(e.what(), "dataset-fashion-mnist"));
  }
}

TEST_CASE("idx: the installed Fashion-MNIST loads and normalises to mean 0, std 1") {
  const std::string path = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::is_directory(path)) {
    MESSAGE("skipped: " << path << " is not installed");
    return;
  }
  DataConfig cfg;
  cfg.dataset = "fashion_mnist";
  cfg.path = path;
  DataSplits splits = load_data(cfg, 1);
  CHECK(splits.train->size() == 60000);
  CHECK(splits.test->size() == 10000);
  const auto& s = splits;
  CHECK(s.sample_shape == Ints{1, 28, 28});
  CHECK(train_of(s).x.sizes() == torch::IntArrayRef{60000, 1, 28, 28});
  CHECK(test_of(s).x.sizes() == torch::IntArrayRef{10000, 1, 28, 28});
  for (const auto* split : {&train_of(s), &test_of(s)}) {
    CHECK(split->y.min().item<int64_t>() == 0);
    CHECK(split->y.max().item<int64_t>() == 9);
  }
  // Fashion-MNIST is balanced: 6000 of each class in training.
  CHECK(torch::equal(torch::bincount(train_of(s).y), torch::full({10}, 6000, torch::kInt64)));
  const auto x = train_of(s).x.to(torch::kFloat64);
  CHECK(std::abs(x.mean().item<double>()) < 0.01);
  CHECK(std::abs(x.std().item<double>() - 1.0) < 0.02);
}

TEST_CASE("evenly_spaced: train.eval_samples' n samples spread over the split, or the split itself") {
  auto split = std::make_shared<TensorDataset>(torch::arange(10, torch::kFloat32).view({10, 1}),
                                               torch::arange(10, torch::kInt64));
  CHECK(evenly_spaced(split, 0).get() == split.get());   // 0: all of it
  CHECK(evenly_spaced(split, 10).get() == split.get());  // no more than it holds
  const auto four = evenly_spaced(split, 4);
  REQUIRE(four->size() == 4);
  // Sample i is the split's i * 10 / 4: 0, 2, 5, 7.
  const auto b = four->gather(torch::arange(4, torch::kInt64));
  CHECK(torch::equal(b.y, torch::tensor({0, 2, 5, 7}, torch::kInt64)));
  CHECK(four->fingerprint().size() == split->fingerprint().size() + 1);
}

}  // namespace unit_data_idx
