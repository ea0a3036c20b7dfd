// c10d behind the Comm interface. Everything version-sensitive is in this file.
// A job has one store; the world and each sub-group (a Mesh axis) is a process group of its
// own over that store, under the group's name as a key prefix.
#include "comm/comm.hpp"
#include "comm/job_link.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/tcp_store.hpp"
#include "comm/watch.hpp"
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cctype>
#include <iostream>
#include <map>
#include <cstdlib>
#include <mutex>
#include <optional>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>

#include "util/error.hpp"

namespace dtrain {
namespace {

// Threads inherit their creator's nice value. Gloo's threads (its TCP loop and workers)
// are created while this is alive at a higher priority than the compute threads, so that
// when data arrives they preempt compute at once instead of waiting out the scheduler's
// wake-up granularity (measured, 2 ranks on 2 cores: MLP the wait for the gradients p90
// 3.4 -> 1.5 ms, mean step 4.1 -> 3.65 ms; CNN 1.5 -> 1.64x PyTorch DDP).
// Only where every compute thread has a core (CommOptions::comm_first): beyond that a rank's
// main thread is preempted inside Gloo's send, holding its connection's lock, and the loop
// thread, woken again and again by the unread data (level-triggered epoll, try_lock), spins
// at the raised priority on the core the lock holder needs (4 ranks on 2 cores, GPT
// interleaved 1F1B: 500 -> 290 ms a step, 8-12 million failed try_locks a rank in 20 steps).
// Without the permission to raise priority (no CAP_SYS_NICE) nothing changes.
class CommThreadPriority {
 public:
  explicit CommThreadPriority(bool raise) {
    if (!raise) return;
    tid_ = static_cast<id_t>(::syscall(SYS_gettid));
    errno = 0;
    old_ = ::getpriority(PRIO_PROCESS, tid_);
    raised_ = errno == 0 && ::setpriority(PRIO_PROCESS, tid_, old_ - 10) == 0;
  }
  ~CommThreadPriority() {
    if (raised_) ::setpriority(PRIO_PROCESS, tid_, old_);
  }

 private:
  id_t tid_ = 0;
  int old_ = 0;
  bool raised_ = false;
};

class DonePending : public Pending {
 public:
  void wait() override {}
};

class LocalComm : public Comm, public std::enable_shared_from_this<LocalComm> {
 public:
  int64_t rank() const override { return 0; }
  int64_t size() const override { return 1; }
  std::unique_ptr<Pending> all_reduce_async(torch::Tensor, ReduceOp) override { return done(); }
  std::unique_ptr<Pending> reduce_async(torch::Tensor, int64_t) override { return done(); }
  std::unique_ptr<Pending> broadcast_async(torch::Tensor, int64_t) override { return done(); }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override { return {t.clone()}; }
  std::unique_ptr<Pending> all_gather_async(torch::Tensor out, const torch::Tensor& in) override {
    out.view(-1).copy_(in.reshape(-1));
    return done();
  }
  bool can_sum(torch::ScalarType) const override { return true; }
  void barrier() override {}
  std::unique_ptr<Pending> exchange_async(std::vector<P2POp> ops) override {
    if (!ops.empty()) throw std::logic_error("send/recv in a group of one process");
    return done();
  }
  std::shared_ptr<Comm> new_group(const std::string&, const std::vector<int64_t>& members) override {
    if (members != std::vector<int64_t>{0})
      throw std::logic_error("a group of other ranks in a world of one process");
    return shared_from_this();
  }

 private:
  static std::unique_ptr<Pending> done() { return std::make_unique<DonePending>(); }
};

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return first_line(err.what_without_backtrace());
  } catch (const std::exception& err) {
    return first_line(err.what());
  } catch (...) {
    return "unknown failure";
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  // Gloo has no AVG: kAvg is a sum divided afterwards (see WorkPending), on every backend.
  return op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
}

// Where a group's process groups come from: the job's store and options. Shared by a world
// and every sub-group made from it.
struct GroupContext {
  c10::intrusive_ptr<c10d::Store> store;
  CommOptions opts;
  int64_t world_rank;
  bool loopback;  // every rank on this machine
  std::shared_ptr<Watch> watch;  // none without dist.hang_report_s
};

// The group of world ranks `members` (this rank at `rank` among them), under `name`.
std::shared_ptr<Comm> make_group(const std::shared_ptr<GroupContext>& ctx, const std::string& name,
                                 int64_t rank, std::vector<int64_t> members);

// The watch over a rank's waits (dist.hang_report_s) through `store`: a connection of its
// own, whose short timeout lets it say that the store's host is silent.
std::shared_ptr<Watch> make_watch(c10::intrusive_ptr<c10d::Store> store, int64_t rank,
                                  const CommOptions& opts) {
  if (opts.hang_after.count() <= 0 || !store) return nullptr;
  auto say = opts.say_hang ? opts.say_hang : [](const std::string& line) { std::cerr << line << std::endl; };
  return std::make_shared<Watch>(std::move(store), rank, opts.hang_after, std::move(say));
}

// Holds a Gloo or NCCL process group (c10d's ProcessGroupGloo/NCCL, each a Backend).
template <class PG>
class C10dComm : public Comm, public std::enable_shared_from_this<C10dComm<PG>> {
 public:
  C10dComm(c10::intrusive_ptr<PG> pg, std::shared_ptr<GroupContext> ctx, std::string name,
           int64_t rank, std::vector<int64_t> members)
      : pg_(std::move(pg)), ctx_(std::move(ctx)), name_(std::move(name)), rank_(rank),
        size_(int64_t(members.size())),
        members_(std::make_shared<const std::vector<int64_t>>(std::move(members))) {
    if (ctx_->opts.backend == "nccl") stage_ = ctx_->opts.device;
  }

  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  void note_step(int64_t n) override {
    if (ctx_->watch) ctx_->watch->step(n);
  }
  static int64_t bytes(const torch::Tensor& t) { return t.numel() * int64_t(t.element_size()); }

  std::unique_ptr<Pending> all_reduce_async(torch::Tensor t, ReduceOp op) override {
    const Staged st = summed(t);
    std::vector<torch::Tensor> ts{st.dev};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    const double divide = op == ReduceOp::kAvg ? double(size_) : 1.0;
    count_sent(2 * bytes(t) * (size_ - 1) / size_);
    return guard("all_reduce", [&] {
      return pending("all_reduce", pg_->allreduce(ts, o), ts, divide, st.back);
    });
  }
  std::unique_ptr<Pending> reduce_async(torch::Tensor t, int64_t root) override {
    const Staged st = summed(t);
    std::vector<torch::Tensor> ts{st.dev};
    c10d::ReduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.rootRank = root;
    count_sent(bytes(t) * (size_ - 1) / size_ + (rank_ != root ? bytes(t) / size_ : 0));
    return guard("reduce", [&] { return pending("reduce", pg_->reduce(ts, o), ts, 1.0, st.back); });
  }
  std::unique_ptr<Pending> broadcast_async(torch::Tensor t, int64_t root) override {
    // A broadcast moves bits, so bf16 goes as fp16, its values untouched, whether or not
    // this Gloo knows bf16.
    if (t.scalar_type() == torch::kBFloat16) t = t.view(torch::kHalf);
    const Staged st = staged(t);
    std::vector<torch::Tensor> ts{st.dev};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    count_sent(bytes(t) * (size_ - 1) / size_);
    return guard("broadcast", [&] {
      return pending("broadcast", pg_->broadcast(ts, o), ts, 1.0, st.back);
    });
  }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override {
    const Staged st = staged(t);
    std::vector<std::vector<torch::Tensor>> out(1);
    for (int64_t i = 0; i < size_; ++i) out[0].push_back(torch::empty_like(st.dev));
    std::vector<torch::Tensor> in{st.dev};
    count_sent(bytes(t) * (size_ - 1));
    guard("all_gather", [&] { return pending("all_gather", pg_->allgather(out, in), in); })->wait();
    if (st.back.defined())
      for (auto& part : out[0]) part = part.to(t.device());
    return out[0];
  }
  bool can_sum(torch::ScalarType type) const override {
    return ctx_->opts.backend == "nccl" || type == torch::kFloat32 || type == torch::kFloat64;
  }
  // Gloo's collectives only: a timed wait on its send or recv fails the transfer (its
  // buffer's wait closes the pairs), and NCCL's aborts the communicator.
  bool can_give_up() const override { return ctx_->opts.backend == "gloo"; }
  std::unique_ptr<Pending> all_gather_async(torch::Tensor out, const torch::Tensor& in) override {
    auto flat_in = staged(in).dev.reshape(-1).contiguous();
    const int64_t n = flat_in.numel();
    TORCH_CHECK(out.numel() == n * size_, "all_gather: output holds ", out.numel(),
                " elements, expected ", n * size_);
    const Staged st = staged(out);
    // The outputs are views of `out`: the backend writes each rank's part in place.
    std::vector<std::vector<torch::Tensor>> outs(1);
    auto flat_out = st.dev.view(-1);
    for (int64_t r = 0; r < size_; ++r) outs[0].push_back(flat_out.narrow(0, r * n, n));
    std::vector<torch::Tensor> ins{flat_in};
    count_sent(bytes(flat_in) * (size_ - 1));
    return guard("all_gather", [&] {
      // The input too must outlive the operation.
      return pending("all_gather", pg_->allgather(outs, ins), {flat_out, flat_in}, 1.0,
                     st.back.defined() ? st.back.view(-1) : st.back);
    });
  }
  void barrier() override {
    // A barrier is an all-reduce of one number: the same timeout path as everything else.
    std::vector<torch::Tensor> ts{staged(torch::zeros({1})).dev};
    guard("barrier", [&] { return pending("barrier", pg_->allreduce(ts), ts); })->wait();
  }
  std::unique_ptr<Pending> exchange_async(std::vector<P2POp> ops) override {
    return guard("send/recv", [&] {
      auto all = std::make_unique<PendingAll>();
      for (auto& op : ops) {
        const bool send = op.kind == P2POp::kSend;
        const Staged st = p2p_staged(op.tensor, send);
        std::vector<torch::Tensor> ts{st.dev};
        if (send) count_sent(bytes(op.tensor));
        auto work = send ? pg_->send(ts, int(op.peer), op.tag) : pg_->recv(ts, int(op.peer), op.tag);
        all->parts.push_back(pending(send ? "send" : "recv", work, ts, 1.0,
                                     send ? torch::Tensor() : st.back, op.peer));
      }
      return std::unique_ptr<Pending>(std::move(all));
    });
  }
  std::shared_ptr<Comm> new_group(const std::string& name,
                                  const std::vector<int64_t>& members) override {
    auto me = std::find(members.begin(), members.end(), ctx_->world_rank);
    if (me == members.end())
      throw std::logic_error(fmt::format("rank {} is not a member of group '{}'",
                                         ctx_->world_rank, name));
    if (members.size() == 1) return make_local_comm();
    return make_group(ctx_, name, me - members.begin(), members);
  }

 private:
  // Holds what it reports with, not the group: a fault-tolerant job drops a failed group
  // (comm/replica_comm.hpp) while the step's other operations on it are still to be waited.
  class WorkPending : public Pending {
   public:
    WorkPending(const C10dComm& comm, const char* op, c10::intrusive_ptr<c10d::Work> work,
                std::vector<torch::Tensor> keep, double divide, torch::Tensor back, WaitedOp what,
                bool sliced)
        : ctx_(comm.ctx_), name_(comm.name_), op_(op), work_(std::move(work)), keep_(std::move(keep)),
          divide_(divide), back_(std::move(back)), what_(std::move(what)), sliced_(sliced) {}
    void wait() override {
      if (finished_) return;
      watch();
      bool done = false;
      try {
        done = work_->wait(std::chrono::duration_cast<std::chrono::milliseconds>(ctx_->opts.timeout));
      } catch (...) {
        watched_.reset();
        throw failure_in(*ctx_, name_, op_, describe(std::current_exception()));
      }
      watched_.reset();
      if (!done) throw failure_in(*ctx_, name_, op_, "did not complete");
      finish();
    }
    // A timed wait of c10d's throws when the time is up, as when the operation fails; only
    // the work says which (and it may have ended since: wait() then finishes it or throws
    // its own error). The backend's own timeout, dist.timeout_s, still ends it.
    bool wait_for(std::chrono::milliseconds slice) override {
      if (finished_) return true;
      if (!sliced_) {
        wait();
        return true;
      }
      watch();
      try {
        if (!work_->wait(slice)) return false;
      } catch (...) {
        if (!work_->isCompleted()) return false;
        wait();
        return true;
      }
      watched_.reset();
      finish();
      return true;
    }

   private:
    // Named to the watch from the first wait until the result is in, across timed waits.
    void watch() {
      if (!watched_) watched_.emplace(ctx_->watch.get(), what_);
    }
    void finish() {
      if (divide_ != 1.0)
        for (auto& t : keep_) t.div_(divide_);
      if (back_.defined()) back_.copy_(keep_[0]);  // a staged CPU tensor gets the result
      finished_ = true;
    }

    std::shared_ptr<GroupContext> ctx_;
    std::string name_;
    const char* op_;
    c10::intrusive_ptr<c10d::Work> work_;
    std::vector<torch::Tensor> keep_;  // the buffers must outlive the operation
    double divide_;
    torch::Tensor back_;
    WaitedOp what_;  // for the watch
    const bool sliced_;  // whether a timed wait leaves the operation be (see pending())
    std::optional<Watch::Waiting> watched_;
    bool finished_ = false;
  };

  // An operation just posted; `peer`: a transfer's group rank (-1: a collective, which
  // takes the next number of the group's posted count).
  std::unique_ptr<Pending> pending(const char* op, c10::intrusive_ptr<c10d::Work> w,
                                   std::vector<torch::Tensor> keep, double divide = 1.0,
                                   torch::Tensor back = {}, int64_t peer = -1) const {
    WaitedOp what;
    if (auto* watch = ctx_->watch.get()) {
      what = {op, name_, members_, peer < 0 ? watch->post(name_) : 0,
              keep.empty() ? 0 : bytes(keep[0]), peer < 0 ? -1 : members_->at(size_t(peer))};
    }
    return std::make_unique<WorkPending>(*this, op, std::move(w), std::move(keep), divide,
                                         std::move(back), std::move(what),
                                         peer < 0 && can_give_up());
  }

  // The tensor the backend operates on, and the one its result is copied back to: for
  // NCCL, a CPU tensor's copy on this rank's GPU, and the CPU tensor itself.
  struct Staged {
    torch::Tensor dev;   // what the backend gets
    torch::Tensor back;  // undefined: `dev` is the caller's tensor itself
  };
  Staged staged(const torch::Tensor& t) const {
    if (!stage_ || t.device() == *stage_) return {t, torch::Tensor()};
    return {t.to(*stage_), t};
  }

  // A sum's tensor: as staged(), and floating-point values can_sum() refuses (Gloo: bf16,
  // which it cannot sum, and fp16, which it sums slowly; a tensor-parallel layer's output
  // under autocast) summed in fp32, the result rounded once as it is copied back. (The
  // bytes counted stay the caller's.)
  Staged summed(const torch::Tensor& t) const {
    Staged st = staged(t);
    if (can_sum(t.scalar_type()) || !torch::isFloatingType(t.scalar_type())) return st;
    return {st.dev.to(torch::kFloat), t};
  }

  // A point-to-point transfer's tensor: as staged(); and a CUDA tensor through host memory
  // for Gloo, whose send and recv hand the tensor's pointer to TCP as it is (its
  // collectives have CUDA paths of their own). What a recv stages into needs none of the
  // tensor's bytes (a join's gigabytes are not copied over first).
  Staged p2p_staged(const torch::Tensor& t, bool send) const {
    const auto to = stage_ ? *stage_ : c10::Device(torch::kCPU);
    if (t.device() == to || (!stage_ && !t.is_cuda())) return {t, torch::Tensor()};
    return {send ? t.to(to) : torch::empty(t.sizes(), t.options().device(to)), t};
  }

  template <class F>
  std::unique_ptr<Pending> guard(const char* op, F&& f) const {
    try {
      return f();
    } catch (const DistError&) {
      throw;
    } catch (...) {
      throw failure(op, describe(std::current_exception()));
    }
  }

  DistError failure(const char* op, const std::string& why) const {
    return failure_in(*ctx_, name_, op, why);
  }
  static DistError failure_in(const GroupContext& ctx, const std::string& name, const char* op,
                              const std::string& why) {
    const std::string group = name == "world" ? "" : fmt::format(" ({} group)", name);
    // Say which it was when the error says so: waiting out dist.timeout_s means a stalled
    // peer; a closed or reset connection means a peer that died.
    std::string lower;
    for (unsigned char ch : why) lower += char(std::tolower(ch));
    auto has = [&](const char* w) { return lower.find(w) != std::string::npos; };
    const std::string cause =
        has("timed out") || has("timeout")
            ? fmt::format("no answer within dist.timeout_s = {} s; a peer rank stalled",
                          ctx.opts.timeout.count())
        : has("closed") || has("reset") || has("broken pipe") || has("end of file") ||
                has("connection refused")
            ? std::string("a peer rank closed its connection; it may have died")
            : fmt::format("a peer rank may have died or stalled; timeout {} s",
                          ctx.opts.timeout.count());
    return DistError(fmt::format("rank {}: {}{} failed ({}): {}", ctx.world_rank, op, group,
                                 cause, why));
  }

  c10::intrusive_ptr<PG> pg_;
  std::shared_ptr<GroupContext> ctx_;
  std::optional<c10::Device> stage_;
  std::string name_;
  int64_t rank_, size_;
  std::shared_ptr<const std::vector<int64_t>> members_;  // the group's world ranks
};

// A process group over `size` ranks that rendezvous under `name` in the job's store.
std::shared_ptr<Comm> make_group(const std::shared_ptr<GroupContext>& ctx, const std::string& name,
                                 int64_t rank, std::vector<int64_t> members) {
  const int64_t size = int64_t(members.size());
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(ctx->opts.timeout);
  c10::intrusive_ptr<c10d::Store> store = ctx->store;
  if (name != "world") store = c10::make_intrusive<c10d::PrefixStore>(name + "/", ctx->store);
  CommThreadPriority priority(ctx->opts.comm_first);  // for the threads created below
  try {
    if (ctx->opts.backend == "nccl") {
#ifdef USE_C10D_NCCL
      // Blocking wait: a collective that outlives dist.timeout_s throws on this thread
      // (exit 4, the peer named) instead of NCCL's watchdog aborting the process. Once per
      // process, before any group reads it (ranks as threads create groups side by side).
      static std::once_flag env_once;
      std::call_once(env_once, [] { ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0); });
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, int(rank), int(size), o);
      return std::make_shared<C10dComm<c10d::ProcessGroupNCCL>>(pg, ctx, name, rank, std::move(members));
#else
      throw ConfigError("dist.backend: this LibTorch was built without NCCL");
#endif
    }
    auto o = c10d::ProcessGroupGloo::Options::create(timeout);
    o->threads = static_cast<int>(ctx->opts.gloo_threads);
    // One machine: talk over loopback. Several: this host's own interface (Gloo's default
    // resolves the hostname; GLOO_SOCKET_IFNAME picks an interface explicitly).
    o->devices.push_back(ctx->loopback
                             ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                             : c10d::ProcessGroupGloo::createDefaultDevice());
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, int(rank), int(size), o);
    return std::make_shared<C10dComm<c10d::ProcessGroupGloo>>(pg, ctx, name, rank, std::move(members));
  } catch (const Error&) {
    throw;
  } catch (...) {
    throw DistError(fmt::format("rank {}: creating the {} process group '{}' failed: {}",
                                ctx->world_rank, ctx->opts.backend, name,
                                describe(std::current_exception())));
  }
}

class ShapeComm : public Comm {
 public:
  ShapeComm(int64_t rank, int64_t size) : rank_(rank), size_(size) {}
  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  std::unique_ptr<Pending> all_reduce_async(torch::Tensor, ReduceOp) override { return none(); }
  std::unique_ptr<Pending> reduce_async(torch::Tensor, int64_t) override { return none(); }
  std::unique_ptr<Pending> broadcast_async(torch::Tensor, int64_t) override { return none(); }
  std::vector<torch::Tensor> all_gather(const torch::Tensor&) override { none(); return {}; }
  std::unique_ptr<Pending> all_gather_async(torch::Tensor, const torch::Tensor&) override {
    return none();
  }
  bool can_sum(torch::ScalarType) const override { return true; }
  void barrier() override { none(); }
  std::unique_ptr<Pending> exchange_async(std::vector<P2POp>) override { return none(); }
  std::shared_ptr<Comm> new_group(const std::string&, const std::vector<int64_t>&) override {
    none();
    return nullptr;
  }

 private:
  [[noreturn]] static std::unique_ptr<Pending> none() {
    throw std::logic_error("a shape-only group cannot communicate");
  }
  int64_t rank_, size_;
};

}  // namespace

std::shared_ptr<Comm> make_local_comm() { return std::make_shared<LocalComm>(); }

std::shared_ptr<Comm> make_shape_comm(int64_t rank, int64_t size) {
  return std::make_shared<ShapeComm>(rank, size);
}

namespace {

// The job's store (hosted by rank 0, dtrain's supervisor or torchrun's agent), and the
// watch's own connection to it (none without dist.hang_report_s), as a group context.
std::shared_ptr<GroupContext> connect_job(const WorldInfo& world, const CommOptions& opts) {
  c10::intrusive_ptr<c10d::Store> store, watch_store;
  // The watch's connection answers within a few seconds or not at all (its host is silent).
  const std::chrono::milliseconds watch_timeout(2000);
  try {
    const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(opts.timeout);
    if (world.agent_store) {
      // torchrun's store outlives the workers and holds the agent's own keys: each
      // rendezvous round's keys go under a prefix of their own. The restart count tells
      // failures apart, not membership changes (a node joining restarts the workers with
      // the same count), so the workers of one (restart, world size) also count themselves
      // in: each round adds exactly `world` arrivals, and every worker of a round computes
      // the same round number.
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(world.master_port);
      so.isServer = false;
      so.timeout = timeout;
      // The classic socket client, which every server answers: a distribution's LibTorch
      // (Debian 13's 2.6) has no libuv, and asking for it there fails.
      so.useLibUV = false;
      auto agent = c10::make_intrusive<c10d::TCPStore>(world.master_addr, so);
      const std::string slot = fmt::format("dtrain/attempt_{}/world_{}", world.restart_count,
                                           world.world);
      const int64_t arrival = agent->add(slot + "/arrivals", 1);  // from 1
      const std::string round = fmt::format("{}/round_{}", slot, (arrival - 1) / world.world);
      store = c10::make_intrusive<c10d::PrefixStore>(round, agent);
      if (opts.hang_after.count() > 0) {
        so.timeout = watch_timeout;
        watch_store = c10::make_intrusive<c10d::PrefixStore>(
            round, c10::make_intrusive<c10d::TCPStore>(world.master_addr, so));
      }
    } else {
      TcpStore::Options so;
      so.host = world.master_addr;
      so.port = static_cast<int>(world.master_port);
      so.server = world.rank == 0 && !world.store_hosted;
      so.listen_everywhere = opts.store_everywhere;
      so.other_machines = world.local_world < world.world;
      so.timeout = timeout;
      auto ours = c10::make_intrusive<TcpStore>(so);
      store = ours;
      if (opts.hang_after.count() > 0) {
        so.server = false, so.port = ours->port(), so.timeout = watch_timeout;
        watch_store = c10::make_intrusive<TcpStore>(so);
      }
    }
  } catch (...) {
    throw DistError(fmt::format("rank {}: rendezvous at {}:{} failed ({}): {}", world.rank,
                                world.master_addr, world.master_port,
                                world.agent_store ? "joining torchrun's store"
                                : world.rank == 0 ? "hosting the store" : "reaching rank 0",
                                describe(std::current_exception())));
  }
  const bool loopback =
      world.master_addr == "localhost" || world.master_addr.rfind("127.", 0) == 0;
  return std::make_shared<GroupContext>(GroupContext{
      store, opts, world.rank, loopback, make_watch(watch_store, world.rank, opts)});
}

}  // namespace

std::shared_ptr<Comm> make_c10d_comm(const WorldInfo& world, const CommOptions& opts) {
  return make_group(connect_job(world, opts), "world", world.rank, world_ranks(world.world));
}

JobLink link_job(const WorldInfo& world, const CommOptions& opts, std::chrono::milliseconds silent) {
  auto ctx = connect_job(world, opts);
  // Where the store is dtrain's own (the --nproc supervisor's, the lighthouse's), it marks
  // this rank ended as this process ends: a lighthouse did not start it and cannot wait for it.
  if (auto* ours = dynamic_cast<TcpStore*>(ctx->store.get())) leave_word(*ours, world.rank);
  JobLink link;
  link.store = ctx->store;
  const auto group = [](const std::shared_ptr<GroupContext>& in, const std::string& name,
                        const std::vector<int64_t>& members) {
    const auto me = std::find(members.begin(), members.end(), in->world_rank);
    if (me == members.end())
      throw std::logic_error(fmt::format("rank {} is not a member of group '{}'", in->world_rank, name));
    if (members.size() == 1) return make_local_comm();
    return make_group(in, name, me - members.begin(), members);
  };
  link.group = [ctx, group](const std::string& name, const std::vector<int64_t>& members) {
    return group(ctx, name, members);
  };
  link.world = [ctx, group](const std::string& scope, const std::vector<int64_t>& members) {
    auto scoped = std::make_shared<GroupContext>(*ctx);
    scoped->store = c10::make_intrusive<c10d::PrefixStore>(scope + "/", ctx->store);
    return group(scoped, "world", members);
  };
  link.dead = [liveness = std::make_shared<Liveness>(ctx->store, silent)](const std::vector<int64_t>& ranks) {
    return liveness->dead_among(ranks);
  };
  return link;
}

std::shared_ptr<Comm> make_in_process_comm(const std::string& rendezvous, int64_t rank,
                                           int64_t size, const CommOptions& opts) {
  static std::mutex mu;
  static std::map<std::string, c10::intrusive_ptr<c10d::Store>> stores;
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = stores[rendezvous];
    if (!slot) slot = c10::make_intrusive<c10d::HashStore>();
    store = slot;
  }
  // NCCL: a group even of one, so a test on one GPU runs NCCL's code path.
  if (size == 1 && opts.backend != "nccl") return make_local_comm();
  auto ctx = std::make_shared<GroupContext>(GroupContext{store, opts, rank, true, make_watch(store, rank, opts)});
  return make_group(ctx, "world", rank, world_ranks(size));
}

}  // namespace dtrain
