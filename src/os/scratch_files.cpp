#include "os/scratch_files.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <mutex>

namespace xlr8::os {

namespace {

// A fixed table the handler can read without locks or allocation (async-signal-safe: atomics and unlink only).
struct Slot {
  std::atomic<bool> taken{false};  // claimed by an owner
  std::atomic<bool> ready{false};  // its path is written and may be removed
  char path[PATH_MAX] = {};
};
constexpr int kSlots = 64;
Slot g_slots[kSlots];

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP};
struct sigaction g_previous[std::size(kSignals)];

void remove_held_files(int signal_number) {
  const int saved_errno = errno;  // a previous handler that lets the process go on finds errno as it was
  for (auto& slot : g_slots)
    if (slot.ready.load()) ::unlink(slot.path);
  for (size_t i = 0; i < std::size(kSignals); ++i)
    if (kSignals[i] == signal_number) ::sigaction(signal_number, &g_previous[i], nullptr);
  ::raise(signal_number);  // pending until this handler returns: then the previous handler, or the default end
  errno = saved_errno;
}

void install_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_handler = remove_held_files;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      ::sigaction(kSignals[i], nullptr, &g_previous[i]);
      if (g_previous[i].sa_handler == SIG_IGN) continue;  // ignored (nohup): stays ignored
      ::sigaction(kSignals[i], &action, nullptr);
    }
  });
}

}  // namespace

RemovedOnTermination::RemovedOnTermination(const std::filesystem::path& path) {
  std::error_code unknown;  // the working directory may change before the signal: held as an absolute path
  const std::string text = std::filesystem::absolute(path, unknown).native();
  if (unknown) return;
  if (text.size() >= PATH_MAX) return;
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (!g_slots[i].taken.compare_exchange_strong(expected, true)) continue;
    std::memcpy(g_slots[i].path, text.c_str(), text.size() + 1);
    g_slots[i].ready.store(true);
    slot_ = i;
    install_handler();
    return;
  }
}

RemovedOnTermination::~RemovedOnTermination() {
  if (slot_ < 0) return;
  g_slots[slot_].ready.store(false);
  g_slots[slot_].taken.store(false);
}

}  // namespace xlr8::os
