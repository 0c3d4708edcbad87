#pragma once
// What the disk tier's unit tests share: a swap directory of the test's own (on the build's file system, where O_DIRECT
// works), and the options that put the optimizer's state (and parameters) there.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "zero_fixture.hpp"

namespace xlr8::testing::zero {

// A directory of this test's own beside the build's files (ext4 here: O_DIRECT works).
inline std::filesystem::path swap_dir(const std::string& name) {
  auto dir = std::filesystem::current_path() / fmt::format("zero_disk_{}_{}", ::getpid(), name);
  std::filesystem::remove_all(dir);
  return dir;
}

inline bool direct_io_works(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const auto probe = dir / "probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) ::close(fd);
  std::filesystem::remove(probe);
  return fd >= 0;
}

inline ParallelOptions on_disk(int stage, const std::filesystem::path& dir, bool pipelined = true, bool params = false) {
  auto o = stage_options(stage);
  o.zero.optimizer_on_disk.path = dir.string();
  o.zero.optimizer_on_disk.read_ahead = o.zero.optimizer_on_disk.write_behind = pipelined;
  if (params) o.zero.params_on_disk.path = dir.string();
  return o;
}

}  // namespace xlr8::testing::zero
