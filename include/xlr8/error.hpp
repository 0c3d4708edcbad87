#pragma once
// xlr8::Error: the one exception type library code throws. Library code never exits.
#include <stdexcept>
#include <string>

namespace xlr8 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A collective or rendezvous wait that ran out of time.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// Invalid configuration: a key, an environment variable or a command-line flag.
class ConfigError : public Error {
 public:
  using Error::Error;
};

}  // namespace xlr8
