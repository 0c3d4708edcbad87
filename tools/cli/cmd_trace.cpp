// `xlr8 trace DIR`: the launcher's hang diagnosis, from flight-recorder dumps on disk (<log_dir>/attempt_<n>/trace
// after a failed `xlr8 launch --log_dir`, or dumps a job wrote into its own XLR8_TRACE_DIR).
#include <fmt/format.h>

#include <filesystem>

#include "cli/commands.hpp"
#include "launch/trace_diagnosis.hpp"
#include "xlr8/error.hpp"

namespace xlr8::cli {

Handler add_trace(CLI::App& app) {
  auto* cmd = app.add_subcommand("trace", "Say which rank was in which collective, from flight-recorder dumps");
  auto dir = std::make_shared<std::string>();
  auto world_size = std::make_shared<int>(0);
  cmd->add_option("dir", *dir, "Folder with rank<R>.json dumps (e.g. <log_dir>/attempt_0/trace)")->required();
  cmd->add_option("--world_size", *world_size, "Ranks the job had, to name those that left no dump (default: the dumps')")
      ->check(number_in(0, true));
  return [dir, world_size] {
    if (!std::filesystem::is_directory(*dir)) throw Error(fmt::format("xlr8 trace: {:?} is not a folder", *dir));
    const auto diagnosis = launcher::diagnose_traces(*dir, {.world_size = *world_size});
    if (diagnosis.empty()) throw Error(fmt::format("xlr8 trace: no rank<R>.json dump in {}", *dir));
    fmt::print("{}\n", diagnosis);
    return 0;
  };
}

}  // namespace xlr8::cli
