#include "run/signals.hpp"

#include <unistd.h>

#include <csignal>

namespace dtrain {

namespace {
volatile std::sig_atomic_t g_signal = 0;
volatile std::sig_atomic_t g_setting_up = 0;

// Remembers the signal; during setup, where there is nothing to checkpoint and setup may
// take long (reading data, building a large model), exits at once instead.
extern "C" void remember(int sig) {
  g_signal = sig;
  if (g_setting_up) {
    const char msg[] = "dtrain: stopped by a signal during setup; nothing to checkpoint\n";
    ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    ::_exit(exit_code_for_signal(sig));
  }
}
}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = remember;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) sigaction(sig, &sa, nullptr);
}

void set_setting_up(bool on) {
  g_setting_up = on ? 1 : 0;
  if (on && g_signal) remember(g_signal);  // one that came before: act on it now
}

int stop_signal() { return g_signal; }

int exit_code_for_signal(int sig) { return sig == SIGINT ? 130 : 143; }

}  // namespace dtrain
