#pragma once
// The one way library code reports: a line on stderr, shown when its level is at or above
// XLR8_LOG_LEVEL (else ACCELERATE_LOG_LEVEL): debug, info (the default), warning, error. Outside
// `xlr8 launch` (which prefixes worker output itself) lines carry "[rank R] " once the rank is known.
#include <fmt/format.h>

#include <string_view>
#include <utility>

namespace xlr8::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

bool enabled(Level level);
// ProcessState sets it when it knows where this process sits.
void set_rank(int rank, int world_size);
void write(Level level, std::string_view message);

template <class... Args>
void debug(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, fmt::format(format, std::forward<Args>(args)...));
}
template <class... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, fmt::format(format, std::forward<Args>(args)...));
}
template <class... Args>
void warning(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::kWarning)) write(Level::kWarning, fmt::format(format, std::forward<Args>(args)...));
}

template <class... Args>
void error(fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::kError)) write(Level::kError, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace xlr8::log
