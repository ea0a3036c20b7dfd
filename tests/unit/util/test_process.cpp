// A child program run within a time limit: its exit code, its output in the log, and a
// child that outlives its time killed rather than waited for.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "temp_dir.hpp"
#include "util/error.hpp"
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

// A forked child ending in exec_or_die(path, args), its stderr into `err`: its exit code.
int exec_in_child(const std::string& path, std::vector<std::string> args, const std::string& err) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDERR_FILENO);
    exec_or_die(path, args);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_CASE("process: a forked child's exec, and the line it says where that fails") {
  test::TempDir dir("dtrain-process");
  const std::string err = dir / "stderr";
  std::vector<std::string> args{"sh", "-c", "exit 7"};
  const auto argv = argv_of(args);
  REQUIRE(argv.size() == 4);
  CHECK(std::string(argv[2]) == "exit 7");
  CHECK(argv[3] == nullptr);
  CHECK(exec_in_child("/bin/sh", args, err) == 7);
  CHECK(exec_in_child("/no/such/dtrain", {"dtrain", "run"}, err) == kExitFailure);
  CHECK(test::read_bytes(err) == "dtrain: error: cannot start /no/such/dtrain: No such file or directory\n");
}

TEST_CASE("process: its age since it began, read from /proc") {
  const double age = process_age_s();
  CHECK(age >= 0);
  CHECK(process_age_s() >= age);  // the clock the launcher restarts it by only goes on
}

}  // namespace unit_util_process
