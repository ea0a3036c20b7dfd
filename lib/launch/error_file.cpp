#include "launch/error_file.hpp"

#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

namespace dtrain {

void report_failure_to_launcher(const Env& env, const std::string& message) {
  try {
    auto path = env("TORCHELASTIC_ERROR_FILE");
    if (!path || path->empty()) return;
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    nlohmann::json data{
        {"message",
         {{"message", message},
          {"extraInfo",
           {{"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
    std::ofstream(*path) << data.dump() << "\n";
  } catch (...) {
  }
}

}  // namespace dtrain
