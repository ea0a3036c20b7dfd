#include "launch/world.hpp"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>

#include <fmt/format.h>

#include "util/error.hpp"

namespace dtrain {

Env process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
}

Env map_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

namespace {

int64_t to_int(const std::string& name, const std::string& value) {
  try {
    size_t used = 0;
    long long v = std::stoll(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  throw ConfigError(fmt::format("environment variable {}='{}' is not an integer", name, value));
}

std::optional<int64_t> int_var(const Env& env, const std::string& name) {
  auto v = env(name);
  return v ? std::optional<int64_t>(to_int(name, *v)) : std::nullopt;
}

// Splits on commas that are not inside brackets.
std::vector<std::string> split_top(const std::string& s) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

// Where each launcher puts the rank, the world size and the local layout, in the order
// they are looked for. SLURM's node list is handled on its own.
struct LauncherVars {
  const char *name, *rank, *size, *local_rank, *local_size;
};
const LauncherVars kLaunchers[] = {
    {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
};

const LauncherVars* find_launcher(const Env& env) {
  for (const auto& l : kLaunchers)
    if (env(l.rank) && env(l.size)) return &l;
  return nullptr;
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  auto bad = [&](const std::string& why) {
    return ConfigError(fmt::format("SLURM node list '{}': {}", list, why));
  };
  std::vector<std::string> hosts;
  for (const auto& part : split_top(list)) {
    if (part.empty()) throw bad("empty host name");
    auto open = part.find('[');
    if (open == std::string::npos) {
      if (part.find(']') != std::string::npos) throw bad("unbalanced ']'");
      hosts.push_back(part);
      continue;
    }
    auto close = part.find(']', open);
    if (close == std::string::npos) throw bad("unbalanced '['");
    const std::string prefix = part.substr(0, open), suffix = part.substr(close + 1);
    if (suffix.find('[') != std::string::npos) {
      // node[1-2]-rack[3-4]: expand the first bracket, then the rest recursively.
      for (const auto& head : expand_hostlist(part.substr(0, close + 1)))
        for (const auto& tail : expand_hostlist("x" + suffix)) hosts.push_back(head + tail.substr(1));
      continue;
    }
    for (const auto& range : split_top(part.substr(open + 1, close - open - 1))) {
      auto dash = range.find('-');
      const std::string lo = range.substr(0, dash);
      const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
      if (lo.empty() || hi.empty() || lo.find_first_not_of("0123456789") != std::string::npos ||
          hi.find_first_not_of("0123456789") != std::string::npos)
        throw bad(fmt::format("bad range '{}'", range));
      const int64_t a = std::stoll(lo), b = std::stoll(hi);
      if (b < a || b - a > 100000) throw bad(fmt::format("bad range '{}'", range));
      for (int64_t i = a; i <= b; ++i)  // zero padding follows the lower bound's width
        hosts.push_back(prefix + fmt::format("{:0{}d}", i, lo.size()) + suffix);
    }
  }
  return hosts;
}

std::string first_slurm_host(const std::string& nodelist) {
  std::string cmd = "scontrol show hostnames '" + nodelist + "' 2>/dev/null";
  if (nodelist.find('\'') == std::string::npos) {
    std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
    char line[512];
    if (p && std::fgets(line, sizeof line, p.get())) {
      std::string host(line);
      host.erase(host.find_last_not_of(" \n") + 1);
      if (!host.empty()) return host;
    }
  }
  return expand_hostlist(nodelist).front();
}

std::vector<int64_t> world_ranks(int64_t world) {
  std::vector<int64_t> ranks(size_t(world), 0);
  std::iota(ranks.begin(), ranks.end(), int64_t(0));
  return ranks;
}

void clear_launcher_env() {
  for (const auto& l : kLaunchers)
    for (const char* v : {l.rank, l.size, l.local_rank, l.local_size})
      if (v) ::unsetenv(v);
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "PET_NNODES",
                        "DTRAIN_STORE_HOSTED"})
    ::unsetenv(v);
}

std::string detect_launcher(const Env& env) {
  const auto* l = find_launcher(env);
  return l ? l->name : "single";
}

WorldInfo discover_world(const Env& env, int64_t config_port,
                         const std::function<std::string(const std::string&)>& first_host) {
  WorldInfo w;
  if (const auto* l = find_launcher(env)) {
    w.launcher = l->name;
    w.rank = to_int(l->rank, *env(l->rank));
    w.world = to_int(l->size, *env(l->size));
    // Without local information (a single-node torchrun does give it), assume one machine
    // for torchrun-style variables and one process per machine otherwise.
    const bool env_style = w.launcher == "env";
    w.local_rank = int_var(env, l->local_rank).value_or(env_style ? w.rank : 0);
    w.local_world = l->local_size ? int_var(env, l->local_size).value_or(env_style ? w.world : 1) : 1;
    w.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
    if (env_style) {
      w.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
      w.restart_count = int_var(env, "TORCHELASTIC_RESTART_COUNT").value_or(0);
      w.run_id = env("TORCHELASTIC_RUN_ID").value_or("");
      w.store_hosted = env("DTRAIN_STORE_HOSTED").value_or("") == "1";
    }
    if (w.launcher == "slurm") {
      // SLURM_*_TASKS_PER_NODE may read "2(x3)": the leading count is this node's.
      auto per_node = env("SLURM_STEP_TASKS_PER_NODE") ? env("SLURM_STEP_TASKS_PER_NODE")
                                                       : env("SLURM_TASKS_PER_NODE");
      if (per_node) w.local_world = std::max<int64_t>(1, std::atoll(per_node->c_str()));
      auto nodes = env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
      if (!env("MASTER_ADDR") && nodes) w.master_addr = first_host(*nodes);
    }
  }
  if (w.world < 1 || w.rank < 0 || w.rank >= w.world)
    throw ConfigError(fmt::format("launcher '{}' gave rank {} of world size {}", w.launcher,
                                  w.rank, w.world));
  if (w.local_world < 1 || w.local_rank < 0 || w.local_rank >= w.local_world)
    w.local_rank = 0, w.local_world = 1;  // inconsistent local info: don't split the cores

  // A launcher that names the port (torchrun, our own --nproc) must win over the job file.
  if (auto p = int_var(env, "MASTER_PORT")) {
    fail_if<ConfigError>(*p < 1 || *p > 65535, "MASTER_PORT: must be a port in 1-65535 (got {})",
                         *p);
    w.master_port = *p;
  } else if (config_port > 0) {
    w.master_port = config_port;
  } else if (w.launcher == "slurm" && env("SLURM_JOB_ID")) {
    w.master_port = 20000 + to_int("SLURM_JOB_ID", *env("SLURM_JOB_ID")) % 20000;
  } else {
    w.master_port = 29500;
  }
  return w;
}

}  // namespace dtrain
