// Telling the launcher why this process failed. torchrun names a file in
// TORCHELASTIC_ERROR_FILE and reads it when a worker exits non-zero; the JSON shape is
// torch.distributed.elastic's ({"message": {"message": ..., "extraInfo": {"timestamp": ...}}}),
// so its failure summary shows dtrain's one-line error instead of "<N/A>".
#pragma once
#include <string>

#include "launch/world.hpp"

namespace dtrain {

// Writes `message` where the launcher asked for it; nothing when it did not. Never throws:
// it runs while the process is already failing.
void report_failure_to_launcher(const Env& env, const std::string& message);

}  // namespace dtrain
