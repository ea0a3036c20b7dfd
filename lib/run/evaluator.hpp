// Evaluation on the held-out split.
#pragma once
#include <cstdint>

#include <c10/core/Device.h>

#include "data/dataset.hpp"
#include "parallel/mesh.hpp"
#include "pipeline/runner.hpp"
#include "run/run_log.hpp"

namespace dtrain {

struct EvalSplit;
struct ModelParts;
struct Run;

// Each data-parallel rank scores a contiguous slice of `test` (its part of `split`: of the
// mesh's data ranks, or of every fault-tolerant replica's), `batch_size` samples at a
// time; the sums are combined over the data group, across the replicas, and over the
// pipeline's stages (only the last has them), so every item counts exactly once whatever
// the layout.
EvalResult evaluate(MicroBatchRunner& runner, const ModelParts& model, const Dataset& test,
                    const Mesh& mesh, int64_t batch_size, const c10::Device& device,
                    const EvalSplit& split);
// An evaluation after step n, into the run log (its line, the best metric so far).
void evaluate_and_report(Run& run, int64_t n);

}  // namespace dtrain
