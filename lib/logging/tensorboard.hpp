// TensorBoard's event files (logging.tensorboard): every train and eval figure of
// metrics.jsonl as a scalar at its step, in TensorBoard's own format, so that
// `tensorboard --logdir RUN_DIR/tb` shows a run with nothing converted.
//
// The format: TFRecord framing (a little-endian uint64 length, its masked CRC-32C, the
// bytes, their masked CRC-32C) around protobuf-encoded `Event` messages: the first holds
// file_version "brain.Event:2", the others wall_time, step and a `Summary` of
// `Summary.Value`s (tag, simple_value). Three messages of a few fields each are encoded by
// hand here (protobuf's wire format: varints, fixed 32/64-bit, length-delimited) rather
// than by linking libprotobuf and generating code from TensorFlow's .proto files.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain {

// CRC-32C (Castagnoli), and TFRecord's mask of it.
uint32_t crc32c(const std::string& bytes);
uint32_t masked_crc32c(const std::string& bytes);

// One TFRecord: the framing around `data`.
std::string tfrecord(const std::string& data);

// An Event message: file_version, or a Summary of scalars at `step`.
std::string event_file_version(double wall_time);
std::string event_scalars(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& scalars);

// The scalars of a metrics.jsonl line: a train or eval line's numbers (not step, epoch or
// time) as "train/KEY" or "eval/KEY"; none for other kinds.
std::vector<std::pair<std::string, float>> scalars_of(const nlohmann::json& line);

// events.out.tfevents.TIME.HOST in `dir`, written as lines come. Opening it removes the
// folder's older event files: a resumed run's metrics.jsonl (kept up to the checkpoint's
// step) is replayed into the new file first, so TensorBoard never sees a step twice.
class EventWriter {
 public:
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;
  // Throws RunDirError naming the file when it cannot be written.
  void write(const nlohmann::json& line);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& record);
  std::string path_;
  int fd_ = -1;
};

}  // namespace dtrain
