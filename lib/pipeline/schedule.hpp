// Pipeline parallelism, the pure part: the order in which each pipeline rank runs a step's
// micro-batches (a schedule). A schedule is a list of actions per rank that one executor
// runs (pipeline/executor.cpp), so a new schedule is a new list, not a new loop.
//
// Stages: the model's parts cut into pipeline x virtual_stages contiguous runs
// (parallel/stages.hpp). Global stage g sits on pipeline rank g % pipeline as its chunk
// g / pipeline: with one chunk per rank, rank r is stage r; interleaved, rank r holds
// stages r, r + p, r + 2p, ... (Megatron-LM's virtual pipeline).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct Action {
  enum Kind { kForward, kBackward };
  Kind kind;
  int64_t micro;      // the micro-batch, from 0
  int64_t chunk = 0;  // which of this rank's chunks (0 unless interleaved)
  bool operator==(const Action& o) const {
    return kind == o.kind && micro == o.micro && chunk == o.chunk;
  }
};

// What pipeline rank `rank` of `ranks` does in one step of `micro` micro-batches, for
// parallel.schedule `name` with `chunks` chunks per rank:
//   gpipe             every forward, then every backward (the last forward's first):
//                     all `micro` micro-batches' activations are held at once
//   1f1b              PipeDream-flush / Megatron-LM: ranks - rank - 1 forwards to fill
//                     the pipeline, then one forward and one backward in turn, then the
//                     remaining backwards: at most `ranks` micro-batches held
//   interleaved_1f1b  Megatron-LM's interleaved schedule over `chunks` chunks per rank,
//                     forwards in groups of `ranks` micro-batches per chunk; needs `micro`
//                     a multiple of `ranks`. The bubble shrinks by a factor of `chunks`.
std::vector<Action> pipeline_schedule(const std::string& name, int64_t rank, int64_t ranks,
                                      int64_t micro, int64_t chunks = 1);

// A step of schedule `name` played out with global stage g's forward of one micro-batch
// taking forward[g] and its backward backward[g] (any unit of time): each rank runs its
// actions in order, each as soon as the rank is free and its input is there (a forward's
// activation from stage g - 1, a backward's gradient from stage g + 1, the last stage's
// its own forward), hand-offs taking no time. Throws std::logic_error where the lists
// cannot finish (a schedule that deadlocks).
struct ScheduleRun {
  std::vector<double> busy, end;    // each rank's working time, and its last action's end
  std::vector<int64_t> most_held;   // each rank's most micro-batches in flight at once
  double makespan() const;          // the last rank's end
  // The share of rank r's time from the step's start to its last action that it waits
  // for its neighbours: what the executor reports as the rank's `bubble`.
  double bubble(int64_t rank) const;
};
ScheduleRun play_schedule(const std::string& name, int64_t ranks, int64_t micro, int64_t chunks,
                          const std::vector<double>& forward, const std::vector<double>& backward);

}  // namespace dtrain
