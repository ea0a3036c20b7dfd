// SIGTERM / SIGUSR1 (SLURM preemption) and SIGINT: remembered, then acted on between steps
// so the trainer can write a checkpoint before it exits.
#pragma once

namespace dtrain {

void install_stop_signals();
// While on (setup: nothing to checkpoint yet), a stop signal ends the process at once with
// its exit code, instead of waiting for a step boundary.
void set_setting_up(bool on);
// The signal that asked us to stop, or 0.
int stop_signal();
// The exit code for a stop: 130 for SIGINT, 143 for SIGTERM and SIGUSR1.
int exit_code_for_signal(int sig);

}  // namespace dtrain
