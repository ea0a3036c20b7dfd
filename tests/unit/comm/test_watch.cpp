// Hangs named while they happen (comm/watch.hpp): the line a waiting rank writes, from its
// group's heartbeats, and the watch itself over ranks as threads.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

#include <torch/torch.h>

#include "comm/watch.hpp"
#include "util/process.hpp"
#include "ranks.hpp"

namespace unit_comm_watch {
using namespace dtrain;
using json = nlohmann::json;

std::shared_ptr<const std::vector<int64_t>> ranks(std::vector<int64_t> r) {
  return std::make_shared<const std::vector<int64_t>>(std::move(r));
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_SUITE("watch") {
  TEST_CASE("watch: the line names the members that have not posted the collective, silent or not") {
    const double now = 1000;
    WaitedOp wait{"all_reduce", "data", ranks({0, 1, 2, 3}), 41, 3 * 1024 * 1024, -1};
    std::map<int64_t, json> beats{
        {1, {{"at", now - 0.5}, {"step", 12}, {"posted", {{"data", 41}}}, {"waits", json::array()}}},
        {2, {{"at", now - 0.2}, {"step", 11}, {"posted", {{"data", 38}}}, {"waits", json::array()}}},
        {3, {{"at", now - 31}, {"step", 12}, {"posted", {{"data", 40}}},
             {"waits", json::array({json{{"op", "recv"}, {"peer", 2}, {"since", now - 40}}})}}}};
    const auto line = describe_hang(0, wait, 30, beats, now, 2.5, false);
    CAPTURE(line);
    CHECK(has(line, "rank 0: all_reduce #41 of the data group (3.0 MiB) has waited 30 s"));
    CHECK(has(line, "not posted by 2 of 3"));
    CHECK(has(line, "rank 2: at step 11, in no collective"));
    CHECK(has(line, "rank 3: silent for 31 s (last at step 12, in recv with rank 2 for 9 s)"));
    CHECK(!has(line, "rank 1:"));  // it has posted #41

    beats.erase(2);
    CHECK(has(describe_hang(0, wait, 30, beats, now, 2.5, false), "rank 2: no heartbeat"));
    beats[2] = beats[1];
    beats[3]["posted"]["data"] = 41;  // posted, then stopped inside it
    CHECK(has(describe_hang(0, wait, 30, beats, now, 2.5, false), "; posted, then silent: rank 3: silent for 31 s"));
    beats[3] = beats[1];
    CHECK(has(describe_hang(0, wait, 30, beats, now, 2.5, false), "every member has posted it and is alive"));
    CHECK(has(describe_hang(0, wait, 30, {}, now, 2.5, true), "the store does not answer"));
    const WaitedOp transfer{"recv", "pipeline", ranks({0, 1}), 0, 1024, 1};
    CHECK(has(describe_hang(0, WaitedOp{"barrier", "world", ranks({0, 1}), 3, 4, -1}, 30, beats, now, 2.5, false),
              "barrier #3 of the world group (4 B) has waited 30 s"));
    CHECK(has(describe_hang(0, transfer, 30, beats, now, 2.5, false), "recv with rank 1 (1.0 KiB) has waited 30 s; rank 1: at step 12"));
  }

  TEST_CASE("watch: the job's picture has a line per rank") {
    const json wait = {{"op", "all_reduce"}, {"group", "world"}, {"number", 7}, {"peer", -1}, {"since", 90}};
    std::map<int64_t, json> beats;
    beats[0] = {{"at", 99.5}, {"step", 3}, {"posted", json::object()}, {"waits", json::array({wait})}};
    const auto picture = job_picture(beats, 2, 100, 2.5);
    CAPTURE(picture);
    CHECK(has(picture, "rank 0: at step 3, in all_reduce #7 of the world group for 10 s"));
    CHECK(has(picture, "rank 1: no heartbeat"));
  }

  TEST_CASE("watch: ranks waiting past the threshold name the rank that has not arrived, once") {
    std::mutex mu;
    std::vector<std::string> lines;
    auto opts = test::quick();
    opts.hang_after = std::chrono::milliseconds(600);  // heartbeats every 200 ms
    opts.say_hang = [&](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(line);
    };
    test::run_ranks_as_threads(3, [&](std::shared_ptr<Comm> comm) {
      comm->note_step(7);
      // Rank 2 is late (alive, its heartbeat going) past the threshold and a beat or two.
      if (comm->rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      auto t = torch::ones({4});
      comm->all_reduce(t);
      CHECK(t[0].item<float>() == 3);
    }, opts);
    REQUIRE(lines.size() == 2);  // ranks 0 and 1, once each
    for (const auto& line : lines) {
      CAPTURE(line);
      CHECK(has(line, "all_reduce #1 of the world group"));
      CHECK(has(line, "not posted by 1 of 2: rank 2: at step 7, in no collective"));
    }
  }

  TEST_CASE("watch: a rank that left word is ended as its connection closes; its process is known till then") {
    TcpStore::Options o;
    o.host = "127.0.0.1", o.server = true, o.timeout = std::chrono::seconds(10);
    auto server = c10::make_intrusive<TcpStore>(o);
    o.server = false, o.port = server->port();
    auto rank = std::make_unique<TcpStore>(o);
    leave_word(*rank, 3);
    const auto process = its_process(*server, 3);
    REQUIRE(process);
    CHECK(process->second == ::getpid());
    CHECK_FALSE(its_process(*server, 4));
    CHECK_FALSE(has_ended(*server, 3));
    Liveness live(server, std::chrono::seconds(30));
    CHECK(live.dead_among({3}).empty());  // no heartbeat yet: not judged for 30 s
    rank.reset();  // the process ends
    for (int i = 0; i < 200 && !has_ended(*server, 3); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    CHECK(has_ended(*server, 3));
    CHECK(live.dead_among({3}) == std::vector<int64_t>{3});  // dead at once, not after 30 s
    clear_ended(*server, 3);  // restarted: it runs again
    CHECK_FALSE(has_ended(*server, 3));
  }

  TEST_CASE("watch: every rank's word is read at once, and who has gone judged from it") {
    TcpStore::Options o;
    o.host = "127.0.0.1", o.server = true, o.timeout = std::chrono::seconds(10);
    auto server = c10::make_intrusive<TcpStore>(o);
    o.server = false, o.port = server->port();
    auto one = std::make_unique<TcpStore>(o), two = std::make_unique<TcpStore>(o);
    leave_word(*one, 1);
    leave_word(*two, 2);
    two.reset();  // rank 2's process ends
    for (int i = 0; i < 200 && !has_ended(*server, 2); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const std::string beat = R"({"at":1,"step":4})";
    server->set("dtrain/heartbeat/1", std::vector<uint8_t>(beat.begin(), beat.end()));

    const auto words = read_words(*server, {0, 1, 2});
    REQUIRE(words.size() == 3);
    CHECK_FALSE(words[0].process);  // never came
    CHECK_FALSE(words[0].ended);
    CHECK(words[0].beat.empty());
    REQUIRE(words[1].process);
    CHECK(words[1].process->second == ::getpid());
    CHECK(words[1].process->first == host_name());
    CHECK_FALSE(words[1].ended);
    CHECK(words[1].beat == std::vector<uint8_t>(beat.begin(), beat.end()));
    REQUIRE(words[2].process);  // its word stays; it is marked ended, its heartbeat gone
    CHECK(words[2].ended);
    CHECK(words[2].beat.empty());

    // The peers' view: an ended rank is dead at once, the others alive for `silent`.
    Liveness peers(server, std::chrono::seconds(30));
    CHECK(peers.dead_among({0, 1, 2}) == std::vector<int64_t>{2});

    // The launcher's view (none_alive): judged once it beats; rank 1's beat goes stale.
    Liveness launcher(server, std::chrono::milliseconds(200), /*none_alive=*/true);
    CHECK(launcher.dead_among({0, 1, 2}).empty());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK(launcher.dead_among({0, 1, 2}) == std::vector<int64_t>{1});
    const std::string next = R"({"at":2,"step":5})";  // it beats again
    server->set("dtrain/heartbeat/1", std::vector<uint8_t>(next.begin(), next.end()));
    CHECK(launcher.dead_among({0, 1, 2}).empty());
  }
}

}  // namespace unit_comm_watch
