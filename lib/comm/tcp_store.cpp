#include "comm/tcp_store.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

namespace dtrain {
namespace {

// The wire format: a message is a u32 length then its bytes. A request's bytes are an op
// then its arguments, each a u32 length then bytes; a reply's bytes depend on the op.
enum Op : uint8_t { kSet = 1, kTryGet, kAdd, kCheck, kDelete, kNumKeys, kCompareSet, kOnClose, kTryGetMany };
constexpr uint32_t kMaxMessage = 64u << 20;  // nothing a rendezvous sends comes near
// The most a many-key request or its answer holds: a large job's read takes a few.
constexpr size_t kManyBytes = 16u << 20;

using Bytes = std::vector<uint8_t>;

void put_u32(Bytes& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
// A key (std::string) or a value (Bytes), length first.
template <class Blob>
void put_blob(Bytes& b, const Blob& v) {
  put_u32(b, uint32_t(v.size()));
  b.insert(b.end(), v.begin(), v.end());
}
Bytes i64_bytes(int64_t v) {
  Bytes b(8);
  for (int i = 0; i < 8; ++i) b[size_t(i)] = uint8_t(uint64_t(v) >> (8 * i));
  return b;
}
int64_t i64_of(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return int64_t(v);
}
uint32_t u32_of(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }

// Reads the arguments of a request; false when it is malformed.
bool parse_args(const uint8_t* p, size_t n, std::vector<Bytes>& args) {
  size_t at = 0;
  while (at < n) {
    if (n - at < 4) return false;
    const uint32_t len = u32_of(p + at);
    at += 4;
    if (len > n - at) return false;
    args.emplace_back(p + at, p + at + len);
    at += len;
  }
  return true;
}

std::string as_key(const Bytes& b) { return std::string(b.begin(), b.end()); }

void send_all(int fd, const Bytes& b) {
  size_t done = 0;
  while (done < b.size()) {
    ssize_t n = ::send(fd, b.data() + done, b.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(fmt::format("store: send failed: {}", std::strerror(errno)));
    done += size_t(n);
  }
}

void recv_all(int fd, uint8_t* p, size_t n) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::recv(fd, p + done, n - done, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      throw std::runtime_error("store: timed out waiting for rank 0's store to answer");
    if (r <= 0) throw std::runtime_error("store: connection to rank 0's store closed");
    done += size_t(r);
  }
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

void resolve(const std::string& host, int port, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  if (int err = ::getaddrinfo(passive && host.empty() ? nullptr : host.c_str(), service.c_str(),
                              &hints, &out.list))
    throw std::runtime_error(fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(err)));
}

// connect() with a deadline: a host that drops SYNs (a full backlog, a firewall) would
// otherwise hold a blocking connect for the kernel's two minutes of retries. True when
// connected; errno says why not.
bool connect_within(int fd, const sockaddr* addr, socklen_t len, std::chrono::milliseconds left) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  bool ok = ::connect(fd, addr, len) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int r;
    do r = ::poll(&p, 1, int(std::max<int64_t>(0, left.count())));
    while (r < 0 && errno == EINTR);
    int err = r == 0 ? ETIMEDOUT : 0;
    socklen_t size = sizeof err;
    if (r > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &size);
    ok = err == 0;
    errno = err;
  }
  ::fcntl(fd, F_SETFL, flags);
  return ok;
}

// A socket address as numeric text: its host, with `with_port` "host/port" (to compare a
// socket's two ends).
std::string address_str(const sockaddr* a, bool with_port = false) {
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  ::getnameinfo(a, a->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in), host,
                sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
  return with_port ? std::string(host) + "/" + port : std::string(host);
}

// The first address `host` resolves to for listening (the one a server binds first).
std::string first_address(const std::string& host, int port) {
  AddrInfo ai;
  resolve(host, port, /*passive=*/true, ai);
  return ai.list ? address_str(ai.list->ai_addr) : "";
}

}  // namespace

bool connected_to_itself(int fd) {
  sockaddr_storage self{}, peer{};
  auto *s = reinterpret_cast<sockaddr*>(&self), *p = reinterpret_cast<sockaddr*>(&peer);
  socklen_t a = sizeof self, b = sizeof peer;
  if (::getsockname(fd, s, &a) != 0 || ::getpeername(fd, p, &b) != 0) return false;
  return self.ss_family == peer.ss_family &&
         address_str(s, /*with_port=*/true) == address_str(p, /*with_port=*/true);
}

// Rank 0's side: one thread, epoll over the listening socket and every client. (poll()
// looked at every client on each wake: with a rank's heartbeat a second, a job of N ranks
// cost the server N x N looks a second, a whole core at 2048 ranks.)
class StoreServer {
 public:
  // `remote_note`, when given, is printed once, when the first client connects from
  // another machine.
  StoreServer(const std::string& host, int port, bool everywhere, std::string remote_note = "")
      : remote_note_(std::move(remote_note)) {
    AddrInfo ai;
    resolve(everywhere ? "" : host, port, /*passive=*/true, ai);
    std::string tried;
    for (auto* a = ai.list; a && listen_fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (a->ai_family == AF_INET6 && everywhere) {
        int zero = 0;  // both IPv4 and IPv6
        ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      }
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
        listen_fd_ = fd;
      } else {
        const int err = errno;
        tried += fmt::format(" {}: {};", address_str(a->ai_addr), std::strerror(err));
        ::close(fd);
      }
    }
    if (listen_fd_ < 0)
      throw std::runtime_error(fmt::format("cannot listen on {}:{}:{}", everywhere ? "*" : host,
                                           port, tried));
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    if (::pipe2(wake_, O_CLOEXEC) != 0) throw std::runtime_error("store: cannot create a pipe");
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_ < 0) throw std::runtime_error("store: cannot create an epoll instance");
    watch(EPOLL_CTL_ADD, wake_[0], EPOLLIN);
    watch(EPOLL_CTL_ADD, listen_fd_, EPOLLIN);
    thread_ = std::thread([this] { serve(); });
  }

  ~StoreServer() {
    const char stop = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_[1], &stop, 1);
    thread_.join();
    for (auto& [fd, c] : clients_) ::close(fd);
    ::close(listen_fd_);
    ::close(epoll_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const { return port_; }

 private:
  bool watch(int op, int fd, uint32_t events) {
    epoll_event e{};
    e.events = events;
    e.data.fd = fd;
    return ::epoll_ctl(epoll_, op, fd, &e) == 0;
  }

  void serve() {
    std::vector<epoll_event> ready(256);
    while (true) {
      const int n = ::epoll_wait(epoll_, ready.data(), int(ready.size()), -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      for (int i = 0; i < n; ++i) {
        const int fd = ready[size_t(i)].data.fd;
        if (fd == wake_[0]) return;
        if (fd == listen_fd_) accept_one();
        else serve_client(fd, ready[size_t(i)].events);
      }
    }
  }

  void accept_one() {
    // Non-blocking: a reply that does not fit the socket waits in the client's buffer for
    // EPOLLOUT, so one client that stops reading never holds up the others.
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (!watch(EPOLL_CTL_ADD, fd, EPOLLIN)) {  // out of watches: refused, not left unserved
      ::close(fd);
      return;
    }
    clients_[fd];
    note_if_remote(fd);
  }

  void serve_client(int fd, uint32_t events) {
    auto it = clients_.find(fd);
    if (it == clients_.end()) return;
    bool keep = true;
    try {
      if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) keep = read_from(fd);
      if (keep && !it->second.out.empty()) keep = write_to(fd);
    } catch (const std::exception&) {  // out of memory for one client's request
      keep = false;
    }
    auto& c = it->second;
    if (keep && c.writing != !c.out.empty()) {  // EPOLLOUT only while replies wait
      c.writing = !c.out.empty();
      keep = watch(EPOLL_CTL_MOD, fd, EPOLLIN | (c.writing ? EPOLLOUT : 0u));
    }
    if (keep) return;
    for (const auto& [key, value] : c.on_close) {
      if (value.empty()) data_.erase(key);
      else data_[key] = value;
    }
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    clients_.erase(it);
  }

  void note_if_remote(int fd) {
    if (remote_note_.empty()) return;
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return;
    const std::string from = address_str(reinterpret_cast<sockaddr*>(&peer));
    if (from.rfind("127.", 0) == 0 || from == "::1" || from.rfind("::ffff:127.", 0) == 0) return;
    std::fprintf(stderr, "%s (a rank connected from %s)\n", remote_note_.c_str(), from.c_str());
    remote_note_.clear();
  }

  // Reads what the client sent and queues the answer to every complete request; false to
  // drop the client.
  bool read_from(int fd) {
    uint8_t chunk[65536];
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n < 0) return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK;
    if (n == 0) return false;
    auto& c = clients_[fd];
    c.in.insert(c.in.end(), chunk, chunk + n);
    size_t used = 0;
    while (c.in.size() - used >= 4) {
      const uint32_t len = u32_of(c.in.data() + used);
      if (len == 0 || len > kMaxMessage) return false;  // not a client of ours
      if (c.in.size() - used < 4 + size_t(len)) break;
      Bytes reply;  // an exception (add() on a key that holds no number) drops the client
      if (!handle(fd, c.in.data() + used + 4, len, reply)) return false;
      put_blob(c.out, reply);
      used += 4 + len;
    }
    c.in.erase(c.in.begin(), c.in.begin() + long(used));
    // A client whose unread replies pile up past what any rendezvous sends is not reading.
    return c.out.size() <= kMaxMessage;
  }

  // Sends what the socket takes of the client's queued replies; false to drop the client.
  bool write_to(int fd) {
    auto& out = clients_[fd].out;
    while (!out.empty()) {
      const ssize_t n = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // later, on EPOLLOUT
      if (n <= 0) return false;
      out.erase(out.begin(), out.begin() + n);
    }
    return true;
  }

  // For each key, a byte that says whether it holds a value, then the value; the first keys
  // only, where the answer would pass kManyBytes (the client asks again for the rest).
  Bytes values_of(const std::vector<Bytes>& keys) const {
    Bytes reply;
    for (const auto& k : keys) {
      auto it = data_.find(as_key(k));
      const size_t size = it == data_.end() ? 1 : 5 + it->second.size();
      if (!reply.empty() && reply.size() + size > kManyBytes) break;
      reply.push_back(it != data_.end());
      if (it != data_.end()) put_blob(reply, it->second);
    }
    return reply;
  }

  bool handle(int fd, const uint8_t* p, size_t n, Bytes& reply) {
    std::vector<Bytes> a;
    if (!parse_args(p + 1, n - 1, a)) return false;
    switch (p[0]) {
      case kOnClose:
        if (a.size() != 2) return false;
        clients_[fd].on_close.emplace_back(as_key(a[0]), a[1]);
        return true;
      case kSet:
        if (a.size() != 2) return false;
        data_[as_key(a[0])] = a[1];
        return true;
      case kTryGet: {
        if (a.size() != 1) return false;
        auto it = data_.find(as_key(a[0]));
        reply.push_back(it != data_.end());
        if (it != data_.end()) reply.insert(reply.end(), it->second.begin(), it->second.end());
        return true;
      }
      case kTryGetMany:
        reply = values_of(a);
        return true;
      case kAdd: {
        if (a.size() != 2 || a[1].size() != 8) return false;
        auto& v = data_[as_key(a[0])];  // stored as decimal text, as c10d's TCPStore does
        int64_t now = 0;
        if (__builtin_add_overflow(v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end())),
                                   i64_of(a[1].data()), &now))
          return false;
        const auto text = std::to_string(now);
        v.assign(text.begin(), text.end());
        reply = i64_bytes(now);
        return true;
      }
      case kCheck:
        reply.push_back(std::all_of(a.begin(), a.end(),
                                    [&](const Bytes& k) { return data_.count(as_key(k)) > 0; }));
        return true;
      case kDelete:
        if (a.size() != 1) return false;
        reply.push_back(data_.erase(as_key(a[0])) > 0);
        return true;
      case kNumKeys:
        reply = i64_bytes(int64_t(data_.size()));
        return true;
      case kCompareSet: {
        if (a.size() != 3) return false;
        auto it = data_.find(as_key(a[0]));
        if (it == data_.end()) {
          if (a[1].empty()) data_[as_key(a[0])] = a[2], reply = a[2];
          else reply = a[1];
        } else {
          if (it->second == a[1]) it->second = a[2];
          reply = it->second;
        }
        return true;
      }
      default:
        return false;
    }
  }

  int listen_fd_ = -1, port_ = 0, epoll_ = -1;
  int wake_[2] = {-1, -1};
  std::string remote_note_;
  struct Client {
    Bytes in;   // received, not yet a whole request
    Bytes out;  // replies the socket has not taken yet
    bool writing = false;  // epoll watches for room to send them
    // What the client asked done once its connection closes (TcpStore::on_close): a key
    // set, or deleted where the value is empty.
    std::vector<std::pair<std::string, Bytes>> on_close;
  };
  std::map<int, Client> clients_;
  std::map<std::string, Bytes> data_;
  std::thread thread_;
};

c10::intrusive_ptr<c10d::Store> TcpStore::clone() {
  Options o = opts_;
  o.server = false;
  o.port = port_;
  return c10::make_intrusive<TcpStore>(o);
}

TcpStore::TcpStore(const Options& o) : c10d::Store(o.timeout), opts_(o) {
  port_ = o.port;
  if (o.server) {
    // Ranks on other machines could never reach a loopback address (a hostname that
    // /etc/hosts maps to 127.0.1.1, as Debian does): then listen everywhere, as c10d's
    // TCPStore would. Whether they do run elsewhere (several launchers on one host also
    // look so) shows when one connects: then it says so. Decided before listening: a
    // server replaced once it listens resets the ranks already connecting to it.
    const std::string at = o.listen_everywhere ? "" : first_address(o.host, o.port);
    const bool widen = o.other_machines && (at.rfind("127.", 0) == 0 || at == "::1");
    server_ = std::make_unique<StoreServer>(
        o.host, o.port, o.listen_everywhere || widen,
        widen ? fmt::format("dtrain: warning: MASTER_ADDR '{}' is a loopback address ({}) on "
                            "rank 0 while ranks run on other machines; the store listens on "
                            "every interface (set MASTER_ADDR to this host's address to avoid "
                            "that)", o.host, at)
              : "");
    port_ = server_->port();
  }
  // Rank 0 may not be listening yet: try again until the timeout.
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  std::string last_error;
  while (fd_ < 0) {
    AddrInfo ai;
    resolve(o.host, port_, /*passive=*/false, ai);
    for (auto* a = ai.list; a && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (!connect_within(fd, a->ai_addr, a->ai_addrlen, left)) {
        last_error = std::strerror(errno);
        ::close(fd);
      } else if (connected_to_itself(fd)) {
        last_error = "connected to itself: nobody listens there yet";
        ::close(fd);
      } else {
        fd_ = fd;
      }
    }
    if (fd_ >= 0) break;
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(fmt::format("store: timed out connecting to {}:{} ({})", o.host,
                                           port_, last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A reply never takes long (nothing blocks on the server): bound every read.
  timeval tv{};
  tv.tv_sec = std::max<long>(1, long(o.timeout.count() / 1000));
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

Bytes TcpStore::request(const Bytes& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) throw std::runtime_error("store: the connection to rank 0's store was lost");
  try {
    Bytes framed;
    put_blob(framed, message);
    send_all(fd_, framed);
    uint8_t len[4];
    recv_all(fd_, len, 4);
    const uint32_t n = u32_of(len);
    if (n > kMaxMessage) throw std::runtime_error("store: malformed reply");
    Bytes reply(n);
    recv_all(fd_, reply.data(), n);
    return reply;
  } catch (...) {
    // Half a request or half a reply may be in flight: the next one would read it as its
    // own. The connection is done.
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

namespace {
template <class... Args>
Bytes op_message(Op op, const Args&... args) {
  Bytes m{uint8_t(op)};
  (put_blob(m, args), ...);
  return m;
}

// Asks `ready` again, backing off from 0.2 to 10 ms, until it says yes or `timeout` (none
// when kNoTimeout) has passed: how get and wait block without holding the server.
template <class Ready>
void poll_until(std::chrono::milliseconds timeout, const std::string& waiting_for, Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (!ready()) {
    if (timeout != c10d::Store::kNoTimeout && std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(fmt::format("store: timed out after {} ms waiting for {}",
                                           timeout.count(), waiting_for));
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(10));
  }
}
}  // namespace

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  request(op_message(kSet, key, value));
}

std::vector<uint8_t> TcpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  return request(op_message(kCompareSet, key, expected, desired));
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  Bytes value;
  poll_until(timeout_, fmt::format("key '{}'", key), [&] {
    auto reply = request(op_message(kTryGet, key));
    if (reply.empty() || !reply[0]) return false;
    value.assign(reply.begin() + 1, reply.end());
    return true;
  });
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t value) {
  const auto reply = request(op_message(kAdd, key, i64_bytes(value)));
  if (reply.size() != 8) throw std::runtime_error("store: malformed reply to add");
  return i64_of(reply.data());
}

std::vector<std::optional<Bytes>> TcpStore::values_now(const std::vector<std::string>& keys) {
  std::vector<std::optional<Bytes>> values;
  values.reserve(keys.size());
  while (values.size() < keys.size()) {
    // The keys not answered yet, as many as kManyBytes holds; the answer covers the first
    // of them, as many as its own kManyBytes holds (at least one).
    Bytes m{uint8_t(kTryGetMany)};
    size_t asked = 0;
    for (size_t i = values.size(); i < keys.size(); ++i, ++asked) {
      if (asked > 0 && m.size() + 4 + keys[i].size() > kManyBytes) break;
      put_blob(m, keys[i]);
    }
    const auto reply = request(m);
    const size_t before = values.size();
    for (size_t at = 0; at < reply.size();) {
      const bool held = reply[at++];
      if (held && (reply.size() - at < 4 || reply.size() - at - 4 < u32_of(reply.data() + at)))
        throw std::runtime_error("store: malformed reply to values_now");
      if (!held) {
        values.emplace_back();
        continue;
      }
      const uint32_t len = u32_of(reply.data() + at);
      values.emplace_back(Bytes(reply.begin() + long(at + 4), reply.begin() + long(at + 4 + len)));
      at += 4 + len;
    }
    if (values.size() == before || values.size() - before > asked)
      throw std::runtime_error("store: malformed reply to values_now");
  }
  return values;
}

void TcpStore::on_close(const std::string& key, const std::vector<uint8_t>& value) {
  request(op_message(kOnClose, key, value));
}

bool TcpStore::deleteKey(const std::string& key) {
  const auto reply = request(op_message(kDelete, key));
  return !reply.empty() && reply[0];
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Bytes m{uint8_t(kCheck)};
  for (const auto& k : keys) put_blob(m, k);
  const auto reply = request(m);
  return !reply.empty() && reply[0];
}

int64_t TcpStore::getNumKeys() {
  const auto reply = request(op_message(kNumKeys));
  if (reply.size() != 8) throw std::runtime_error("store: malformed reply to getNumKeys");
  return i64_of(reply.data());
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  poll_until(timeout, fmt::format("{} key(s)", keys.size()), [&] { return check(keys); });
}

std::vector<std::optional<Bytes>> values_now(c10d::Store& store, const std::vector<std::string>& keys) {
  if (auto* ours = dynamic_cast<TcpStore*>(&store)) return ours->values_now(keys);
  // check() then get() would wait (up to the store's timeout) for a key deleted in
  // between. A compareSet whose expected value no key holds changes nothing and answers
  // with the value, or with that expected value when there is no key.
  static const Bytes none{0xff, 'n', 'o', 'n', 'e'};  // never a value dtrain sets
  std::vector<std::optional<Bytes>> values;
  for (const auto& k : keys) {
    auto v = store.compareSet(k, none, none);
    values.push_back(v == none ? std::nullopt : std::optional<Bytes>(std::move(v)));
  }
  return values;
}

}  // namespace dtrain
