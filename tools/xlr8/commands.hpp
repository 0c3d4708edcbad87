#pragma once
// Subcommands of the `xlr8` CLI. Each registers its options on `app` and returns the handler to run.
#include <CLI/CLI.hpp>

#include <functional>

namespace xlr8::cli {

using Handler = std::function<int()>;

Handler add_launch(CLI::App& app);
Handler add_config(CLI::App& app);
Handler add_env(CLI::App& app);
Handler add_test(CLI::App& app);
// The worker side of `xlr8 test`.
Handler add_selftest_worker(CLI::App& app);

}  // namespace xlr8::cli
