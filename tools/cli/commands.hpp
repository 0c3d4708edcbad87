#pragma once
// Subcommands of the `xlr8` CLI. Each registers its options on `app` and returns the handler to run.
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace xlr8 {
struct LaunchRequest;
}

namespace xlr8::cli {

using Handler = std::function<int()>;

Handler add_launch(CLI::App& app);
// Every `xlr8 launch` option, registered on `cmd` (launch, verify), filling `req`.
void add_launch_options(CLI::App* cmd, const std::shared_ptr<LaunchRequest>& req);
Handler add_verify(CLI::App& app);
Handler add_advise(CLI::App& app);
// `xlr8 launch` arguments (after "launch") with a `--` placed where the program starts: at the first
// word that is neither a launcher option nor an option's value, or after the user's own `--`. What
// follows is the program's, even words that look like launcher options. An unknown option before the
// program is a ConfigError naming the closest launcher option.
std::vector<std::string> normalize_launch_args(const CLI::App& launch, const std::vector<std::string>& args);
Handler add_config(CLI::App& app);
Handler add_env(CLI::App& app);
Handler add_test(CLI::App& app);
Handler add_merge_weights(CLI::App& app);
Handler add_estimate_memory(CLI::App& app);
Handler add_plot(CLI::App& app);
Handler add_trace(CLI::App& app);
// The worker side of `xlr8 test`.
Handler add_selftest_worker(CLI::App& app);

// A number option's bounds, said plainly: "must be above 0" (CLI11's own ranges print the largest double).
inline CLI::Validator number_in(double low, bool low_included, double high = 1e300) {
  return CLI::Validator(
      [=](std::string& text) {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (!text.empty() && *end == '\0' && (low_included ? v >= low : v > low) && v <= high) return std::string();
        return "must be " + std::string(low_included ? "at least " : "above ") + CLI::detail::to_string(low) +
               (high < 1e300 ? " and at most " + CLI::detail::to_string(high) : "") + ", not " + text;
      },
      "");
}

}  // namespace xlr8::cli
