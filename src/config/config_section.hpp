#pragma once
// One mapping of an Accelerate-format config file, read with checks: unknown keys name the closest
// valid one, wrong types and values name the full key path, the value and what is allowed.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/text.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"

namespace xlr8::config {

// ConfigError "<what>: invalid value "v"; allowed: ..." unless `value` is one of `allowed` (a variable's value).
void check_choice(const std::string& value, const std::vector<std::string>& allowed, const std::string& what);
// FSDP's state dict type by name (any case), or by torch's StateDictType value as Accelerate also reads it (1 FULL,
// 2 LOCAL, 3 SHARDED); a ConfigError naming `what` otherwise.
std::string state_dict_type_of(const std::string& value, const std::string& what);
// parallelism_config_pp_schedule's values, lower-case, and torch's spelling of each ("1f1b" -> "1F1B").
const std::vector<std::string>& pp_schedules();
std::string pp_schedule_spelling(const std::string& lower);

// One mapping of the YAML file: checks unknown keys and types, naming the full key path.
class Section {
 public:
  Section(const YAML::Node& node, std::string prefix, std::string origin)
      : node_(node), prefix_(std::move(prefix)), origin_(std::move(origin)) {
    if (node_ && !node_.IsNull() && !node_.IsMap())  // named once: where() would add the prefix to itself
      throw ConfigError(fmt::format("{}: {} must be a mapping of key: value{}", origin_,
                                    prefix_.empty() ? "the file" : prefix_.substr(0, prefix_.size() - 1),
                                    node_.IsScalar() ? fmt::format(", not {:?}", node_.Scalar()) : ""));
  }

  // Each key that is neither known nor ignored, as "unknown key "k" (did you mean "h"?)".
  std::vector<std::string> unknown_keys(const std::vector<std::string>& known, const std::vector<std::string>& ignored,
                                        std::vector<std::string>* ignored_seen) const {
    std::vector<std::string> unknown;
    if (!node_ || node_.IsNull()) return unknown;
    for (const auto& kv : node_) {
      auto key = kv.first.as<std::string>();
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
        if (ignored_seen) ignored_seen->push_back(prefix_ + key);
        continue;
      }
      std::vector<std::string> all = known;
      all.insert(all.end(), ignored.begin(), ignored.end());
      std::string hint = text::closest(key, all);
      unknown.push_back(fmt::format("unknown key {:?}{}", prefix_ + key,
                                    hint.empty() ? fmt::format(" (valid keys: {})", text::join(known))
                                                 : fmt::format(" (did you mean {:?}?)", prefix_ + hint)));
    }
    return unknown;
  }
  void check_keys(const std::vector<std::string>& known, const std::vector<std::string>& ignored,
                  std::vector<std::string>* ignored_seen) const {
    refuse_unknown(unknown_keys(known, ignored, ignored_seen));
  }
  // Every unknown key of a file in one error, so that two typos take one attempt to fix.
  void refuse_unknown(const std::vector<std::string>& unknown) const {
    if (!unknown.empty()) throw ConfigError(fmt::format("{}: {}", origin_, fmt::join(unknown, "; ")));
  }

  bool has(const std::string& key) const { return node_ && node_.IsMap() && node_[key] && !node_[key].IsNull(); }
  YAML::Node child(const std::string& key) const { return has(key) ? node_[key] : YAML::Node(); }
  const std::string& prefix() const { return prefix_; }
  const std::string& origin() const { return origin_; }

  // True when `key` leaves its feature off: absent, null, false/"no", "" or a list of only "" (as
  // `accelerate config` writes tpu_env: [] and tpu_vm: ['']).
  bool is_off(const std::string& key) const {
    if (!has(key)) return true;
    auto n = node_[key];
    if (n.IsSequence()) {
      for (const auto& item : n)
        if (!item.IsScalar() || !item.Scalar().empty()) return false;
      return true;
    }
    if (n.IsMap()) return n.size() == 0;
    return n.Scalar().empty() || parse_bool(n.Scalar()) == false;
  }
  // The value as one line of YAML, for messages.
  std::string shown(const std::string& key) const {
    if (!has(key)) return "null";
    YAML::Emitter out;
    out << YAML::Flow << node_[key];
    return out.c_str();
  }

  std::optional<std::string> str(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    auto n = node_[key];
    if (!n.IsScalar()) throw error(key, "must be a single value, not a list or mapping");
    return n.Scalar();
  }
  std::optional<long> integer(const std::string& key, long min, long max) const {
    auto s = str(key);
    if (!s) return std::nullopt;
    long v = 0;
    try {
      size_t used = 0;
      v = std::stol(*s, &used);
      if (used != s->size()) throw std::invalid_argument("trailing");
    } catch (const std::exception&) {
      throw error(key, fmt::format("value {:?} is not an integer", *s));
    }
    if (v < min || v > max) throw error(key, fmt::format("value {} is out of range [{}, {}]", v, min, max));
    return v;
  }
  std::optional<double> number(const std::string& key) const {
    auto s = str(key);
    if (!s || *s == "auto") return std::nullopt;
    try {
      size_t used = 0;
      double v = std::stod(*s, &used);
      if (used == s->size()) return v;
    } catch (const std::exception&) {
    }
    throw error(key, fmt::format("value {:?} is not a number", *s));
  }
  std::optional<bool> boolean(const std::string& key) const {
    auto s = str(key);
    if (!s) return std::nullopt;
    if (auto b = parse_bool(*s)) return b;
    throw error(key, fmt::format("value {:?} is not a boolean; use true or false", *s));
  }
  std::optional<std::string> choice(const std::string& key, const std::vector<std::string>& allowed, bool upper) const {
    auto s = str(key);
    if (!s) return std::nullopt;
    std::string v = upper ? text::upper(*s) : text::lower(*s);
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return v;
    throw error(key, fmt::format("value {:?} is not allowed; allowed: {}{}", *s, text::join(allowed),
                                 text::suggestion(*s, allowed)));
  }
  std::vector<std::string> list(const std::string& key) const {
    if (!has(key)) return {};
    auto n = node_[key];
    if (n.IsScalar()) return text::split(n.Scalar(), ',');
    if (!n.IsSequence()) throw error(key, "must be a list or a comma-separated string");
    std::vector<std::string> out;
    for (const auto& item : n) out.push_back(item.as<std::string>());
    return out;
  }
  ConfigError error(const std::string& key, const std::string& why) const {
    return ConfigError(fmt::format("{}: {}", where(key), why));
  }
  // "<file>: <section.key>", how messages about a key begin.
  std::string where(const std::string& key) const { return fmt::format("{}: {}", origin_, prefix_ + key); }

 private:
  YAML::Node node_;
  std::string prefix_;
  std::string origin_;
};

// A key written twice in one mapping (at any depth) with different values is refused naming it and its lines: yaml-cpp
// would read the first and PyYAML (so Accelerate) the last, and the file would mean two things. The same value twice
// (as in Accelerate's own test files) means one thing and loads.
void refuse_repeated_keys(const YAML::Node& node, const std::string& origin, const std::string& prefix = "");
// The same mapping with each key once (its first entry), at any depth: so that setting a key sets its one entry.
YAML::Node without_repeated_keys(const YAML::Node& node);

}  // namespace xlr8::config
