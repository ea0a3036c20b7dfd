// Checkpoints of a run: which one to resume from, writing one, restoring one. Tensors are
// saved at their full logical shapes (split ones gathered over the tensor group), so a
// checkpoint resumes on any layout.
#pragma once
#include <optional>
#include <string>

#include "train/context.hpp"

namespace dtrain {

// Rank 0 decides which checkpoint (if any) the job resumes from; the others follow.
std::optional<std::string> choose_checkpoint(Context& c);
// Every rank reads the checkpoint and takes its part.
void restore(Context& c, const std::string& folder);
// Collective over the world: rank 0 writes, nobody moves on before it is complete.
void save_checkpoint(Context& c, const std::optional<EvalResult>& eval);
// Every data-parallel rank starts from data rank 0's exact state.
void broadcast_state(Context& c);

}  // namespace dtrain
