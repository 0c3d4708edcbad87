// A key written twice in one mapping: yaml-cpp reads the first value and PyYAML (so Accelerate) the last, so a
// file whose two values differ is refused, and one whose values agree loads once.
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <map>
#include <set>
#include <string>

#include "config/config_section.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

// A mapping key as the repeated-key checks compare it: its text, or (a key that is itself a list or map) its YAML.
std::string key_text(const YAML::Node& key) { return key.IsScalar() ? key.Scalar() : YAML::Dump(key); }

}  // namespace

void config::refuse_repeated_keys(const YAML::Node& node, const std::string& origin, const std::string& prefix) {
  if (node.IsSequence()) {  // a list's mappings too: `- {a: 1, a: 2}`
    const auto list = prefix.ends_with('.') ? prefix.substr(0, prefix.size() - 1) : prefix;  // x.[0] reads x[0]
    for (size_t i = 0; i < node.size(); ++i) refuse_repeated_keys(node[i], origin, fmt::format("{}[{}].", list, i));
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, std::pair<int, std::string>> first;  // key -> its line and value, as first written
  for (const auto& kv : node) {
    const auto key = key_text(kv.first);
    const int line = kv.first.Mark().line + 1;
    const auto value = YAML::Dump(kv.second);
    if (const auto [it, fresh] = first.emplace(key, std::pair{line, value}); !fresh && it->second.second != value)
      throw ConfigError(fmt::format("{}: key {}{} is written twice with different values (lines {} and {}); keep one",
                                    origin, prefix, key, it->second.first, line));
    refuse_repeated_keys(kv.second, origin, prefix + key + ".");
  }
}

YAML::Node config::without_repeated_keys(const YAML::Node& node) {
  if (node.IsSequence()) {
    YAML::Node out(YAML::NodeType::Sequence);
    for (const auto& item : node) out.push_back(without_repeated_keys(item));
    return out;
  }
  if (!node.IsMap()) return node;
  YAML::Node out(YAML::NodeType::Map);
  std::set<std::string> seen;
  for (const auto& kv : node) {
    if (!seen.insert(key_text(kv.first)).second) continue;
    if (kv.first.IsScalar()) out[kv.first.Scalar()] = without_repeated_keys(kv.second);
    else out[kv.first] = without_repeated_keys(kv.second);
  }
  return out;
}


}  // namespace xlr8
