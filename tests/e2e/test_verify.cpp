// `dtrain verify` as a user runs it. Its reference is checked against a plain `dtrain run`
// of the same job (not verify's own numbers), its verdicts against layouts known to agree
// (sync data, tensor, pipeline, ZeRO) and one known not to (local SGD apart between
// averages), and against a saved reference altered by hand.
#include <doctest/doctest.h>

#include <fstream>

#include "run.hpp"

namespace e2e::verify_tests {

namespace {

Job verify_job() {
  Job j;
  j.name = "verify-check";
  j.model = "{arch: mlp, hidden: [32, 16], dropout: 0.1}";
  j.train = "";
  j.max_steps = 50;  // verify sets its own
  j.log_every = 10;
  return j;
}

// The table line of `layout` in verify's output, split at blanks.
std::vector<std::string> row(const std::string& out, const std::string& layout) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; words >> x;) w.push_back(x);
    if (!w.empty() && w[0] == layout) return w;
  }
  return {};
}

}  // namespace

TEST_SUITE("verify") {
  TEST_CASE("verify: sync layouts agree with one process; the reference is a plain run's losses") {
    auto dir = temp_dir("verify");
    const auto job = verify_job().write(dir);
    auto r = dtrain("verify " + job + " --layouts d2,t2,p2,d2xz1 --steps 6 --save " + dir + "/ref.json");
    INFO(r.out << r.err);
    REQUIRE(r.code == 0);
    CHECK(r.out.find("ok: every layout within 0.0001 of one process") != std::string::npos);
    for (const char* l : {"d2", "t2", "p2", "d2xz1"}) {
      const auto w = row(r.out, l);
      REQUIRE(w.size() == 7);
      CHECK(w[1] == "2");
      CHECK(w[2] == "6");
      CHECK(std::stod(w[3]) <= 1e-4);
      CHECK(w[4] == "-");
    }
    // The saved losses are those of `dtrain run` on one process for 6 steps.
    run_ok("run " + job + " --run-dir " + dir + "/plain --set train.max_steps=6 --set train.log_every=1"
           " --set train.eval_every=6 --set checkpoint.every_steps=6 --set train.eval_samples=512");
    const auto plain = train_losses(dir + "/plain");
    const auto saved = nlohmann::json::parse(slurp(dir + "/ref.json"));
    REQUIRE(saved["losses"].size() == 6);
    for (int64_t s = 1; s <= 6; ++s) CHECK(saved["losses"][size_t(s - 1)].get<double>() == plain.at(s));
    CHECK(saved["steps"] == 6);
    CHECK(saved["job"].get<std::string>().find("model.hidden: [32, 16]") != std::string::npos);

    // Against the saved file: no one-process run, the same verdict.
    auto again = dtrain("verify " + job + " --layouts d2xt2 --against " + dir + "/ref.json");
    INFO(again.out << again.err);
    CHECK(again.code == 0);
    CHECK(row(again.out, "d2xt2").size() == 7);
    CHECK(row(again.out, "d2xt2")[1] == "4");

    // A saved loss altered from step 4 on: exit 1, naming step 4.
    auto altered = saved;
    for (size_t i = 3; i < 6; ++i) altered["losses"][i] = altered["losses"][i].get<double>() * 1.001;
    std::ofstream(dir + "/altered.json") << altered.dump();
    auto off = dtrain("verify " + job + " --against " + dir + "/altered.json");
    INFO(off.out << off.err);
    CHECK(off.code == 1);
    const auto w = row(off.out, "one");  // "one process"
    REQUIRE(w.size() == 8);
    CHECK(w[5] == "4");
    CHECK(off.out.find("differ: 1 of 1 layout(s)") != std::string::npos);

    // Another job than the file's is named, with the key where it differs.
    auto other = dtrain("verify " + job + " --set optimizer.lr=0.2 --against " + dir + "/ref.json");
    CHECK(other.code == 2);
    CHECK(other.err.find("optimizer.lr (here 0.2, there 0.05)") != std::string::npos);
    // Another seed is the same job drawn again: compared, said, and apart (exit 1).
    auto reseeded = dtrain("verify " + job + " --set seed=7 --against " + dir + "/ref.json");
    INFO(reseeded.out << reseeded.err);
    CHECK(reseeded.code == 1);
    CHECK(reseeded.err.find("seed (here 7, there") != std::string::npos);
    CHECK(reseeded.out.find("differ: 1 of 1 layout(s)") != std::string::npos);
    auto steps = dtrain("verify " + job + " --steps 5 --against " + dir + "/ref.json");
    CHECK(steps.code == 2);
    CHECK(steps.err.find("--steps 5") != std::string::npos);
  }

  TEST_CASE("verify: local SGD apart between averages is not one process: exit 1 at step 1") {
    auto dir = temp_dir("verify-local");
    const auto job = verify_job().write(dir);
    auto r = dtrain("verify " + job + " --layouts d2 --steps 4 --set parallel.mode=local_sgd"
                    " --set parallel.average_every=4");
    INFO(r.out << r.err);
    CHECK(r.code == 1);
    const auto w = row(r.out, "d2");
    REQUIRE(w.size() == 7);
    // Between averages a line holds data rank 0's replica's loss over its half of the batch
    // (docs/contract.md), so step 1 already differs; the evaluation at step 4, after the
    // average, differs less.
    CHECK(w[4] == "1");
    CHECK(std::stod(w[3]) > 1e-3);
  }

  TEST_CASE("verify: bad layouts, a layout the job cannot take, and bad options exit 2 naming them") {
    auto dir = temp_dir("verify-bad");
    const auto job = verify_job().write(dir);
    for (const auto& [layouts, says] : std::vector<std::pair<std::string, std::string>>{
             {"d2xq3", "'d2xq3' has 'q3'"}, {"d0", "'d0' has a size below 1"},
             {"z1", "'z1' shards with ZeRO over one data rank"}, {"d2,", "'' is empty"},
             {"d2xd2", "'d2xd2' names 'd' twice"}, {"d2xz4", "ZeRO stage above 3"},
             {"d02", "'d02' has 'd02'"}, {"xd2", "'xd2' has an empty part"},
             {"d2x", "'d2x' ends in x"}, {"d2048", "more than 1024 processes"}}) {
      auto r = dtrain("verify " + job + " --layouts " + layouts);
      INFO(layouts << ": " << r.err);
      CHECK(r.code == 2);
      CHECK(r.err.find(says) != std::string::npos);
    }
    // hidden [32, 16] does not split over 3 tensor ranks: named before anything runs.
    auto t3 = dtrain("verify " + job + " --steps 2 --layouts d2,t3");
    INFO(t3.out << t3.err);
    CHECK(t3.code == 2);
    CHECK(t3.err.find("verify: layout t3: ") != std::string::npos);
    CHECK(t3.err.find("parallel.tensor") != std::string::npos);
    CHECK(t3.out.empty());
    // A run that fails on its own (here: its data unreadable) ends verify with the run's
    // code and words, and its folder is kept and named.
    auto unreadable = dtrain("verify " + job + " --steps 2 --layouts d2 --set data.dataset=fashion_mnist"
                             " --set data.path=" + dir + "/no-such-data");
    INFO(unreadable.err);
    CHECK(unreadable.code == 3);
    CHECK(unreadable.err.find("no-such-data") != std::string::npos);
    const auto kept = unreadable.err.find("verify: the runs are in ");
    REQUIRE(kept != std::string::npos);
    const auto folder = unreadable.err.substr(kept + 24, unreadable.err.find('\n', kept) - kept - 24);
    CHECK(std::filesystem::exists(folder + "/reference/stderr"));
    std::system(("rm -rf '" + folder + "'").c_str());  // (rm: see run.hpp's temp_dir)
    auto both = dtrain("verify " + job + " --layouts d2 --save a.json --against b.json");
    CHECK(both.code == 2);
    CHECK(both.err.find("one or the other") != std::string::npos);
    auto none = dtrain("verify " + job);
    CHECK(none.code == 2);
    CHECK(none.err.find("--layouts") != std::string::npos);
    auto missing = dtrain("verify " + job + " --against " + dir + "/nothing.json");
    CHECK(missing.code == 2);
    CHECK(missing.err.find("nothing.json") != std::string::npos);
    auto async = dtrain("verify " + job + " --layouts d2 --set parallel.mode=async_ps");
    CHECK(async.code == 2);
    CHECK(async.err.find("async_ps") != std::string::npos);
  }
}

}  // namespace e2e::verify_tests
