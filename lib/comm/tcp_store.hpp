// The rendezvous store the ranks of a job meet through (a c10d::Store, so Gloo and NCCL use it
// as they would c10d's TCPStore). dtrain hosts its own because c10d's TCPStore server listens
// on every interface with no address to choose (2.15 can take a socket bound beforehand,
// masterListenFd; LibTorch >= 2.4 also wants a libuv that distribution builds lack): this
// one listens on the address MASTER_ADDR resolves to, unless the job asks for all of them.
//
// Rank 0 runs the server on a thread; every rank, rank 0 included, is a client over one
// TCP connection. Each request is answered at once, so blocking reads (get, wait) poll
// until the key exists or the timeout passes: no request ever holds the server.
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace dtrain {

class StoreServer;

// Whether a connected socket is connected to itself. Connecting to a local port that nobody
// listens on yet (rank 0 still starting) can pick that very port as the source, and TCP's
// simultaneous open then connects the socket to itself: a "server" that answers each request
// with the request. The client drops such a socket and tries again.
bool connected_to_itself(int fd);

// The requests a store answers, numbered: one that asks more of it than an older store
// knows (values_now) is refused there, so a store hosted apart from the ranks (the
// lighthouse) says its number and a rank checks it.
constexpr int kStoreProtocol = 2;

class TcpStore : public c10d::Store {
 public:
  struct Options {
    std::string host;             // MASTER_ADDR: where the server is, and where it listens
    int port = 0;
    bool server = false;          // rank 0
    bool listen_everywhere = false;  // dist.store_bind: all
    bool other_machines = false;     // some ranks run elsewhere: a loopback host cannot do
    std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  };
  explicit TcpStore(const Options& o);
  ~TcpStore() override;

  // The port the server listens on (useful with port 0 in tests).
  int port() const { return port_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // Each key's value now, none where the key is absent, in one request that never waits
  // (a few where the keys or their values pass 16 MiB): a launcher reads every rank's word
  // each tick, so its cost is a round trip, not one a key and rank.
  std::vector<std::optional<std::vector<uint8_t>>> values_now(const std::vector<std::string>& keys);
  // When this connection closes (the process ended, however it ended: the kernel closes
  // its sockets), the server sets `key` to `value`, or deletes it where `value` is empty:
  // how a launcher that did not start the process learns at once that it is gone.
  void on_close(const std::string& key, const std::vector<uint8_t>& value);
  // A second connection to the same server. LibTorch 2.7+ asks stores for one (pure
  // virtual in c10d::Store there, absent before: hence no `override`).
  c10::intrusive_ptr<c10d::Store> clone();

 private:
  std::vector<uint8_t> request(const std::vector<uint8_t>& message);

  Options opts_;
  std::unique_ptr<StoreServer> server_;
  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;
  int port_ = 0;
};

// The values `keys` hold now in any store, none where a key holds none, without waiting:
// one request where the store is dtrain's own, else one a key.
std::vector<std::optional<std::vector<uint8_t>>> values_now(c10d::Store& store,
                                                            const std::vector<std::string>& keys);

}  // namespace dtrain
