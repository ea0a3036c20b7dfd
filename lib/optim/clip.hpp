// The global gradient norm, over every shard of every parameter, each counted once.
#pragma once

namespace dtrain {

class Comm;
class FlatParams;

// The L2 norm of the whole model's gradient. Parameters split over `tensor` contribute
// their squares from every rank; replicated ones (identical on every tensor rank) once.
// A collective over `tensor` when it has more than one rank.
double global_grad_norm(const FlatParams& params, Comm& tensor);

// The factor that brings a gradient of global norm `norm` to at most `max_norm` (torch's
// clip_grad_norm_: max_norm / (norm + 1e-6)); 1 when it is within, or max_norm is 0 (off).
double clip_factor(double norm, double max_norm);
// Scales the gradient by clip_factor(norm, max_norm).
void clip_grad(FlatParams& params, double norm, double max_norm);

}  // namespace dtrain
