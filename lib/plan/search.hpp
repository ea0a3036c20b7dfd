// `dtrain plan --all`: every layout of a number of processes the job validates for, planned
// and ranked. Apart from plan.hpp because it validates each candidate (job/validate.hpp
// uses the plan's memory estimate).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "plan/plan.hpp"

namespace dtrain {

// One layout: data x tensor x pipeline, ZeRO stage, schedule, micro-batches, recompute (the
// job's other keys as they are).
struct Candidate {
  std::string layout;  // "d2 x t1 x p2, zero 1, 1f1b x2, 4 micro-batches, recompute"
  JobConfig cfg;       // the job with that layout
  Plan plan;
  bool fits = true;    // its memory within the limit
};

// Every candidate that validates for `world` processes, fastest first (without a profile:
// least memory first). `memory_bytes`: what the machine has for all of them on a CPU (every
// rank on it), what one device has on a GPU (the largest rank).
std::vector<Candidate> all_layouts(const JobConfig& cfg, int64_t world, const MachineProfile* profile,
                                   double memory_bytes);
std::string candidates_table(const std::vector<Candidate>& all, double memory_bytes);
nlohmann::json candidates_json(const std::vector<Candidate>& all, double memory_bytes);

}  // namespace dtrain
