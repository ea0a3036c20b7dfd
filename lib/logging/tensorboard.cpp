#include "logging/tensorboard.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "util/error.hpp"
#include "util/files.hpp"
#include "util/process.hpp"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

// The reflected Castagnoli polynomial's table.
std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protobuf's wire format, the pieces the three messages need.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void key(std::string& out, int field, int wire_type) { varint(out, uint64_t(field << 3 | wire_type)); }
template <class T>
void fixed(std::string& out, T v) {  // little-endian, as protobuf's fixed32/64 and the hosts
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}

// Event's fields (tensorflow/core/util/event.proto): wall_time 1 (double), step 2
// (int64), file_version 3 (string), summary 5 (Summary). Summary (summary.proto): value 1
// (repeated Value); Value: tag 1 (string), simple_value 2 (float).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, uint64_t(step));
  }
  return e;
}

}  // namespace

uint32_t crc32c(const std::string& bytes) {
  static const auto table = crc_table();
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : bytes) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const std::string& bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

std::string tfrecord(const std::string& data) {
  std::string length;
  fixed(length, uint64_t(data.size()));
  std::string out = length;
  fixed(out, masked_crc32c(length));
  out += data;
  fixed(out, masked_crc32c(data));
  return out;
}

std::string event_file_version(double wall_time) {
  auto e = event_head(wall_time, 0);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalars(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    bytes_field(v, 1, tag);
    key(v, 2, 5);
    fixed(v, value);
    bytes_field(summary, 1, v);
  }
  auto e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

std::vector<std::pair<std::string, float>> scalars_of(const nlohmann::json& line) {
  const std::string kind = line.value("kind", "");
  if (kind != "train" && kind != "eval") return {};
  std::vector<std::pair<std::string, float>> out;
  for (const auto& [k, v] : line.items())
    if (v.is_number() && k != "step" && k != "epoch" && k != "time")
      out.emplace_back(kind + "/" + k, v.get<float>());
  return out;
}

EventWriter::EventWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw RunDirError(fmt::format("cannot create '{}': {}", dir, ec.message()));
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(e.path(), ec);
  std::string host = host_name();
  if (host.empty()) host = "localhost";
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = (fs::path(dir) / fmt::format("events.out.tfevents.{}.{}", int64_t(now), host)).string();
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw RunDirError(fmt::format("cannot write '{}': {}", path_, std::strerror(errno)));
  append(tfrecord(event_file_version(now)));
}

EventWriter::~EventWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void EventWriter::write(const nlohmann::json& line) {
  const auto scalars = scalars_of(line);
  if (scalars.empty()) return;
  append(tfrecord(event_scalars(line.value("time", 0.0), line.value("step", int64_t(0)), scalars)));
}

void EventWriter::append(const std::string& record) {
  if (!write_all(fd_, record.data(), record.size()))
    throw RunDirError(fmt::format("cannot write '{}': {}", path_, std::strerror(errno)));
}

}  // namespace dtrain
