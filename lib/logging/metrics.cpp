#include "logging/metrics.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "logging/tensorboard.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

namespace dtrain {

MetricsLog::MetricsLog(const std::string& path, std::optional<int64_t> resume_step,
                       const std::string& tensorboard_dir, const std::string& set_aside)
    : path_(path) {
  std::string kept, aside;
  std::vector<nlohmann::json> kept_lines;
  if (resume_step) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      try {
        auto j = nlohmann::json::parse(line);
        const bool summary = j.value("kind", "") == "summary";
        if (!summary && j.value("step", int64_t(0)) <= *resume_step) {
          kept += line + "\n";
          kept_lines.push_back(std::move(j));
        } else if (j.value(summary ? "steps" : "step", int64_t(0)) > *resume_step) {
          aside += line + "\n";
        }
      } catch (const nlohmann::json::exception&) {  // a line cut short by a crash
      }
    }
  }
  if (!set_aside.empty() && !aside.empty()) {
    try {
      write_file_atomic(set_aside, aside);
    } catch (const std::exception& e) {
      throw RunDirError(fmt::format("cannot write '{}': {}", set_aside, first_line(e.what())));
    }
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw RunDirError(fmt::format("cannot write '{}': {}", path, std::strerror(errno)));
  append(kept);
  if (!tensorboard_dir.empty()) {
    tensorboard_ = std::make_unique<EventWriter>(tensorboard_dir);
    for (const auto& j : kept_lines) tensorboard_->write(j);
  }
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& line) {
  if (failed_) return;
  append(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  if (!tensorboard_) return;
  try {
    tensorboard_->write(line);
  } catch (const RunDirError&) {
    failed_ = true;
    throw;
  }
}

void MetricsLog::append(const std::string& text) {
  if (!write_all(fd_, text.data(), text.size(), size_)) {
    const int err = errno;
    failed_ = true;
    if (::ftruncate(fd_, size_) != 0) {  // nothing more to do: the line stays cut
    }
    throw RunDirError(fmt::format("cannot write '{}': {}", path_, std::strerror(err)));
  }
  size_ += off_t(text.size());
}

Progress::Progress(const std::string& mode, int64_t total_steps) : total_(total_steps) {
  live_ = mode == "on" || (mode == "auto" && ::isatty(STDERR_FILENO));
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

void Progress::step(int64_t step, double loss, double lr, double samples_per_s, bool logged_step) {
  auto now = std::chrono::steady_clock::now();
  if (start_step_ < 0) start_step_ = step - 1, start_ = now;
  if (!live_) {
    if (logged_step)
      std::fprintf(stderr, "step %lld/%lld  loss %.4f  lr %.3g  %.0f samples/s\n",
                   static_cast<long long>(step), static_cast<long long>(total_), loss, lr,
                   samples_per_s);
    return;
  }
  if (now - last_draw_ < std::chrono::milliseconds(200) && step != total_) return;
  last_draw_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = elapsed / double(step - start_step_) * double(total_ - step);
  std::fprintf(stderr, "\r\033[Kstep %lld/%lld  loss %.4f  lr %.3g  %.0f samples/s  ETA %d:%02d",
               static_cast<long long>(step), static_cast<long long>(total_), loss, lr,
               samples_per_s, int(eta) / 60, int(eta) % 60);
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::print(const std::string& line) {
  if (drawn_) std::fputs("\r\033[K", stderr);
  std::fprintf(stderr, "%s\n", line.c_str());
  drawn_ = false;
}

void Progress::finish() {
  if (drawn_) std::fputs("\n", stderr);
  drawn_ = false;
}

}  // namespace dtrain
