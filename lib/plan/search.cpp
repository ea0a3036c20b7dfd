#include "plan/search.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "job/validate.hpp"
#include "models/model.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double largest_rank(const Plan& p) {
  double most = 0;
  for (const auto& r : p.ranks) most = std::max(most, r.memory.total());
  return most;
}

// What a candidate needs of the limit: all ranks on a CPU, the largest on a GPU.
double needed(const Plan& p) { return p.device == "cuda" ? largest_rank(p) : p.world_memory; }

}  // namespace

std::vector<Candidate> all_layouts(const JobConfig& cfg, int64_t world, const MachineProfile* profile,
                                   double memory_bytes) {
  std::vector<Candidate> out;
  const bool blocks = model_spec(cfg.model.arch).blocks;
  for (int64_t t = 1; t <= world; ++t) {
    if (world % t) continue;
    for (int64_t p = 1; p <= world / t; ++p) {
      if ((world / t) % p) continue;
      const int64_t d = world / t / p;
      for (int64_t zero = 0; zero <= (d > 1 ? 3 : 0); ++zero)
        for (const std::string schedule : {"gpipe", "1f1b", "interleaved_1f1b"}) {
          if (p == 1 && schedule != "1f1b") continue;  // one stage: no schedule to choose
          for (int64_t accum : {1, 2, 4, 8})
            for (bool recompute : {false, true}) {
              if (recompute && !blocks) continue;
              JobConfig c = cfg;
              auto& par = c.parallel;
              par.data = d, par.tensor = t, par.pipeline = p, par.zero = zero;
              par.schedule = p > 1 ? schedule : cfg.parallel.schedule;
              par.virtual_stages = schedule == "interleaved_1f1b" && p > 1 ? 2 : 1;
              par.stages.clear();
              c.train.grad_accum = accum;
              c.train.recompute = recompute ? "blocks" : "none";
              try {
                validate(c, world);
              } catch (const ConfigError&) {
                continue;  // a layout the job cannot take
              }
              Candidate cand;
              cand.layout = fmt::format("d{} x t{} x p{}, zero {}{}, {} micro-batch(es){}", d, t, p,
                                        zero, p > 1 ? ", " + par.schedule + (par.virtual_stages > 1 ? " x2" : "") : "",
                                        accum, recompute ? ", recompute" : "");
              cand.plan = plan_job(c, world, profile);
              cand.fits = memory_bytes <= 0 || needed(cand.plan) <= memory_bytes;
              cand.cfg = std::move(c);
              out.push_back(std::move(cand));
            }
        }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.plan.step_s && b.plan.step_s) return *a.plan.step_s < *b.plan.step_s;
    return needed(a.plan) < needed(b.plan);
  });
  return out;
}

std::string candidates_table(const std::vector<Candidate>& all, double memory_bytes) {
  std::string out = fmt::format("{} layout(s){}\n", all.size(),
                                memory_bytes > 0 ? fmt::format(", memory limit {:.1f} GiB", memory_bytes / (1024 * kMiB)) : "");
  out += fmt::format("{:<64} {:>9} {:>11} {:>12} {:>12} {:>6} {:>5}\n", "layout", "step s",
                     "samples/s", "largest MB", "all MB", "bubble", "fits");
  for (const auto& c : all) {
    double bubble = 0;
    for (const auto& r : c.plan.ranks) bubble = std::max(bubble, r.bubble);
    out += fmt::format("{:<64} {:>9} {:>11} {:>12.1f} {:>12.1f} {:>6.3f} {:>5}\n", c.layout,
                       c.plan.step_s ? fmt::format("{:.4g}", *c.plan.step_s) : "-",
                       c.plan.samples_per_s ? fmt::format("{:.4g}", *c.plan.samples_per_s) : "-",
                       largest_rank(c.plan) / kMiB, c.plan.world_memory / kMiB, bubble,
                       c.fits ? "yes" : "no");
  }
  return out;
}

nlohmann::json candidates_json(const std::vector<Candidate>& all, double memory_bytes) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& c : all) {
    auto j = plan_json(c.cfg, c.plan);
    j["label"] = c.layout;
    j["fits"] = c.fits;
    j["largest_rank_mb"] = largest_rank(c.plan) / kMiB;
    j["all_ranks_mb"] = c.plan.world_memory / kMiB;
    j["recompute"] = c.cfg.train.recompute;
    j["virtual_stages"] = c.cfg.parallel.virtual_stages;
    list.push_back(std::move(j));
  }
  return {{"memory_limit_mb", memory_bytes > 0 ? nlohmann::json(memory_bytes / kMiB) : nlohmann::json(nullptr)},
          {"layouts", list}};
}

}  // namespace dtrain
