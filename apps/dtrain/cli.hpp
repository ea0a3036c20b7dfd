// The whole dtrain command: main's, a worker's that the supervisor forks without exec, and
// the end-to-end tests' (which fork their own process and call it, sparing each command the
// second of loading LibTorch).
#pragma once

int dtrain_main(int argc, char** argv);
