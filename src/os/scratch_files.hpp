#pragma once
// Scratch files (offload's swap files) removed when a signal stops the process: the launcher stops the other
// ranks with SIGTERM when one fails, and Ctrl-C sends SIGINT, neither of which runs destructors. SIGKILL
// cannot be caught; its files are found stale by the next job (swap_directory.hpp).
#include <filesystem>

namespace xlr8::os {

// Holds `path` for removal if SIGTERM, SIGINT or SIGHUP ends the process, until destroyed. The handler (installed
// with the first file, once) removes every held file, then lets the signal do what it did before: the
// previous handler, or the default end.
class RemovedOnTermination {
 public:
  explicit RemovedOnTermination(const std::filesystem::path& path);
  ~RemovedOnTermination();
  RemovedOnTermination(const RemovedOnTermination&) = delete;
  RemovedOnTermination& operator=(const RemovedOnTermination&) = delete;

 private:
  int slot_ = -1;  // -1: every slot taken (the file is then only removed by its owner or the next job)
};

}  // namespace xlr8::os
