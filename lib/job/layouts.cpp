#include "job/layouts.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <tuple>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/checkpointer.hpp"
#include "config/schema.hpp"
#include "job/validate.hpp"
#include "launch/device.hpp"
#include "models/model.hpp"
#include "run/mode.hpp"
#include "util/error.hpp"
#include "util/files.hpp"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

// The keys a candidate sets: the layout parallel.auto chooses.
const std::set<std::string> kLayoutKeys{
    "parallel.data",   "parallel.tensor",         "parallel.pipeline",
    "parallel.stages", "parallel.balance",        "parallel.schedule",
    "parallel.virtual_stages", "parallel.zero",   "train.grad_accum",
    "train.recompute"};

double largest_rank(const Plan& p) {
  double most = 0;
  for (const auto& r : p.ranks) most = std::max(most, r.memory.total());
  return most;
}

// What a candidate needs of the limit: all ranks on a CPU; on a GPU the largest, as many
// times as ranks share one.
double needed(const Plan& p) {
  return p.device == "cuda" ? largest_rank(p) * double(p.ranks_per_gpu) : p.world_memory;
}

// Without a time estimate (no profile, a GPU, a mode whose steps have none), what a layout costs beyond the
// work itself, in order: the busiest rank's bubble, bytes sent and FLOPs (recompute's
// extra forward), the micro-batches (smaller matmuls), then the memory it needs.
std::tuple<double, double, double, int64_t, double> overhead(const Candidate& c) {
  double bubble = 0, bytes = 0, flops = 0;
  for (const auto& r : c.plan.ranks)
    bubble = std::max(bubble, r.bubble), bytes = std::max(bytes, r.comm_bytes.value_or(0)),
    flops = std::max(flops, r.flops);
  return {bubble, bytes, flops, c.cfg.train.grad_accum, needed(c.plan)};
}

// The layout keys parallel.auto holds as the job sets them.
std::set<std::string> held_keys(const JobConfig& cfg) {
  std::set<std::string> out;
  if (!cfg.parallel.auto_layout) return out;
  for (const auto& k : cfg.given)
    if (kLayoutKeys.count(k)) out.insert(k);
  return out;
}

// `options`, or only the job's own value where the key is held; the job's own value is
// always a candidate (a grad_accum of 3 is not on the list but is what the job asks).
std::vector<int64_t> values(const std::set<std::string>& held, const std::string& key,
                            int64_t own, std::vector<int64_t> options) {
  if (held.count(key)) return {own};
  if (std::find(options.begin(), options.end(), own) == options.end()) options.push_back(own);
  return options;
}

// A split of the trainers into tensor x pipeline x data ranks.
struct Mesh {
  int64_t tensor, pipeline, data;
};

// Every split of `trainers` ranks, those the job holds as it sets them.
std::vector<Mesh> meshes(int64_t trainers, const ParallelConfig& own,
                         const std::set<std::string>& held) {
  std::vector<Mesh> out;
  for (int64_t t = 1; t <= trainers; ++t) {
    if (trainers % t || (held.count("parallel.tensor") && t != own.tensor)) continue;
    for (int64_t p = 1; p <= trainers / t; ++p) {
      if ((trainers / t) % p || (held.count("parallel.pipeline") && p != own.pipeline)) continue;
      const int64_t d = trainers / t / p;
      if (held.count("parallel.data") && own.data != 0 && d != own.data) continue;
      out.push_back({t, p, d});
    }
  }
  return out;
}

// A pipeline schedule and the model chunks each pipeline rank holds under it.
struct Schedule {
  std::string name;
  int64_t chunks;
};

// The schedules a pipeline of `stages` ranks may run: one stage has none to choose (the
// job's own stands); interleaving takes 2 chunks a rank, or the job's own count above 2.
std::vector<Schedule> schedules(int64_t stages, const ParallelConfig& own,
                                const std::set<std::string>& held) {
  const bool chunks_held = held.count("parallel.virtual_stages") > 0;
  if (stages == 1) return {{own.schedule, chunks_held ? own.virtual_stages : 1}};
  std::vector<Schedule> out;
  for (const std::string name : {"gpipe", "1f1b", "interleaved_1f1b"}) {
    if (held.count("parallel.schedule") && name != own.schedule) continue;
    std::vector<int64_t> chunks{1};
    if (chunks_held) chunks = {own.virtual_stages};
    else if (name == "interleaved_1f1b")
      chunks = own.virtual_stages > 2 ? std::vector<int64_t>{2, own.virtual_stages}
                                      : std::vector<int64_t>{2};
    for (int64_t c : chunks) out.push_back({name, c});
  }
  return out;
}

// Whether to recompute the blocks' activations: both where the model has blocks, unless
// the job holds its own choice.
std::vector<bool> recomputes(const JobConfig& cfg, bool blocks, const std::set<std::string>& held) {
  std::vector<bool> out;
  for (bool r : {false, true})
    if ((!r || blocks) && (!held.count("train.recompute") || r == (cfg.train.recompute == "blocks")))
      out.push_back(r);
  return out;
}

// A candidate's name: "d2 x t1 x p2, zero 1, 1f1b x2, flops split, 4 micro-batch(es), recompute".
std::string layout_name(const JobConfig& c) {
  const auto& par = c.parallel;
  std::string pipeline;
  if (par.pipeline > 1)
    pipeline = ", " + par.schedule +
               (par.virtual_stages > 1 ? fmt::format(" x{}", par.virtual_stages) : "") +
               (par.balance == "flops" ? ", flops split" : "");
  return fmt::format("d{} x t{} x p{}, zero {}{}, {} micro-batch(es){}", par.data, par.tensor,
                     par.pipeline, par.zero, pipeline, c.train.grad_accum,
                     c.train.recompute == "blocks" ? ", recompute" : "");
}

// A pipeline's split evened out by parameters and by FLOPs, where the two differ and the
// job sets neither (else the job's own). Planning a split is not free: the answer is kept
// by stages and tensor ranks.
class Balances {
 public:
  Balances(const JobConfig& cfg, const std::set<std::string>& held)
      : own_(cfg.parallel.balance),
        held_(held.count("parallel.balance") || held.count("parallel.stages")) {}

  std::vector<std::string> of(const JobConfig& c) {
    if (c.parallel.pipeline == 1 || held_) return {own_};
    const int64_t stages = c.parallel.pipeline * c.parallel.virtual_stages;
    const auto key = std::make_pair(stages, c.parallel.tensor);
    if (!differ_.count(key)) {
      JobConfig by = c;
      by.parallel.balance = "params";
      const auto params = planned_split(by, stages, c.parallel.tensor);
      by.parallel.balance = "flops";
      differ_[key] = planned_split(by, stages, c.parallel.tensor) != params;
    }
    if (differ_[key]) return {"params", "flops"};
    return {own_};
  }

 private:
  std::string own_;
  bool held_;
  std::map<std::pair<int64_t, int64_t>, bool> differ_;
};

bool validates(const JobConfig& c, int64_t world, const Devices& devices) {
  try {
    validate(c, world, devices);
    return true;
  } catch (const ConfigError&) {
    return false;
  }
}

// Every layout the job validates for on `world` processes among `devices` (the held keys
// as set), not yet planned.
std::vector<Candidate> valid_layouts(const JobConfig& cfg, int64_t world, const Devices& devices = Devices::here()) {
  std::vector<Candidate> out;
  const auto held = held_keys(cfg);
  const auto& own = cfg.parallel;
  const bool blocks = model_spec(cfg.model.arch).blocks;
  // The ranks that train (a mode may set some apart: parameter servers).
  const int64_t trainers = mode_spec(own.mode).trainers(cfg, world);
  Balances balances(cfg, held);
  for (const Mesh& m : meshes(trainers, own, held))
    for (int64_t zero : values(held, "parallel.zero", own.zero, {0, 1, 2, 3})) {
      if (m.data == 1 && zero > 0 && !held.count("parallel.zero")) continue;  // nothing to shard over
      for (const Schedule& s : schedules(m.pipeline, own, held))
        for (int64_t accum : values(held, "train.grad_accum", cfg.train.grad_accum, {1, 2, 4, 8}))
          for (bool recompute : recomputes(cfg, blocks, held)) {
            JobConfig c = cfg;
            auto& par = c.parallel;
            par.data = m.data, par.tensor = m.tensor, par.pipeline = m.pipeline, par.zero = zero;
            par.schedule = s.name, par.virtual_stages = s.chunks;
            if (!held.count("parallel.stages")) par.stages.clear();
            c.train.grad_accum = accum;
            c.train.recompute = recompute ? "blocks" : "none";
            if (!validates(c, world, devices)) continue;  // a layout the job cannot take
            for (const std::string& balance : balances.of(c)) {
              Candidate cand;
              cand.cfg = c;
              cand.cfg.parallel.balance = balance;
              cand.layout = layout_name(cand.cfg);
              out.push_back(std::move(cand));
            }
          }
    }
  return out;
}

// No layout validates: the job's own layout's reason where it has one, else the keys held.
[[noreturn]] void no_layout(const JobConfig& cfg, int64_t world) {
  try {
    validate(cfg, world);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("parallel.auto: no layout of {} process(es) validates for this "
                                  "job; its own: {}", world, first_line(e.what())));
  }
  throw ConfigError(fmt::format("parallel.auto: no layout of {} process(es) validates for this job "
                                "with {} as set", world, fmt::join(held_keys(cfg), ", ")));
}

// `cfg` with `earlier`'s layout keys, held as set (a resume keeps the layout its run chose),
// but for those the job sets itself: a key set for the resume is honoured.
JobConfig with_layout_of(const JobConfig& cfg, const JobConfig& earlier) {
  JobConfig c = cfg, from = earlier;
  auto to_fields = fields_of(c), from_fields = fields_of(from);  // the same keys, in order
  for (size_t i = 0; i < to_fields.size(); ++i)
    if (kLayoutKeys.count(to_fields[i].key) && !cfg.given.count(to_fields[i].key))
      std::visit([&](auto* to) { *to = *std::get<decltype(to)>(from_fields[i].value); }, to_fields[i].value);
  c.given.insert(kLayoutKeys.begin(), kLayoutKeys.end());
  return c;
}

}  // namespace

std::vector<Candidate> all_layouts(const JobConfig& cfg, int64_t world, const MachineProfile* profile,
                                   double memory_bytes, const Devices& devices) {
  auto out = valid_layouts(cfg, world, devices);
  for (auto& c : out) {
    c.plan = plan_job(c.cfg, world, profile, devices);
    c.fits = memory_bytes <= 0 || needed(c.plan) <= memory_bytes;
  }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.plan.step_s && b.plan.step_s) return *a.plan.step_s < *b.plan.step_s;
    return overhead(a) < overhead(b);
  });
  return out;
}

double gpu_limit(const MachineProfile* profile) {
  return profile && profile->gpu ? 0.9 * profile->gpu->memory : 0;
}

void check_some_layout(const JobConfig& cfg, int64_t world) {
  if (valid_layouts(cfg, world).empty()) no_layout(cfg, world);
}

MachineProfile profile_for_auto(int64_t local, bool gpu) {
  const std::string path = default_profile_path();
  auto stored = load_profile(path);
  if (stored && (!gpu || stored->gpu)) return *stored;
  std::cerr << "dtrain: parallel.auto: no machine profile" << (stored ? " of a GPU" : "") << " at "
            << path << "; measuring this machine (about " << (gpu ? 30 : 15) << " s)\n";
  auto measured = measure_in_child(std::clamp<int64_t>(local, 2, 8));
  try {
    save_profile(measured, path);
  } catch (const Error& e) {  // a read-only home: measured again next time, nothing lost
    std::cerr << "dtrain: warning: " << first_line(e.what()) << "\n";
  }
  return measured;
}

AutoChoice auto_layout(const JobConfig& cfg, int64_t world, int64_t local, bool resuming) {
  if (!cfg.parallel.auto_layout) return {cfg, ""};
  const auto earlier_yaml = fs::path(cfg.run_dir) / "config.yaml";
  std::error_code ec;
  if (resuming && fs::is_regular_file(earlier_yaml, ec)) {
    try {
      const JobConfig earlier = parse_job(read_file(earlier_yaml.string()), earlier_yaml.string());
      const JobConfig held = with_layout_of(cfg, earlier);
      auto all = all_layouts(held, world, nullptr, 0);
      if (all.empty()) no_layout(held, world);
      auto& kept = all.front();
      const auto set_now = held_keys(cfg);  // the job's own keys win over the record
      return {std::move(kept.cfg),
              fmt::format("parallel.auto: {} (as {} records{})", kept.layout, earlier_yaml.string(),
                          set_now.empty() ? "" : fmt::format("; {} as the job sets", fmt::join(set_now, ", ")))};
    } catch (const ConfigError&) {
      // another world size, or a job changed since: chosen again below
    }
  }
  const bool cuda = plan_device(cfg, 0, local, mode_spec(cfg.parallel.mode).any_source).device.is_cuda();
  const MachineProfile profile = profile_for_auto(local, cuda);
  // A plan counts every rank; this machine holds `local` of them (a GPU: one).
  const double limit = cuda ? gpu_limit(&profile)
                            : available_memory() * double(world) / double(std::max<int64_t>(1, local));
  auto all = all_layouts(cfg, world, &profile, limit);
  if (all.empty()) no_layout(cfg, world);
  const auto fit = std::count_if(all.begin(), all.end(), [](const Candidate& c) { return c.fits; });
  // None fits: the one that needs least, for check_machine to refuse (or to run where
  // train.memory_check is off).
  auto& best = fit ? all.front()
                   : *std::min_element(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
                       return needed(a.plan) < needed(b.plan);
                     });
  const std::string why =
      !fit ? fmt::format("none of {} layout(s) fits: the one that needs least", all.size())
      : best.plan.step_s
          ? fmt::format("expected {:.3g} s a step, the fastest of {} layout(s) that fit", *best.plan.step_s, fit)
          : fmt::format("no time estimate here: the least bubble, bytes sent and work of {} layout(s) that fit", fit);
  std::string line = fmt::format("parallel.auto: {} ({})", best.layout, why);
  return {std::move(best.cfg), std::move(line)};
}

JobConfig agree_on_layout(const JobConfig& cfg, int64_t local, bool resuming, Comm& job) {
  if (!cfg.parallel.auto_layout) return cfg;
  std::string chosen;
  const int64_t bytes = root_does(job, "choose a layout (parallel.auto)", [&] {
    auto choice = auto_layout(cfg, job.size(), local, resuming);
    std::cout << "dtrain: " << choice.line << std::endl;
    chosen = to_yaml(choice.cfg);
    return int64_t(chosen.size());
  });
  auto text = torch::zeros({bytes}, torch::kUInt8);
  if (job.rank() == 0) std::memcpy(text.data_ptr(), chosen.data(), chosen.size());
  job.broadcast(text, 0);
  job.take_sent();  // not a step's traffic
  const std::string yaml(static_cast<const char*>(text.data_ptr()), size_t(bytes));
  return with_layout_of(cfg, parse_job(yaml, "rank 0's layout (parallel.auto)"));
}

std::string candidates_table(const std::vector<Candidate>& all, double memory_bytes) {
  std::string out = fmt::format("{} layout(s){}\n", all.size(),
                                memory_bytes > 0 ? fmt::format(", memory limit {:.1f} GiB", memory_bytes / (1024 * kMiB)) : "");
  size_t width = 64;
  for (const auto& c : all) width = std::max(width, c.layout.size());
  out += fmt::format("{:<{}} {:>9} {:>11} {:>12} {:>12} {:>6} {:>5}\n", "layout", width, "step s",
                     "samples/s", "largest MB", "all MB", "bubble", "fits");
  for (const auto& c : all) {
    double bubble = 0;
    for (const auto& r : c.plan.ranks) bubble = std::max(bubble, r.bubble);
    out += fmt::format("{:<{}} {:>9} {:>11} {:>12.1f} {:>12.1f} {:>6.3f} {:>5}\n", c.layout, width,
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
