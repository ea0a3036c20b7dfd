// Runs the dtrain binary as a user would and reads what it wrote.
#pragma once
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <sys/wait.h>

namespace e2e {

struct Result {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("dtrain-e2e-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Runs `dtrain ARGS` under `timeout` so that no test can hang; `prefix` may add e.g.
// "timeout --preserve-status -s TERM 2".
inline Result dtrain(const std::string& args, const std::string& prefix = "") {
  static int n = 0;
  auto base = std::filesystem::temp_directory_path() /
              ("dtrain-e2e-io-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
  std::string cmd = (prefix.empty() ? std::string("timeout 500") : prefix) + " " + DTRAIN_BIN +
                    " " + args + " > " + base.string() + ".out 2> " + base.string() + ".err";
  int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(base.string() + ".out");
  r.err = slurp(base.string() + ".err");
  std::filesystem::remove(base.string() + ".out");
  std::filesystem::remove(base.string() + ".err");
  return r;
}

inline std::vector<nlohmann::json> metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

inline std::vector<nlohmann::json> of_kind(const std::vector<nlohmann::json>& lines,
                                           const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& l : lines)
    if (l["kind"] == kind) out.push_back(l);
  return out;
}

inline const char* kFashion = "/usr/share/datasets/fashion-mnist";
inline std::string config(const std::string& name) { return std::string(DTRAIN_CONFIGS) + "/" + name; }

}  // namespace e2e
