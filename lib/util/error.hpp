// Typed errors: each kind maps to one exit code of the contract (docs/contract.md), so `main`
// decides the code in one place and library code never calls exit() or abort().
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dtrain {

enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // an internal error: a bug, not the user's input
  kExitBadSpec = 2,      // bad command line or job spec
  kExitBadData = 3,      // data or checkpoint could not be read
  kExitPeerFailed = 4,   // a peer rank failed or a collective timed out
};

struct Error : std::runtime_error {
  Error(ExitCode code, const std::string& what) : std::runtime_error(what), code(code) {}
  ExitCode code;
};

// Bad job spec or command line (exit 2).
struct ConfigError : Error {
  explicit ConfigError(const std::string& what) : Error(kExitBadSpec, what) {}
};
// Unreadable or corrupt data set (exit 3).
struct DataError : Error {
  explicit DataError(const std::string& what) : Error(kExitBadData, what) {}
};
// Missing, incomplete or corrupt checkpoint (exit 3).
struct CheckpointError : Error {
  explicit CheckpointError(const std::string& what) : Error(kExitBadData, what) {}
};
// A run directory or export target that cannot be created or written (exit 3).
struct RunDirError : Error {
  explicit RunDirError(const std::string& what) : Error(kExitBadData, what) {}
};
// Training diverged: a non-finite loss or gradient (exit 3, status "diverged").
struct DivergedError : Error {
  explicit DivergedError(const std::string& what) : Error(kExitBadData, what) {}
};
// A peer rank died or a collective timed out (exit 4).
struct DistError : Error {
  explicit DistError(const std::string& what) : Error(kExitPeerFailed, what) {}
};

// The first line of a message: what a user can act on, without backtraces.
inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Throws E with a formatted message when `cond` holds: ABORT_IF in Marian's words, but a throw.
template <class E, class... Args>
void fail_if(bool cond, fmt::format_string<Args...> f, Args&&... args) {
  if (cond) throw E(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace dtrain
