#pragma once
// The `xlr8` command line over a set of subcommands: parsing, the mistyped-command suggestion, launch-style
// argument splitting, and errors printed as "xlr8: error: ...". Shared by the launcher binary (`xlr8`: launch,
// trace; no LibTorch) and the full one (every command).
#include <vector>

#include "cli/commands.hpp"

namespace xlr8::cli {

using AddCommand = Handler (*)(CLI::App&);

int run_cli(int argc, char** argv, const std::vector<AddCommand>& commands);

}  // namespace xlr8::cli
