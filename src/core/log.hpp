#pragma once
// The one way library code reports: a line on stderr, shown when its level is at or above
// XLR8_LOG_LEVEL (else ACCELERATE_LOG_LEVEL): debug, info (the default), warning, error. Outside
// `xlr8 launch` (which prefixes worker output itself) lines carry "[rank R] " once the rank is known.
#include <fmt/format.h>

#include <string_view>
#include <utility>

namespace xlr8::log {

enum class Level { DEBUG = 0, INFO = 1, WARNING = 2, ERROR = 3 };

bool enabled(Level level);
// ProcessState sets it when it knows where this process sits.
void set_rank(int rank, int world_size);
void write(Level level, std::string_view message);

template <class... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::INFO)) write(Level::INFO, fmt::format(format, std::forward<Args>(args)...));
}
template <class... Args>
void warning(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::WARNING)) write(Level::WARNING, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace xlr8::log
