// metrics.jsonl (one JSON object per line, written whole as it comes) and the human progress
// output.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace dtrain {

class EventWriter;

class MetricsLog {
 public:
  // A fresh run truncates the file; a resumed run keeps the lines up to `resume_step` and
  // drops anything a crashed attempt wrote after it (and old summaries), so the log reads
  // as one run. A rollback's abandoned lines (past `resume_step`, their summaries too) go
  // to `set_aside` instead when it is named. With `tensorboard_dir`, the train and eval
  // lines also go to TensorBoard's event file there (tensorboard.hpp), the kept ones first.
  MetricsLog(const std::string& path, std::optional<int64_t> resume_step,
             const std::string& tensorboard_dir = "", const std::string& set_aside = "");
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  // Appends one whole line. A write that fails (a full disk) leaves no part of it behind
  // and throws RunDirError naming the file (exit 3); later writes then do nothing, so the
  // first failure is the one reported.
  void write(const nlohmann::json& line);

 private:
  void append(const std::string& text);
  std::string path_;
  std::unique_ptr<EventWriter> tensorboard_;
  int fd_ = -1;
  off_t size_ = 0;      // bytes of whole lines written
  bool failed_ = false;
};

// A number, or null where it is NaN or infinite (JSON has no such numbers).
inline nlohmann::json finite_or_null(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
}


// One live line on a terminal (redrawn at most 5 times a second), or plain lines at each
// logged step otherwise. logging.progress: auto | on | off.
class Progress {
 public:
  Progress(const std::string& mode, int64_t total_steps);
  void step(int64_t step, double loss, double lr, double samples_per_s, bool logged_step);
  void print(const std::string& line);  // a plain message, not erased by the live line
  void finish();

 private:
  bool live_ = false, drawn_ = false;
  int64_t total_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  int64_t start_step_ = -1;
};

}  // namespace dtrain
