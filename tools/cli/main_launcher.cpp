// xlr8: `launch` and `trace` run here, in a program that does not load LibTorch (loading Debian's takes
// 0.5-0.9 s before main, on every launch); every other command is handed, arguments unchanged, to xlr8-full
// beside this program (the build tree) or in libexec/xlr8 (an install).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/cli_main.hpp"

namespace {

// Where xlr8-full may be: beside this program (the build tree), where an install puts it relative to this one,
// and where this build installs it (a copied `xlr8`). Never relative to the current folder.
std::vector<std::filesystem::path> full_program_places() {
  std::vector<std::filesystem::path> places;
  char buffer[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n > 0 && n < static_cast<ssize_t>(sizeof(buffer) - 1)) {
    const auto dir = std::filesystem::path(std::string(buffer, static_cast<size_t>(n))).parent_path();
    places.push_back(dir / "xlr8-full");
    places.push_back((dir / XLR8_FULL_FROM_BIN).lexically_normal());
  }
  places.emplace_back(XLR8_FULL_INSTALLED);
  return places;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "launch" || command == "trace")
    return xlr8::cli::run_cli(argc, argv, {xlr8::cli::add_launch, xlr8::cli::add_trace});
  const auto places = full_program_places();
  for (const auto& full : places)
    if (access(full.c_str(), X_OK) == 0) {
      execv(full.c_str(), argv);
      fmt::print(stderr, "xlr8: error: cannot run {}: {}\n", full.string(), std::strerror(errno));
      return 1;
    }
  std::vector<std::string> tried;
  for (const auto& p : places) tried.push_back(p.string());
  fmt::print(stderr, "xlr8: error: xlr8-full, which runs every command but launch and trace, is not in {}; reinstall "
                     "xlr8\n",
             fmt::join(tried, ", "));
  return 1;
}
