// Job spec I/O: YAML file -> JobConfig -> validated, with errors a user can act on.
#include "config/schema.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace {

// `s` for an error line: control and non-ASCII bytes written as \xNN, and anything past
// 80 characters cut (a value of 100 kB is not echoed whole).
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (out.size() >= 80) return out + fmt::format("... ({} bytes)", s.size());
    out += ch >= 0x20 && ch < 0x7f ? std::string(1, char(ch)) : fmt::format("\\x{:02x}", ch);
  }
  return out;
}

std::map<std::string, NamesOf>& lists() {
  static std::map<std::string, NamesOf> by_key;
  return by_key;
}

struct Collector {
  std::vector<Field>* out;
  std::string prefix;
  template <class T>
  void operator()(const char* key, T& value, const char* doc) {
    (*this)(key, value, Choices{}, doc);
  }
  template <class T>
  void operator()(const char* key, T& value, Choices choices, const char* doc) {
    out->push_back(Field{prefix + key, &value, std::move(choices), doc});
  }
  template <class S>
  void section(const char* key, S& s) {
    Collector sub{out, prefix + key + "."};
    s.visit(sub);
  }
};

// Whether top-level `key` is a section: some field's key is under it.
bool is_section(const std::vector<Field>& fields, const std::string& key) {
  return std::any_of(fields.begin(), fields.end(),
                     [&](const Field& f) { return f.key.rfind(key + ".", 0) == 0; });
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string leaf(const std::string& key) {
  auto dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

// Keys an earlier version accepted, and what replaces each.
const char* replaced_by(const std::string& key) {
  if (key == "parallel.micro_batches")
    return "train.grad_accum is the number of micro-batches per optimizer step, and a pipeline "
           "schedule runs them all: set that instead";
  return nullptr;
}

// The error for a key the schema does not have, at `at` (a file position or --set).
ConfigError unknown_key(const std::string& at, const std::string& key) {
  if (const char* instead = replaced_by(key))
    return ConfigError(fmt::format("{}: '{}' was removed; {}", at, key, instead));
  const auto near = nearest_key(key);
  return ConfigError(fmt::format("{}: unknown key '{}'{}", at, key,
                                 near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near)));
}

std::string where(const YAML::Mark& m, const std::string& origin) {
  if (m.is_null()) return origin;
  return fmt::format("{}:{}:{}", origin, m.line + 1, m.column + 1);
}

// yaml-cpp reports nesting past its depth limit (a stack guard) as "bad file".
ConfigError yaml_error(const YAML::ParserException& e, const std::string& origin) {
  if (dynamic_cast<const YAML::DeepRecursion*>(&e))
    return ConfigError(fmt::format("{}: nested too deeply (a job spec is a few levels of keys)",
                                   where(e.mark, origin)));
  return ConfigError(fmt::format("{}: {}", where(e.mark, origin), e.msg));
}

Field* find_field(std::vector<Field>& fields, const std::string& key) {
  for (auto& f : fields)
    if (f.key == key) return &f;
  return nullptr;
}

// What a key of type T takes, as its errors say.
template <class T>
const char* expected_value() {
  if constexpr (std::is_same_v<T, bool>) return "true or false";
  else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else if constexpr (std::is_same_v<T, double>) return "a number";
  else if constexpr (std::is_same_v<T, Ints>) return "a list of integers such as [512, 256]";
  else if constexpr (std::is_same_v<T, Names>) return "a list of names such as [random_crop, hflip]";
  else return "a string";
}

// Sets one field from a YAML node; `at` says where the value came from.
void set_field(const Field& f, const YAML::Node& node, const std::string& at) {
  auto bad = [&](const char* expected) {
    std::string got = node.IsScalar() ? fmt::format("'{}'", printable(node.Scalar()))
                      : node.IsSequence() ? std::string("a list")
                      : node.IsMap() ? std::string("a mapping") : std::string("nothing");
    return ConfigError(fmt::format("{}: {}: expected {}, got {}", at, f.key, expected, got));
  };
  if (!node.IsDefined() || node.IsNull()) throw bad("a value");
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        try {
          if constexpr (std::is_same_v<T, Ints> || std::is_same_v<T, Names>) {
            if (!node.IsSequence()) throw bad(expected_value<T>());
            T v;
            for (const auto& item : node) v.push_back(item.as<typename T::value_type>());
            *p = v;
          } else {
            if (!node.IsScalar()) throw bad("a single value");
            *p = node.as<T>();
          }
        } catch (const YAML::BadConversion&) {
          throw bad(expected_value<T>());
        }
      },
      f.value);
  if (!f.choices.empty()) {
    const Names values = std::holds_alternative<Names*>(f.value) ? *std::get<Names*>(f.value)
                                                                 : Names{*std::get<std::string*>(f.value)};
    for (const auto& s : values)
      if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end())
        throw ConfigError(fmt::format("{}: {}: '{}' is not one of {}", at, f.key, s,
                                      fmt::join(f.choices, " | ")));
  }
}

void load_map(std::vector<Field>& fields, const YAML::Node& map, const std::string& prefix,
              const std::string& origin, std::set<std::string>& given) {
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    const std::string key = prefix + it->first.as<std::string>();
    const std::string at = where(it->first.Mark(), origin);
    // yaml-cpp keeps both copies of a repeated key; one of them would be silently ignored.
    if (!seen.insert(key).second) throw ConfigError(fmt::format("{}: duplicate key '{}'", at, key));
    if (prefix.empty() && is_section(fields, key)) {
      if (it->second.IsNull()) continue;
      if (!it->second.IsMap())
        throw ConfigError(fmt::format("{}: '{}' must be a mapping of keys", at, key));
      load_map(fields, it->second, key + ".", origin, given);
      continue;
    }
    Field* f = find_field(fields, key);
    if (!f) throw unknown_key(at, key);
    set_field(*f, it->second, where(it->second.Mark(), origin));
    given.insert(key);
  }
}

JobConfig from_node(const YAML::Node& root, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  JobConfig cfg;
  auto fields = fields_of(cfg);
  if (root.IsDefined() && !root.IsNull()) {
    if (!root.IsMap())
      throw ConfigError(fmt::format("{}: a job spec must be a mapping of keys", origin));
    load_map(fields, root, "", origin, cfg.given);
  }
  for (const auto& o : overrides) apply_override(cfg, o);
  return cfg;
}

// Emits a JobConfig as nested YAML maps, in visit() order.
struct Emitter {
  YAML::Emitter* out;
  template <class T>
  void operator()(const char* key, const T& value, const char* doc) {
    (*this)(key, value, Choices{}, doc);
  }
  template <class T>
  void operator()(const char* key, const T& value, const Choices&, const char*) {
    *out << YAML::Key << key << YAML::Value;
    if constexpr (std::is_same_v<T, Ints> || std::is_same_v<T, Names>) {
      *out << YAML::Flow << YAML::BeginSeq;
      for (const auto& x : value) *out << x;
      *out << YAML::EndSeq;
    } else if constexpr (std::is_same_v<T, double>) {
      *out << fmt::format("{}", value);  // shortest form that reads back exactly
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (value.empty()) *out << YAML::DoubleQuoted << value; else *out << value;
    } else {
      *out << value;
    }
  }
  template <class S>
  void section(const char* key, S& s) {
    *out << YAML::Key << key << YAML::Value << YAML::BeginMap;
    s.visit(*this);
    *out << YAML::EndMap;
  }
};

}  // namespace

ListedBy::ListedBy(const char* key, NamesOf names) { lists()[key] = names; }

Choices listed(const char* key) {
  auto it = lists().find(key);
  return it == lists().end() ? Choices{} : it->second();
}

std::vector<Field> fields_of(JobConfig& cfg) {
  std::vector<Field> fields;
  Collector c{&fields, ""};
  cfg.visit(c);
  return fields;
}

std::vector<std::string> all_keys() {
  JobConfig probe;
  std::vector<std::string> keys;
  for (const auto& f : fields_of(probe)) keys.push_back(f.key);
  return keys;
}

std::string nearest_key(const std::string& key) {
  std::string best;
  size_t best_score = std::string::npos;
  for (const auto& cand : all_keys()) {
    // A misspelt leaf in the right section, or a right leaf in the wrong section.
    size_t score = std::min(edit_distance(key, cand), edit_distance(leaf(key), leaf(cand)) + 1);
    if (score < best_score) best_score = score, best = cand;
  }
  size_t limit = std::max<size_t>(2, leaf(key).size() / 2);
  return best_score <= limit ? best : std::string();
}

void apply_override(JobConfig& cfg, const std::string& assignment) {
  auto eq = assignment.find('=');
  const std::string at = fmt::format("--set {}", printable(assignment));
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("{}: expected KEY=VALUE, e.g. --set optimizer.lr=0.1", at));
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  auto fields = fields_of(cfg);
  Field* f = find_field(fields, key);
  if (!f) throw unknown_key(at, key);
  // Strings are taken verbatim; everything else is read as YAML so lists work: [128, 64].
  YAML::Node node;
  if (std::holds_alternative<std::string*>(f->value)) {
    node = YAML::Node(text);
  } else {
    try {
      node = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      throw ConfigError(fmt::format("{}: {}: cannot read '{}': {}", at, key, text, e.msg));
    }
  }
  set_field(*f, node, at);
  cfg.given.insert(key);
}

JobConfig parse_job(const std::string& yaml_text, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw yaml_error(e, origin);
  }
  return from_node(root, origin, overrides);
}

// Counts what a document holds, without building it.
struct EventCounter : YAML::EventHandler {
  long events = 0;
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override { ++events; }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {
    ++events;
  }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    ++events;
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    ++events;
  }
  void OnMapEnd() override {}
};

// The documents in `text` that hold something, counted to 2 at most: yaml-cpp's LoadAll
// never ends on some malformed input (an endless run of documents; found by fuzzing).
int documents_with_content(const std::string& text) {
  std::stringstream in(text);
  YAML::Parser parser(in);
  int found = 0;
  for (int i = 0; i < 2; ++i) {
    EventCounter counter;
    const bool more = parser.HandleNextDocument(counter);
    if (counter.events > 0) ++found;
    if (!more) break;
  }
  return found;
}

// Far above any real job, far below what would strain the YAML parser.
constexpr uintmax_t kMaxJobBytes = 1 << 20;

JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  fail_if<ConfigError>(std::filesystem::is_directory(path, ec),
                       "job file '{}' is a folder; give the job's YAML file", path);
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("cannot read job file '{}'", path));
  const auto bytes = std::filesystem::file_size(path, ec);
  fail_if<ConfigError>(!ec && bytes > kMaxJobBytes, "job file '{}' is {} bytes; a job spec is "
                       "at most {} bytes", path, bytes, kMaxJobBytes);
  const std::string text(std::istreambuf_iterator<char>(in), {});
  YAML::Node root;
  int documents = 0;
  try {
    root = YAML::Load(text);
    documents = documents_with_content(text);
  } catch (const YAML::ParserException& e) {
    throw yaml_error(e, path);
  }
  fail_if<ConfigError>(!root.IsDefined() || root.IsNull(),
                       "job file '{}' is empty; a job names at least its model (model.arch) "
                       "and its data (data.dataset)", path);
  fail_if<ConfigError>(documents > 1,  // the second would be silently ignored
                       "{}: holds more than one YAML document ('---'); a job file is one document",
                       path);
  JobConfig cfg = from_node(root, path, overrides);
  // Defaults fill in the rest, but a job that names neither is almost surely the wrong file.
  for (const char* key : {"model.arch", "data.dataset"}) {
    const std::string k(key), section = k.substr(0, k.find('.')), leaf_key = k.substr(k.find('.') + 1);
    const bool in_file = root.IsMap() && root[section].IsMap() && root[section][leaf_key].IsDefined();
    const bool in_sets = std::any_of(overrides.begin(), overrides.end(), [&](const std::string& o) {
      return o.rfind(k + "=", 0) == 0;
    });
    fail_if<ConfigError>(!in_file && !in_sets, "{}: {} is not set; a job names at least its model "
                         "(model.arch) and its data (data.dataset)", path, key);
  }
  return cfg;
}

std::string to_yaml(const JobConfig& cfg) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  Emitter e{&out};
  const_cast<JobConfig&>(cfg).visit(e);  // visit() is shared with the mutating walkers
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string value_text(const Field& f) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_same_v<T, Ints> || std::is_same_v<T, Names>)
          return fmt::format("[{}]", fmt::join(*p, ", "));
        else if constexpr (std::is_same_v<T, std::string>) return p->empty() ? "\"\"" : *p;
        else return fmt::format("{}", *p);
      },
      f.value);
}

std::string key_reference() {
  JobConfig defaults;
  // The type column: the values a key takes.
  auto type_of = [](const Field& f) -> std::string {
    return std::visit(
        [&](auto* p) -> std::string {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, bool>) return "true \\| false";
          else if constexpr (std::is_same_v<T, int64_t>) return "integer";
          else if constexpr (std::is_same_v<T, double>) return "number";
          else if constexpr (std::is_same_v<T, Ints>) return "list of integers";
          else if constexpr (std::is_same_v<T, Names>)
            return fmt::format("list of: {}", fmt::join(f.choices, " \\| "));
          else return f.choices.empty() ? "text" : fmt::format("{}", fmt::join(f.choices, " \\| "));
        },
        f.value);
  };
  std::string out =
      "# Job keys\n\n"
      "Every key of a job file: its type, its default and what it does. Generated by `dtrain "
      "config --reference` from the key lists in `lib/config/config.hpp`, where the defaults "
      "live; a test fails when this file and the code disagree. Sections are YAML mappings "
      "(`data:`, `model:`, ...); `--set section.key=value` overrides any key.\n";
  std::string section = "-";
  for (const auto& f : fields_of(defaults)) {
    const auto dot = f.key.find('.');
    const std::string here = dot == std::string::npos ? "" : f.key.substr(0, dot);
    if (here != section) {
      section = here;
      out += fmt::format("\n## {}\n\n| key | type | default | meaning |\n|---|---|---|---|\n",
                         here.empty() ? "Top level" : "`" + here + "`");
    }
    out += fmt::format("| `{}` | {} | `{}` | {} |\n", f.key, type_of(f), value_text(f), f.doc);
  }
  return out;
}

void resolve(JobConfig& cfg) {
  if (cfg.run_dir.empty()) cfg.run_dir = "runs/" + cfg.name;
  if (cfg.data.seq_len == 0) cfg.data.seq_len = cfg.model.seq_len;
  if (cfg.data.vocab == 0) cfg.data.vocab = cfg.model.vocab;
}

namespace {

// One range check: the key, the valid range, the value found.
template <class T>
void need(bool ok, const std::string& key, const std::string& rule, const T& value) {
  if (!ok) throw ConfigError(fmt::format("{}: must be {} (got {})", key, rule, value));
}

// "0", "300": digits only, small enough for an int64 step count.
bool whole_number(const std::string& s) {
  return !s.empty() && s.size() <= 18 &&
         std::all_of(s.begin(), s.end(), [](unsigned char ch) { return std::isdigit(ch); });
}

// The job's name and seed, and data.*.
void check_data(const JobConfig& c) {
  // The name becomes a folder (runs/NAME) and a file-name part: nothing that walks out of
  // it, hides it or breaks a shell.
  const bool safe_name =
      !c.name.empty() && c.name.size() <= 128 && c.name[0] != '.' &&
      std::all_of(c.name.begin(), c.name.end(),
                  [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) ||
                                       ch == '.' || ch == '_' || ch == '-'; });
  need(safe_name, "name", "1 to 128 letters, digits, '.', '_' or '-', not starting with '.'",
       fmt::format("'{}'", printable(c.name)));
  need(c.seed >= 0, "seed", ">= 0", c.seed);

  const auto& d = c.data;
  need(d.batch_size >= 1, "data.batch_size", ">= 1", d.batch_size);
  need(d.workers >= 0 && d.workers <= 64, "data.workers", "between 0 and 64", d.workers);
  need(d.prefetch >= 1, "data.prefetch", ">= 1", d.prefetch);
  need(d.dataset == "synthetic" || !d.path.empty(), "data.path", "a folder", "\"\"");
  need(d.samples >= 1, "data.samples", ">= 1", d.samples);
  need(d.test_samples >= 1, "data.test_samples", ">= 1", d.test_samples);
  need(!d.input_shape.empty() && d.input_shape.size() <= 3 &&
           std::all_of(d.input_shape.begin(), d.input_shape.end(), [](int64_t x) { return x > 0; }),
       "data.input_shape", "1 to 3 positive sizes", fmt::format("{}", d.input_shape));
  auto set = d.input_shape;  // the synthetic set: its samples and a test split alike
  set.push_back(std::max(d.samples, d.test_samples));
  need(d.dataset != "synthetic" || addressable(set), "data.input_shape",
       fmt::format("small enough that {} samples of it (data.samples) make a tensor LibTorch "
                   "can address (at most 2^60 values)", std::max(d.samples, d.test_samples)),
       fmt::format("{}", d.input_shape));
  need(d.classes >= 2, "data.classes", ">= 2", d.classes);
  // (The model's own window, copied here by resolve(), is the model's to bound.)
  need(d.seq_len >= 0 && (d.seq_len <= kMaxSeqLen || d.seq_len == c.model.seq_len), "data.seq_len",
       fmt::format("between 0 (model.seq_len) and {}", kMaxSeqLen), d.seq_len);
  // Below 1e-6 one window in a million is held out: 1 / eval_fraction must stay countable.
  need(d.eval_fraction >= 1e-6 && d.eval_fraction <= 0.5, "data.eval_fraction",
       "in [1e-06, 0.5]", d.eval_fraction);
  need(d.vocab >= 0, "data.vocab", ">= 0 (0 = model.vocab)", d.vocab);
  need(d.crop_padding >= 0, "data.crop_padding", ">= 0", d.crop_padding);
  // The model's own keys are the model's to check (models/*.cpp): keys of other archs
  // are not validated against it.
}

// optimizer.*, schedule.*, train.*.
void check_training(const JobConfig& c) {
  const auto& o = c.optimizer;
  need(std::isfinite(o.lr) && o.lr > 0, "optimizer.lr", "> 0", o.lr);
  need(o.momentum >= 0 && o.momentum < 1, "optimizer.momentum", "in [0, 1)", o.momentum);
  need(!o.nesterov || o.momentum > 0, "optimizer.nesterov", "false when momentum is 0", "true");
  need(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "optimizer.weight_decay", ">= 0",
       o.weight_decay);
  need(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1", "in [0, 1)", o.beta1);
  need(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2", "in [0, 1)", o.beta2);
  need(std::isfinite(o.eps) && o.eps > 0, "optimizer.eps", "> 0", o.eps);
  need(std::isfinite(o.grad_clip) && o.grad_clip >= 0, "optimizer.grad_clip", ">= 0 (0 = off)",
       o.grad_clip);
  need(o.label_smoothing >= 0 && o.label_smoothing < 1, "optimizer.label_smoothing", "in [0, 1)",
       o.label_smoothing);
  const auto& s = c.schedule;
  need(s.warmup_steps >= 0, "schedule.warmup_steps", ">= 0", s.warmup_steps);
  need(s.min_lr >= 0 && s.min_lr <= o.lr, "schedule.min_lr", "between 0 and optimizer.lr",
       s.min_lr);
  need(s.step_size >= 1, "schedule.step_size", ">= 1", s.step_size);
  need(s.gamma > 0 && s.gamma <= 1, "schedule.gamma", "in (0, 1]", s.gamma);

  const auto& t = c.train;
  need(t.epochs >= 1, "train.epochs", ">= 1", t.epochs);
  need(t.max_steps >= 0, "train.max_steps", ">= 0 (0 = run train.epochs)", t.max_steps);
  need(t.grad_accum >= 1, "train.grad_accum", ">= 1", t.grad_accum);
  need(t.eval_every >= 0, "train.eval_every", ">= 0 (0 = each epoch)", t.eval_every);
  need(t.eval_batch_size >= 1, "train.eval_batch_size", ">= 1", t.eval_batch_size);
  need(t.eval_samples >= 0, "train.eval_samples", ">= 0 (0 = all)", t.eval_samples);
  need(t.log_every >= 1, "train.log_every", ">= 1", t.log_every);
  need(t.threads >= 0, "train.threads", ">= 0 (0 = automatic)", t.threads);
  need(t.max_skipped >= 1, "train.max_skipped", ">= 1", t.max_skipped);
  need(t.debug_slow_rank >= -1, "train.debug_slow_rank", ">= -1 (-1 = none)", t.debug_slow_rank);
  need(t.debug_slow_ms >= 0, "train.debug_slow_ms", ">= 0", t.debug_slow_ms);
}

// parallel.*, precision.*, dist.*, checkpoint.*.
void check_layout_and_run(const JobConfig& c) {
  const auto& p = c.parallel;
  need(p.data >= 0, "parallel.data", ">= 0 (0 = the rest of the world)", p.data);
  need(p.tensor >= 1, "parallel.tensor", ">= 1", p.tensor);
  need(p.pipeline >= 1, "parallel.pipeline", ">= 1", p.pipeline);
  need(p.virtual_stages >= 1, "parallel.virtual_stages", ">= 1", p.virtual_stages);
  need(p.virtual_stages == 1 || p.schedule == "interleaved_1f1b", "parallel.virtual_stages",
       "1 unless parallel.schedule is interleaved_1f1b", p.virtual_stages);
  need(std::all_of(p.stages.begin(), p.stages.end(), [](int64_t n) { return n >= 1; }),
       "parallel.stages", "a list of positive part counts, one per stage",
       fmt::format("{}", p.stages));
  need(p.zero >= 0 && p.zero <= 3, "parallel.zero", "0, 1, 2 or 3", p.zero);
  need(std::isfinite(p.bucket_mb) && p.bucket_mb > 0, "parallel.bucket_mb", "> 0", p.bucket_mb);
  need(p.topk_ratio > 0 && p.topk_ratio <= 1, "parallel.topk_ratio", "in (0, 1]", p.topk_ratio);
  need(p.powersgd_rank >= 1, "parallel.powersgd_rank", ">= 1", p.powersgd_rank);
  need(p.compression_warmup == "auto" || whole_number(p.compression_warmup),
       "parallel.compression_warmup", "auto or a whole number of steps >= 0",
       printable(p.compression_warmup));
  need(p.servers >= 1, "parallel.servers", ">= 1", p.servers);
  need(p.staleness >= 0, "parallel.staleness", ">= 0", p.staleness);
  need(p.average_every >= 1, "parallel.average_every", ">= 1", p.average_every);
  need(p.local_after >= 0, "parallel.local_after", ">= 0", p.local_after);
  need(std::isfinite(p.outer_lr) && p.outer_lr > 0, "parallel.outer_lr", "> 0", p.outer_lr);
  need(p.outer_momentum >= 0 && p.outer_momentum < 1, "parallel.outer_momentum", "in [0, 1)",
       p.outer_momentum);

  const auto& pr = c.precision;
  if (pr.loss_scale != "dynamic") {
    double v = 0;
    try {
      size_t used = 0;
      v = std::stod(pr.loss_scale, &used);
      if (used != pr.loss_scale.size()) v = 0;
    } catch (const std::exception&) {
    }
    need(std::isfinite(v) && v > 0, "precision.loss_scale", "'dynamic' or a positive number",
         fmt::format("'{}'", pr.loss_scale));
  }
  // c10d keeps timeouts in milliseconds; 30 days is far past any real wait.
  need(c.dist.timeout_s >= 1 && c.dist.timeout_s <= 30 * 86400, "dist.timeout_s",
       "between 1 and 2592000 (30 days)", c.dist.timeout_s);
  need(c.dist.hang_report_s >= 0 && c.dist.hang_report_s <= 30 * 86400, "dist.hang_report_s",
       "between 0 (never) and 2592000 (30 days)", c.dist.hang_report_s);
  need(c.fault_tolerance.heartbeat_s >= 1 && c.fault_tolerance.heartbeat_s <= 3600,
       "fault_tolerance.heartbeat_s", "between 1 and 3600", c.fault_tolerance.heartbeat_s);
  need(c.fault_tolerance.replica_data >= 1, "fault_tolerance.replica_data", "at least 1",
       c.fault_tolerance.replica_data);
  need(c.dist.port >= 0 && c.dist.port <= 65535, "dist.port", "between 0 (automatic) and 65535",
       c.dist.port);
  need(c.dist.gloo_threads >= 1 && c.dist.gloo_threads <= 64, "dist.gloo_threads",
       "between 1 and 64", c.dist.gloo_threads);
  need(c.checkpoint.every_steps >= 0, "checkpoint.every_steps", ">= 0 (0 = each epoch)",
       c.checkpoint.every_steps);
  need(c.checkpoint.keep_last >= 1, "checkpoint.keep_last", ">= 1", c.checkpoint.keep_last);
  need(c.checkpoint.debug_write_delay_ms >= 0, "checkpoint.debug_write_delay_ms", ">= 0",
       c.checkpoint.debug_write_delay_ms);
}

}  // namespace

void check_ranges(const JobConfig& c) {
  check_data(c);
  check_training(c);
  check_layout_and_run(c);
}

}  // namespace dtrain
