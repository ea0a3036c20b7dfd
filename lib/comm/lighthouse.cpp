#include "comm/lighthouse.hpp"

#include <signal.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/tcp_store.hpp"
#include "comm/watch.hpp"
#include "util/error.hpp"
#include "util/process.hpp"

namespace dtrain {
namespace {

// What the lighthouse tells the ranks: "STARTING SIZE MOST PROTOCOL" (replicas, ranks in
// each, its store's kStoreProtocol: 1 where a lighthouse from before the number says none).
const char* kServedKey = "dtrain/lighthouse";

struct Served {
  int64_t starting = 0, size = 0, most = 0, protocol = 1;
};
Served served_by(const std::vector<uint8_t>& v) {
  Served s;
  std::istringstream in(std::string(v.begin(), v.end()));
  in >> s.starting >> s.size >> s.most;
  if (int64_t protocol = 0; in >> protocol) s.protocol = protocol;
  return s;
}

// A rank that stopped answering: killed where it runs here (its launcher restarts its
// replica), else named once; its peers leave it out either way.
void end_silent(c10d::Store& store, int64_t rank, const std::string& here,
                const std::function<void(const std::string&)>& say) {
  const auto process = its_process(store, rank);
  if (process && process->first == here && ::kill(pid_t(process->second), SIGKILL) == 0) {
    say(fmt::format("dtrain lighthouse: rank {} stopped answering (its heartbeat is stale): "
                    "killed its process {}", rank, process->second));
    return;
  }
  say(fmt::format("dtrain lighthouse: rank {} stopped answering (its heartbeat is stale){}; "
                  "its peers leave its replica out", rank,
                  process ? fmt::format(", process {} on {}", process->second, process->first) : ""));
}

// What the lighthouse knows of each rank of the job, from the store: whether it came (it
// left word of its process), has ended, and was found silent. Each look reads every rank's
// word in one request and says what changed.
class RankLog {
 public:
  RankLog(c10::intrusive_ptr<c10d::Store> store, const LighthouseOptions& o, int64_t world)
      : store_(std::move(store)), o_(o), live_(store_, o.silent, /*none_alive=*/true),
        here_(host_name()), ranks_(size_t(world)), numbers_(world_ranks(world)) {}

  // Looks at every rank once; true while one that came runs.
  bool look() {
    const auto words = read_words(*store_, numbers_);
    bool running = false;
    for (int64_t r : numbers_) running = look_at(r, words[size_t(r)]) || running;
    return running;
  }
  bool any_came() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& k) { return k.came; });
  }

 private:
  struct Rank {
    bool came = false, ended = false, silent = false;
  };
  bool look_at(int64_t r, const RankWord& word) {
    auto& k = ranks_[size_t(r)];
    k.came = k.came || word.process.has_value();
    if (!k.came) return false;
    if (word.ended != k.ended) {
      o_.say(fmt::format("dtrain lighthouse: rank {} (replica {}) {}", r, r / o_.replica_size,
                         word.ended ? "has ended" : "runs again"));
      k.ended = word.ended, k.silent = false;
    }
    if (!word.ended && !k.silent && !live_(r, word)) {
      end_silent(*store_, r, here_, o_.say);
      k.silent = true;
    }
    return !word.ended;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const LighthouseOptions& o_;
  Liveness live_;
  std::string here_;
  std::vector<Rank> ranks_;
  std::vector<int64_t> numbers_;  // 0 .. world - 1
};

}  // namespace

int serve_lighthouse(const LighthouseOptions& o) {
  TcpStore::Options so;
  so.host = o.host, so.port = o.port, so.server = true, so.timeout = o.timeout;
  so.other_machines = o.host.rfind("127.", 0) != 0 && o.host != "localhost";
  auto store = c10::make_intrusive<TcpStore>(so);
  const int64_t most = std::max(o.most, o.replicas);
  const std::string shape = fmt::format("{} {} {} {}", o.replicas, o.replica_size, most, kStoreProtocol);
  store->set(kServedKey, std::vector<uint8_t>(shape.begin(), shape.end()));
  o.say(fmt::format("dtrain lighthouse: {} replica(s) of {} rank(s){} meet at {}:{} "
                    "(DTRAIN_LIGHTHOUSE={}:{}, DTRAIN_REPLICA=0..{})", o.replicas,
                    o.replica_size, most > o.replicas ? fmt::format(", up to {}", most) : "",
                    o.host, store->port(), o.host, store->port(), most - 1));
  const int64_t world = most * o.replica_size;
  std::optional<JobWatch> watch;
  if (o.hang_after.count() > 0) watch.emplace(store, world, o.hang_after, o.say);
  RankLog ranks(store, o, world);
  const auto started = std::chrono::steady_clock::now();
  auto last_running = started;  // when a rank that came last ran
  while (!o.stop()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (watch) watch->tick();
    const bool running = ranks.look();
    const auto now = std::chrono::steady_clock::now();
    if (!ranks.any_came()) {
      if (now - started > o.timeout)
        throw DistError(fmt::format("lighthouse: no rank came within dist.timeout_s = {} s",
                                    std::chrono::duration_cast<std::chrono::seconds>(o.timeout).count()));
      last_running = now;
    } else if (running) {
      last_running = now;
    } else if (now - last_running > o.silent) {  // no replica restarting to join
      o.say("dtrain lighthouse: every rank has ended");
      return 0;
    }
  }
  return 0;
}

WorldInfo lighthouse_world(const WorldInfo& launched, const std::string& address,
                           const std::string& replica, int64_t size_here,
                           std::chrono::milliseconds timeout) {
  const auto colon = address.rfind(':');
  int port = 0;
  try {
    port = colon == std::string::npos ? 0 : std::stoi(address.substr(colon + 1));
  } catch (const std::exception&) {
  }
  fail_if<ConfigError>(port <= 0 || port > 65535 || colon == 0,
                       "DTRAIN_LIGHTHOUSE: expected HOST:PORT, as `dtrain lighthouse` prints "
                       "it (got '{}')", address);
  int64_t index = -1;
  try {
    size_t used = 0;
    index = std::stoll(replica, &used);
    if (used != replica.size()) index = -1;
  } catch (const std::exception&) {
  }
  TcpStore::Options so;
  so.host = address.substr(0, colon), so.port = port, so.timeout = timeout;
  Served shape;
  try {
    TcpStore store(so);
    shape = served_by(store.get(kServedKey));
  } catch (const std::exception& e) {
    throw DistError(fmt::format("rank {}: no lighthouse answered at {} (DTRAIN_LIGHTHOUSE): {}",
                                launched.rank, address, first_line(e.what())));
  }
  fail_if<ConfigError>(shape.protocol != kStoreProtocol, "the lighthouse at {} speaks store "
                       "protocol {}, this rank {}: start the lighthouse and the ranks from the "
                       "same dtrain", address, shape.protocol, kStoreProtocol);
  const int64_t replicas = shape.most, size = shape.size;
  fail_if<ConfigError>(index < 0 || index >= replicas, "DTRAIN_REPLICA: expected a replica "
                       "from 0 to {}, as the lighthouse at {} serves {} (got '{}')",
                       replicas - 1, address, replicas, replica);
  fail_if<ConfigError>(size != size_here, "the lighthouse at {} serves replicas of {} rank(s); "
                       "this job's parallel.tensor x parallel.pipeline is {}: start both from "
                       "the same job spec", address, size, size_here);
  fail_if<ConfigError>(launched.world % size != 0, "replica {}: its launcher started {} "
                       "rank(s); a replica here is {} (parallel.tensor x parallel.pipeline): a "
                       "launcher starts whole replicas, e.g. torchrun --nproc-per-node {}",
                       index, launched.world, size, size);
  // A launcher of several replicas starts DTRAIN_REPLICA and those after it.
  const int64_t here = launched.world / size;
  fail_if<ConfigError>(index + here > replicas, "DTRAIN_REPLICA {}: its launcher starts {} "
                       "replicas ({} ranks of {}), {} to {}, past the {} the lighthouse at {} "
                       "serves", index, here, launched.world, size, index, index + here - 1,
                       replicas, address);
  WorldInfo w = launched;
  w.rank = index * size + launched.rank;
  w.world = replicas * size;
  w.master_addr = so.host, w.master_port = port;
  w.store_hosted = true, w.agent_store = false;
  w.run_id.clear();  // a restarted replica joins its peers; it resumes nothing
  return w;
}

int64_t starting_replicas(c10d::Store& store, int64_t replicas) {
  if (!store.check({kServedKey})) return replicas;
  return served_by(store.get(kServedKey)).starting;
}

}  // namespace dtrain
