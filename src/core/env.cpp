#include "xlr8/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "xlr8/error.hpp"

extern "C" char** environ;  // as unistd.h declares it (C linkage), whichever comes first

namespace xlr8 {

Env Env::current() {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) vars.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return Env(std::move(vars));
}

std::optional<std::string> env_var(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (!value || !*value) return std::nullopt;
  return std::string(value);
}

std::optional<std::string> Env::get(const std::string& name) const {
  auto it = vars_.find(name);
  if (it == vars_.end()) return std::nullopt;
  return it->second;
}

std::optional<long> Env::get_int(const std::string& name) const {
  auto v = get(name);
  if (!v || v->empty()) return std::nullopt;
  try {
    size_t used = 0;
    long value = std::stol(*v, &used);
    if (used == v->size()) return value;
  } catch (const std::exception&) {
  }
  throw ConfigError(fmt::format("environment variable {}={:?} is not an integer; set it to a whole number or unset it",
                                name, *v));
}

long Env::get_positive(const std::string& name, long fallback) const {
  long v = get_int(name).value_or(fallback);
  if (v < 1) throw ConfigError(fmt::format("environment variable {}={} must be at least 1", name, v));
  return v;
}

std::optional<bool> Env::get_bool(const std::string& name) const {
  auto v = get(name);
  if (!v || v->empty()) return std::nullopt;
  if (auto b = parse_bool(*v)) return b;
  throw ConfigError(fmt::format("environment variable {}={:?} is not a boolean; use true/false (or 1/0)", name, *v));
}

std::optional<long> Env::first_int(std::initializer_list<const char*> names) const {
  for (const char* n : names)
    if (auto v = get_int(n)) return v;
  return std::nullopt;
}

std::optional<bool> parse_bool(const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  // Accelerate's str_to_bool spellings.
  if (t == "true" || t == "1" || t == "yes" || t == "y" || t == "t" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "n" || t == "f" || t == "off") return false;
  return std::nullopt;
}

}  // namespace xlr8
