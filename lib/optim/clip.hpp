// The global gradient norm, over every shard of every parameter, each counted once.
#pragma once

namespace dtrain {

class Comm;
class FlatParams;

// The L2 norm of the whole model's gradient. Parameters split over `tensor` contribute
// their squares from every rank; replicated ones (identical on every tensor rank) once.
// A collective over `tensor` when it has more than one rank.
double global_grad_norm(const FlatParams& params, Comm& tensor);

// Divides the gradient by `loss_scale` (fp16's; 1 otherwise) and scales it so that its
// global norm, `norm` (already divided by the loss scale), is at most `max_norm` (torch's
// clip_grad_norm_: factor max_norm / (norm + 1e-6); max_norm 0 is off). One multiply of the
// flat gradient, none when there is nothing to do.
void clip_grad(FlatParams& params, double norm, double max_norm, double loss_scale = 1.0);

}  // namespace dtrain
