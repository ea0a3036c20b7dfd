// The training modes by name (parallel.mode): one line each.
#include <algorithm>

#include <fmt/format.h>

#include "run/mode.hpp"
#include "util/error.hpp"

namespace dtrain {

ModeSpec sync_spec();
ModeSpec local_sgd_spec();
ModeSpec async_ps_spec();

namespace {

// In the order parallel.mode lists them.
const std::vector<std::pair<std::string, ModeSpec>>& registry() {
  static const std::vector<std::pair<std::string, ModeSpec>> specs{
      {"sync", sync_spec()},
      {"local_sgd", local_sgd_spec()},
      {"async_ps", async_ps_spec()},
  };
  return specs;
}
const ListedBy kListed{"parallel.mode", mode_names};

}  // namespace

const ModeSpec& mode_spec(const std::string& name) {
  auto it = std::find_if(registry().begin(), registry().end(),
                         [&](const auto& entry) { return entry.first == name; });
  fail_if<ConfigError>(it == registry().end(), "parallel.mode: unknown training mode '{}'", name);
  return it->second;
}

std::vector<std::string> mode_names() {
  std::vector<std::string> names;
  for (const auto& [name, spec] : registry()) names.push_back(name);
  return names;
}

void ModeRefusal::operator()(bool bad, const std::string& what, const std::string& why) const {
  fail_if<ConfigError>(bad, "parallel.mode: {} with {} is not supported: {}; choose one", mode,
                       what, why);
}

}  // namespace dtrain
