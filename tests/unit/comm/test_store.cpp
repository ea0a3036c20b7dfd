// dtrain's rendezvous store: the c10d::Store operations Gloo relies on, bounded waits, and
// where the server listens.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "comm/tcp_store.hpp"

namespace unit_comm_store {

using namespace dtrain;

namespace {
TcpStore::Options opts(int port, bool server, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  TcpStore::Options o;
  o.host = "127.0.0.1";
  o.port = port;
  o.server = server;
  o.timeout = timeout;
  return o;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// The local addresses listening on `port`, as /proc/net/tcp{,6} write them (hex).
std::vector<std::string> listeners(int port) {
  std::vector<std::string> out;
  char want[8];
  std::snprintf(want, sizeof want, ":%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == want)
        out.push_back(local.substr(0, local.size() - 5));
    }
  }
  return out;
}
}  // namespace

TEST_CASE("TcpStore: set, get, add, check, wait, compareSet, delete across clients") {
  TcpStore server(opts(0, true));
  const int port = server.port();
  REQUIRE(port > 0);
  TcpStore client(opts(port, false));

  server.set("a", bytes("one"));
  CHECK(client.get("a") == bytes("one"));
  CHECK(client.add("n", 5) == 5);
  CHECK(server.add("n", -2) == 3);
  CHECK(client.get("n") == bytes("3"));  // counters read back as decimal text, as in c10d
  CHECK(client.check({"a", "n"}));
  CHECK_FALSE(client.check({"a", "missing"}));
  CHECK(client.getNumKeys() == 2);
  CHECK(client.compareSet("c", {}, bytes("x")) == bytes("x"));       // absent, expected empty: set
  CHECK(client.compareSet("c", bytes("y"), bytes("z")) == bytes("x"));  // mismatch: unchanged
  CHECK(client.compareSet("c", bytes("x"), bytes("z")) == bytes("z"));  // match: swapped
  CHECK(server.deleteKey("c"));
  CHECK_FALSE(server.deleteKey("c"));

  // get and wait block until another rank sets the key.
  std::thread later([port] {
    TcpStore other(opts(port, false));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    other.set("late", bytes("here"));
  });
  client.wait({"late"});
  CHECK(client.get("late") == bytes("here"));
  later.join();

  // Bounded: a key that never comes times out with an error that says so.
  TcpStore impatient(opts(port, false, std::chrono::milliseconds(300)));
  CHECK_THROWS_WITH(impatient.get("never"), doctest::Contains("timed out"));
  CHECK_THROWS_WITH(impatient.wait({"never"}, std::chrono::milliseconds(200)),
                    doctest::Contains("timed out"));
}

TEST_CASE("TcpStore: what a client asked done when its connection closes is done then, not before") {
  TcpStore server(opts(0, true));
  server.set("beat", bytes("1"));
  {
    TcpStore client(opts(server.port(), false));
    client.on_close("ended", bytes("yes"));
    client.on_close("beat", {});  // empty: deleted
    client.set("alive", bytes("1"));
    CHECK_FALSE(server.check({"ended"}));
    CHECK(server.check({"beat"}));
  }  // its socket closes, as a process's do when it dies
  // The server acts once it sees the close: on its next poll, not this instant.
  for (int i = 0; i < 200 && !server.check({"ended"}); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(server.get("ended") == bytes("yes"));
  CHECK_FALSE(server.check({"beat"}));
  CHECK(server.check({"alive"}));
}

TEST_CASE("TcpStore: many clients add at once and every increment counts") {
  TcpStore server(opts(0, true));
  std::vector<std::thread> ranks;
  for (int r = 0; r < 8; ++r)
    ranks.emplace_back([port = server.port()] {
      TcpStore s(opts(port, false));
      for (int i = 0; i < 50; ++i) s.add("count", 1);
    });
  for (auto& t : ranks) t.join();
  CHECK(server.add("count", 0) == 400);
}

TEST_CASE("TcpStore: the server listens on MASTER_ADDR's interface only, unless told otherwise") {
  {
    TcpStore server(opts(0, true));
    const auto at = listeners(server.port());
    CHECK(at == std::vector<std::string>{"0100007F"});  // 127.0.0.1, not 0.0.0.0 or ::
  }
  {
    auto o = opts(0, true);
    o.listen_everywhere = true;
    TcpStore server(o);
    const auto at = listeners(server.port());
    REQUIRE(at.size() == 1);
    CHECK(at[0].find_first_not_of('0') == std::string::npos);  // the wildcard address
    TcpStore client(opts(server.port(), false));  // still reachable through loopback
    client.set("k", bytes("v"));
    CHECK(server.get("k") == bytes("v"));
  }
  // Ranks on other machines could never reach a loopback address: then it listens on
  // every interface (with a warning), as c10d's store would.
  auto o = opts(0, true);
  o.other_machines = true;
  TcpStore server(o);
  const auto at = listeners(server.port());
  REQUIRE(at.size() == 1);
  CHECK(at[0].find_first_not_of('0') == std::string::npos);
}

// A port nobody listens on (bound, read, released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST_CASE("TcpStore: a rank already connecting when rank 0 starts listening is served") {
  // The elastic test's intermittent failure: rank 0 listened on loopback, then, the ranks
  // being on "other machines" (one per torchrun agent), replaced its server by one that
  // listens everywhere, and a rank whose retry had connected in between was reset
  // ("send failed: Connection reset by peer"). The rank retries every 20 ms: starting the
  // server at every offset of that period meets the window.
  for (int i = 0; i < 40; ++i) {
    CAPTURE(i);
    const int port = free_port();
    std::string error;
    std::thread rank1([&] {
      try {
        TcpStore client(opts(port, false));
        client.set("k", bytes("v"));
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    std::this_thread::sleep_for(std::chrono::microseconds(500 * i));
    auto o = opts(port, true);
    o.other_machines = true;
    TcpStore server(o);
    rank1.join();
    CHECK(error.empty());
    if (!error.empty()) break;
    CHECK(server.get("k") == bytes("v"));
  }
}

TEST_CASE("TcpStore: a client that breaks the protocol is dropped; the others go on") {
  TcpStore server(opts(0, true));
  TcpStore client(opts(server.port(), false));
  // A raw connection that sends a frame claiming 4 GiB: the server drops it.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
  CHECK(::send(fd, junk, sizeof junk, 0) == ssize_t(sizeof junk));
  char byte;
  CHECK(::recv(fd, &byte, 1, 0) == 0);  // closed by the server
  ::close(fd);
  client.set("still", bytes("works"));
  CHECK(client.get("still") == bytes("works"));
  // add() on a key that holds text: that client is dropped, and says so from then on.
  client.set("text", bytes("abc"));
  CHECK_THROWS(client.add("text", 1));
  CHECK_THROWS_WITH(client.get("still"), doctest::Contains("connection to rank 0's store was lost"));
  TcpStore other(opts(server.port(), false));
  CHECK(other.get("still") == bytes("works"));
}

TEST_CASE("TcpStore: values_now reads many keys at once, an absent one as none, without waiting") {
  TcpStore server(opts(0, true));
  TcpStore client(opts(server.port(), false, std::chrono::milliseconds(300)));
  const std::vector<uint8_t> binary{0, 0xff, 0, 7};
  server.set("a", bytes("one"));
  server.set("empty", {});
  server.set("binary", binary);
  auto v = client.values_now({"a", "missing", "empty", "binary", "a"});
  REQUIRE(v.size() == 5);
  CHECK(v[0] == bytes("one"));
  CHECK_FALSE(v[1].has_value());  // absent: at once, not after the store's timeout
  REQUIRE(v[2].has_value());      // present, and empty
  CHECK(v[2]->empty());
  CHECK(v[3] == binary);
  CHECK(v[4] == bytes("one"));
  CHECK(client.values_now({}).empty());

  // A launcher's read of a large job: thousands of keys (more than one request takes),
  // every other one absent.
  std::vector<std::string> keys;
  for (int i = 0; i < 10000; ++i) {
    keys.push_back(std::string("k").append(std::to_string(i)));
    if (i % 2 == 0) server.set(keys.back(), bytes(std::string(100, char('a' + i % 26))));
  }
  const auto many = client.values_now(keys);
  REQUIRE(many.size() == keys.size());
  for (int i = 0; i < 10000; ++i) {
    CAPTURE(i);
    if (i % 2 == 0) CHECK(many[size_t(i)] == bytes(std::string(100, char('a' + i % 26))));
    else CHECK_FALSE(many[size_t(i)].has_value());
  }
  // Values past the 16 MiB an answer holds, and past a message's 64 MiB in all: the rest
  // asked for again, nothing lost.
  const std::string big(3u << 20, 'b');
  std::vector<std::string> bigs;
  for (int i = 0; i < 24; ++i) {
    bigs.push_back(std::string("big").append(std::to_string(i)));
    server.set(bigs.back(), bytes(big + char('a' + i)));
  }
  const auto large = client.values_now(bigs);
  REQUIRE(large.size() == bigs.size());
  for (int i = 0; i < 24; ++i) CHECK(large[size_t(i)] == bytes(big + char('a' + i)));
  client.set("after", bytes("x"));  // the connection is in step after the large replies
  CHECK(client.get("after") == bytes("x"));
  CHECK(client.get("a") == bytes("one"));
}

TEST_CASE("TcpStore: a client gives up on an absent server after its timeout") {
  TcpStore::Options o = opts(1, false, std::chrono::milliseconds(300));  // port 1: nobody
  CHECK_THROWS_WITH(TcpStore{o}, doctest::Contains("timed out connecting to 127.0.0.1:1"));
}

TEST_CASE("store: a clone is a second client of the same server (LibTorch 2.7+ asks for one)") {
  TcpStore server(opts(0, true));
  auto clone = server.clone();
  clone->set("from-clone", bytes("a"));
  CHECK(server.get("from-clone") == bytes("a"));
  server.set("from-server", bytes("b"));
  CHECK(clone->get("from-server") == bytes("b"));
  CHECK(clone->add("n", 2) == 2);
  CHECK(server.add("n", 3) == 5);
}

TEST_CASE("TcpStore: a client that never reads its replies holds up nobody else") {
  TcpStore server(opts(0, true));
  TcpStore client(opts(server.port(), false));
  client.set("big", std::vector<uint8_t>(1 << 20, 7));  // 1 MiB
  // A raw client asks for the big value over and over and never reads: its replies pile up
  // in the server's buffer (up to the limit, then it is dropped), not in the server thread.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  // One request: u32 length, then op 2 (try-get) and the key as a u32-length blob.
  std::vector<uint8_t> req = {8, 0, 0, 0, 2, 3, 0, 0, 0, 'b', 'i', 'g'};
  for (int i = 0; i < 64; ++i) CHECK(::send(fd, req.data(), req.size(), 0) == ssize_t(req.size()));
  // A server thread stuck writing to the raw client would leave these unanswered: the
  // client would give up at its timeout and throw.
  for (int i = 0; i < 50; ++i) {
    client.set(std::string("k").append(std::to_string(i)), bytes("v"));
    CHECK(client.get(std::string("k").append(std::to_string(i))) == bytes("v"));
  }
  ::close(fd);
}

TEST_CASE("TcpStore: connecting to a host that drops the handshake gives up at the timeout") {
  // A listener whose accept queue is full (backlog 0, never accepted): further connection
  // attempts are dropped, and a blocking connect() would wait for the kernel's retries.
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 0) == 0);
  socklen_t len = sizeof a;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
  std::vector<int> fillers;
  for (int i = 0; i < 4; ++i) {  // non-blocking: those past the queue would hang here too
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    fillers.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = std::chrono::steady_clock::now();
  TcpStore::Options o = opts(ntohs(a.sin_port), false, std::chrono::milliseconds(1500));
  CHECK_THROWS_WITH(TcpStore{o}, doctest::Contains("timed out connecting"));
  // Not a speed bound: a blocking connect() would wait out the kernel's SYN retries (about
  // 127 s at Linux's default tcp_syn_retries), which the 1.5 s timeout must cut short; 60 s
  // tells the two apart on however busy a machine.
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 60.0);
  for (int fd : fillers) ::close(fd);
  ::close(listener);
}

TEST_CASE("TcpStore: a socket connected to itself is told apart from a connection") {
  // A free port, then a socket bound to it connecting to it: TCP's simultaneous open
  // connects it to itself, as a client's connect can while rank 0 is not listening yet.
  int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(probe, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(probe);
  int self = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(self, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  REQUIRE(::bind(self, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::connect(self, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  CHECK(connected_to_itself(self));
  ::close(self);

  // A real connection, to a store's server: not itself.
  TcpStore server(opts(0, true));
  int client = ::socket(AF_INET, SOCK_STREAM, 0);
  a.sin_port = htons(uint16_t(server.port()));
  REQUIRE(::connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  CHECK_FALSE(connected_to_itself(client));
  ::close(client);
}

}  // namespace unit_comm_store
