#pragma once
// Reading process environment variables through a replaceable map, so parsing is testable.
#include <map>
#include <optional>
#include <string>

namespace xlr8 {

// A snapshot of environment variables. `Env::current()` reads `environ`.
class Env {
 public:
  Env() = default;
  explicit Env(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}
  Env(std::initializer_list<std::pair<const std::string, std::string>> vars) : vars_(vars) {}
  static Env current();

  std::optional<std::string> get(const std::string& name) const;
  bool has(const std::string& name) const { return vars_.count(name) != 0; }
  // Typed reads: the error names the variable, its value and what is allowed.
  std::optional<long> get_int(const std::string& name) const;
  std::optional<bool> get_bool(const std::string& name) const;
  // An integer of at least 1, or `fallback` when unset.
  long get_positive(const std::string& name, long fallback) const;
  // First variable among `names` that is set, as an integer.
  std::optional<long> first_int(std::initializer_list<const char*> names) const;

  void set(const std::string& name, const std::string& value) { vars_[name] = value; }
  const std::map<std::string, std::string>& vars() const { return vars_; }

 private:
  std::map<std::string, std::string> vars_;
};

// The process's variable `name`, read now; nullopt when it is unset or empty. With Env::current() (a snapshot, for
// reading sets of variables), the only way xlr8 reads its environment.
std::optional<std::string> env_var(const std::string& name);

// Parses true/false spellings used by Accelerate ("true", "1", "yes", "on" ...); nullopt otherwise.
std::optional<bool> parse_bool(const std::string& text);

}  // namespace xlr8
