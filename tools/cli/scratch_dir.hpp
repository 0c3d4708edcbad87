#pragma once
// The temporary folders of verify and advise: one per command, removed with everything in it when the command
// ends (an empty path: nothing is created or removed, for a folder the user asked to keep).
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

namespace xlr8::cli {

class ScratchDir {
 public:
  // <temp>/xlr8-<tag>-<pid>-<random>, not created yet.
  explicit ScratchDir(const std::string& tag) {
    std::random_device random;
    path_ = std::filesystem::temp_directory_path() / fmt::format("xlr8-{}-{}-{:08x}", tag, ::getpid(), random());
  }
  ScratchDir() = default;  // none
  ~ScratchDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The workers' recorders (src/train/verify_recorder, advise_recorder) write <dir>/done.<rank> once their steps are
// recorded: true when all `ranks` have.
inline bool every_rank_done(const std::filesystem::path& dir, int ranks) {
  for (int r = 0; r < ranks; ++r)
    if (!std::filesystem::exists(dir / fmt::format("done.{}", r))) return false;
  return true;
}

}  // namespace xlr8::cli
