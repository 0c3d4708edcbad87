#include "core/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/text.hpp"
#include "xlr8/env.hpp"

namespace xlr8::log {
namespace {

std::atomic<int> g_rank{-1};

Level threshold() {
  // Read once: the level is a property of the run.
  static const Level level = [] {
    const std::string name = text::lower(env_var("XLR8_LOG_LEVEL").value_or(env_var("ACCELERATE_LOG_LEVEL").value_or("")));
    if (name == "debug") return Level::kDebug;
    if (name == "warning" || name == "warn") return Level::kWarning;
    if (name == "error" || name == "critical") return Level::kError;
    return Level::kInfo;
  }();
  return level;
}

}  // namespace

bool enabled(Level level) { return level >= threshold(); }

void set_rank(int rank, int world_size) {
  g_rank = world_size > 1 && !env_var("XLR8_LAUNCHED") ? rank : -1;
}

void write(Level level, std::string_view message) {
  if (!enabled(level)) return;
  int rank = g_rank;
  std::string line = rank >= 0 ? fmt::format("[rank {}] {}\n", rank, message) : fmt::format("{}\n", message);
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of concurrent threads do not interleave
  std::fflush(stderr);
}

}  // namespace xlr8::log
