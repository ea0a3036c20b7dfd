// A rank's place under a lighthouse (comm/lighthouse.hpp): the world it joins from what the
// lighthouse serves, and the lines it refuses a lighthouse with.
#include <doctest/doctest.h>

#include <memory>
#include <string>

#include <fmt/format.h>

#include "comm/lighthouse.hpp"
#include "comm/tcp_store.hpp"
#include "util/error.hpp"

namespace unit_comm_lighthouse {
using namespace dtrain;

namespace {
// A store serving `served` as a lighthouse would ("STARTING SIZE MOST [PROTOCOL]").
std::unique_ptr<TcpStore> serving(const std::string& served) {
  TcpStore::Options o;
  o.host = "127.0.0.1", o.server = true, o.timeout = std::chrono::seconds(10);
  auto store = std::make_unique<TcpStore>(o);
  store->set("dtrain/lighthouse", std::vector<uint8_t>(served.begin(), served.end()));
  return store;
}
std::string address(const std::unique_ptr<TcpStore>& store) {
  return "127.0.0.1:" + std::to_string(store->port());
}
}  // namespace

TEST_CASE("lighthouse: a rank's world is its replica's place in the most replicas served") {
  auto store = serving(fmt::format("2 2 4 {}", kStoreProtocol));
  WorldInfo launched;
  launched.rank = 1, launched.world = 2;
  const auto w = lighthouse_world(launched, address(store), "3", 2, std::chrono::seconds(5));
  CHECK(w.rank == 7);  // replica 3's second rank
  CHECK(w.world == 8);
  CHECK(w.store_hosted);
  CHECK(w.master_port == store->port());
}

TEST_CASE("lighthouse: a launcher of several whole replicas starts DTRAIN_REPLICA and those after it") {
  auto store = serving(fmt::format("4 2 4 {}", kStoreProtocol));
  WorldInfo launched;
  launched.rank = 3, launched.world = 4;  // two replicas of two ranks: the second's second
  const auto w = lighthouse_world(launched, address(store), "2", 2, std::chrono::seconds(5));
  CHECK(w.rank == 7);  // replica 3's second rank
  CHECK(w.world == 8);
  // Part of a replica, or replicas past those served: refused, naming both.
  launched.world = 3;
  CHECK_THROWS_WITH_AS(lighthouse_world(launched, address(store), "0", 2, std::chrono::seconds(5)),
                       doctest::Contains("its launcher started 3 rank(s); a replica here is 2"),
                       ConfigError);
  launched.world = 4;
  CHECK_THROWS_WITH_AS(lighthouse_world(launched, address(store), "3", 2, std::chrono::seconds(5)),
                       doctest::Contains("DTRAIN_REPLICA 3: its launcher starts 2 replicas (4 "
                                         "ranks of 2), 3 to 4, past the 4 the lighthouse"),
                       ConfigError);
}

TEST_CASE("lighthouse: one from a dtrain whose store protocol differs is refused, naming both") {
  auto old = serving("2 1 2");  // a lighthouse from before the protocol's number
  WorldInfo launched;
  const std::string said = fmt::format("speaks store protocol 1, this rank {}: start the "
                                       "lighthouse and the ranks from the same dtrain", kStoreProtocol);
  CHECK_THROWS_WITH_AS(lighthouse_world(launched, address(old), "0", 1, std::chrono::seconds(5)),
                       doctest::Contains(said.c_str()), ConfigError);
}

}  // namespace unit_comm_lighthouse
