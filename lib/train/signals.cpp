#include "train/signals.hpp"

#include <csignal>

namespace dtrain {

namespace {
volatile std::sig_atomic_t g_signal = 0;
extern "C" void remember(int sig) { g_signal = sig; }
}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = remember;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) sigaction(sig, &sa, nullptr);
}

int stop_signal() { return g_signal; }

int exit_code_for_signal(int sig) { return sig == SIGINT ? 130 : 143; }

}  // namespace dtrain
