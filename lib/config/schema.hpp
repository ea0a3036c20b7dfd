// Reading, overriding, printing and checking a JobConfig. The keys and their types come
// from the visit() lists in config.hpp; nothing here knows a default.
#pragma once
#include <string>
#include <variant>
#include <vector>

#include "config/config.hpp"

namespace dtrain {

// One leaf key of the job spec, e.g. "data.batch_size", pointing into a JobConfig.
struct Field {
  std::string key;
  std::variant<bool*, int64_t*, double*, std::string*, Ints*, Names*> value;
  Choices choices;  // non-empty for enum-like string keys (and each of a Names' items)
  std::string doc;  // what it means (config.hpp's visit())
};

std::vector<Field> fields_of(JobConfig& cfg);
std::vector<std::string> all_keys();

// Defaults, then the YAML file, then each "dotted.key=value" override, in order.
// Throws ConfigError naming the file, line and column or the --set argument.
JobConfig load_job(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text (tests, checkpoints); `origin` names it in messages.
JobConfig parse_job(const std::string& yaml_text, const std::string& origin,
                    const std::vector<std::string>& overrides = {});
void apply_override(JobConfig& cfg, const std::string& assignment);

// The closest known key to `key`, or "" when nothing is close.
std::string nearest_key(const std::string& key);

// The fully resolved job as YAML (every key, defaults filled), readable by load_job.
std::string to_yaml(const JobConfig& cfg);

// A field's value as a job file writes it: true, 3, 0.05, [512, 256], fashion_mnist, "".
std::string value_text(const Field& f);

// Every key with its type, default and meaning, as Markdown (docs/keys.md).
std::string key_reference();

// Fills derived values the spec leaves open (run_dir from name; token windows and
// synthetic vocabulary from the model's).
void resolve(JobConfig& cfg);

// Every range and enum check that needs the job spec alone. Throws ConfigError with a
// message that names the key and what would be valid. (validate() in job/validate.hpp
// adds what needs the models, the devices and the world size.)
void check_ranges(const JobConfig& cfg);

}  // namespace dtrain
