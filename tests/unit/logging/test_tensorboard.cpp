// TensorBoard's encoding against published values: CRC-32C's check value, TFRecord's
// masked CRC and framing, and an Event's bytes spelled out field by field from the protobuf
// wire format (the e2e test `tensorboard` decodes whole files with Python's protobuf).
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "logging/tensorboard.hpp"

namespace unit_logging_tensorboard {

using namespace dtrain;

TEST_CASE("tensorboard: CRC-32C and TFRecord's framing") {
  CHECK(crc32c("123456789") == 0xE3069283u);  // the Castagnoli CRC's published check value
  CHECK(crc32c("") == 0u);
  const uint32_t c = crc32c("abc");
  CHECK(masked_crc32c("abc") == uint32_t(((c >> 15) | (c << 17)) + 0xA282EAD8u));
  const std::string r = tfrecord("xyz");
  REQUIRE(r.size() == 8 + 4 + 3 + 4);
  uint64_t length = 0;
  std::memcpy(&length, r.data(), 8);
  CHECK(length == 3);
  uint32_t head = 0, tail = 0;
  std::memcpy(&head, r.data() + 8, 4);
  std::memcpy(&tail, r.data() + 15, 4);
  CHECK(head == masked_crc32c(r.substr(0, 8)));
  CHECK(r.substr(12, 3) == "xyz");
  CHECK(tail == masked_crc32c("xyz"));
}

TEST_CASE("tensorboard: an Event's bytes, field by field") {
  // wall_time 1.5 (field 1, 64-bit: key 0x09), step 300 (field 2, varint: 0x10, 0xAC 0x02),
  // summary (field 5, length-delimited: 0x2A) holding one value (field 1: 0x0A) of tag "a"
  // (0x0A 0x01 'a') and simple_value 2.0f (field 2, 32-bit: 0x15, 00 00 00 40).
  const std::string want = std::string("\x09\x00\x00\x00\x00\x00\x00\xF8\x3F", 9) +
                           std::string("\x10\xAC\x02", 3) + std::string("\x2A\x0A\x0A\x08", 4) +
                           std::string("\x0A\x01" "a" "\x15\x00\x00\x00\x40", 8);
  CHECK(event_scalars(1.5, 300, {{"a", 2.0f}}) == want);
  const std::string version = event_file_version(0.0);
  CHECK(version.substr(9) == std::string("\x1A\x0D") + "brain.Event:2");
}

TEST_CASE("tensorboard: a metrics line's scalars") {
  const auto train = scalars_of({{"kind", "train"}, {"step", 4}, {"epoch", 0}, {"loss", 0.5},
                                 {"time", 1.0}, {"bubble", {0.1, 0.2}}});
  REQUIRE(train.size() == 1);
  CHECK(train[0].first == "train/loss");
  CHECK(train[0].second == 0.5f);
  CHECK(scalars_of({{"kind", "summary"}, {"steps", 4}}).empty());
}

}  // namespace unit_logging_tensorboard
