// doctest's main, with SIGPIPE ignored as dtrain's own main ignores it (apps/dtrain/cli.cpp):
// a test that drops a peer's group mid-collective (a replica's failure) has Gloo write to a
// closed socket, which the code under test must see as an error, not as the end of the
// process. Without it the suite died of SIGPIPE now and then under a loaded ctest -j2.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <csignal>

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  return doctest::Context(argc, argv).run();
}
