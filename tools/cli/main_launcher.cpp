// xlr8: `launch` and `trace` run here, in a program that does not load LibTorch (loading Debian's takes
// 0.5-0.9 s before main, on every launch); every other command is handed, arguments unchanged, to xlr8-full
// beside this program (the build tree) or in ../libexec/xlr8 (an install).
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <string>

#include "cli/cli_main.hpp"

namespace {

std::filesystem::path full_program() {
  char buffer[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  const std::filesystem::path self = n > 0 ? std::filesystem::path(std::string(buffer, static_cast<size_t>(n))) : "";
  for (const auto& candidate : {self.parent_path() / "xlr8-full", self.parent_path() / "../libexec/xlr8/xlr8-full"})
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "launch" || command == "trace")
    return xlr8::cli::run_cli(argc, argv, {xlr8::cli::add_launch, xlr8::cli::add_trace});
  const auto full = full_program();
  if (full.empty()) {
    fmt::print(stderr, "xlr8: error: xlr8-full, which runs every command but launch and trace, is neither beside this "
                       "program nor in ../libexec/xlr8; reinstall xlr8\n");
    return 1;
  }
  execv(full.c_str(), argv);
  fmt::print(stderr, "xlr8: error: cannot run {}: {}\n", full.string(), std::strerror(errno));
  return 1;
}
