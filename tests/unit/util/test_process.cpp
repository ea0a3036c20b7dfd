// A child program run within a time limit: its exit code, its output in the log, and a
// child that outlives its time killed rather than waited for.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "temp_dir.hpp"
#include "util/process.hpp"

namespace unit_util_process {

using namespace dtrain;
using std::chrono::seconds;

TEST_CASE("process: a child's exit code and output; one that does not start or finish in time") {
  test::TempDir dir("dtrain-process");
  const std::string log = dir / "child.log";
  auto ok = run_child({"sh", "-c", "echo out; echo err >&2"}, seconds(30), log);
  CHECK(ok.ok());
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == "out\nerr\n");

  auto three = run_child({"sh", "-c", "exit 3"}, seconds(30));
  CHECK_FALSE(three.ok());
  CHECK(three.error.empty());
  CHECK(three.code == 3);

  auto missing = run_child({"dtrain-no-such-program"}, seconds(30));
  CHECK_FALSE(missing.ok());
  CHECK(missing.error.find("cannot run dtrain-no-such-program") != std::string::npos);

  const auto start = std::chrono::steady_clock::now();
  auto slow = run_child({"sleep", "30"}, seconds(1));
  CHECK(std::chrono::steady_clock::now() - start < seconds(10));
  CHECK(slow.error == "sleep did not finish within 1 s");
}

}  // namespace unit_util_process
