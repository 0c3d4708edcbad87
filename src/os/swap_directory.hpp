#pragma once
// The directory of offload's swap files (an nvme_path), which the ranks of a machine share and other jobs may too.
// Each live swap file is locked by the process that made it (os::SwapFile holds an flock for its life); a file
// nobody locks was left by a process that died without removing it (kill -9 runs no destructor). Whoever claims a
// new file there first removes those, under the directory's own lock, so that two claims never race.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace xlr8::os {

// The kind of network file system `dir` lies on ("nfs", "cifs", "lustre", ...), empty for a local one. Such a
// directory may be shared by other machines, and its flock may be each client's own (NFS's local_lock), so that
// another machine's live swap file would look stale here.
std::string network_file_system(const std::filesystem::path& dir);

class SwapDirectoryClaim {
 public:
  // Creates `dir` when missing, takes its lock (waiting up to `wait_s` for another process's claim; Error naming the
  // directory then) and removes the stale swap files in it, saying so in the log. On a directory other machines may
  // share (`shared`; by default when network_file_system(dir) names one) only this machine's files are judged: a
  // file's name carries the host that made it.
  explicit SwapDirectoryClaim(const std::filesystem::path& dir, double wait_s = 60, std::optional<bool> shared = {});
  ~SwapDirectoryClaim();  // releases the lock: create the new file (SwapFile) before
  SwapDirectoryClaim(const SwapDirectoryClaim&) = delete;
  SwapDirectoryClaim& operator=(const SwapDirectoryClaim&) = delete;

  // A name no live file has: <dir>/xlr8-<stem>-<pid>-<random>-<n>@<host>.swap.
  std::filesystem::path new_file(const std::string& stem) const;
  // The stale files removed, and their bytes.
  const std::vector<std::filesystem::path>& removed() const { return removed_; }
  int64_t removed_bytes() const { return removed_bytes_; }

 private:
  void remove_stale_files(bool shared);
  std::filesystem::path dir_;
  int lock_fd_ = -1;
  std::vector<std::filesystem::path> removed_;
  int64_t removed_bytes_ = 0;
};

}  // namespace xlr8::os
