// The `xlr8` command line over a set of subcommands (cli_main.hpp).
#include "cli/cli_main.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::cli {

namespace {

// CLI11's "Could not convert: --port = abc" as one line naming the option, the value and what it takes.
std::string conversion_message(const CLI::App& app, const std::string& what) {
  const std::string prefix = "Could not convert: ";
  const auto equals = what.find(" = ");
  if (what.rfind(prefix, 0) != 0 || equals == std::string::npos) return what;
  const auto name = what.substr(prefix.size(), equals - prefix.size());
  const auto value = what.substr(equals + 3);
  const CLI::Option* option = nullptr;
  std::string command = "";
  for (const auto* sub : app.get_subcommands(nullptr))
    if (sub->parsed() && (option = sub->get_option_no_throw(name))) command = sub->get_name();
  std::string type = option ? option->get_type_name() : "";
  type = type.substr(0, type.find(':'));  // "INT:N|auto|cpu|gpu": the type, then the validator's description
  const std::string takes = type == "INT" || type == "UINT" ? "a whole number"
                            : type == "FLOAT"               ? "a number"
                            : type.empty()                  ? "another kind of value"
                                                            : type;
  return fmt::format("{} takes {}, not {:?}; `xlr8 {} --help` lists what each option takes", name, takes, value,
                     command.empty() ? std::string("<command>") : command);
}

}  // namespace

int run_cli(int argc, char** argv, const std::vector<AddCommand>& commands) {
  CLI::App app{"xlr8: distributed training for LibTorch", "xlr8"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("xlr8 ") + XLR8_VERSION);
  std::vector<std::pair<CLI::App*, Handler>> handlers;
  auto reg = [&](AddCommand add) {
    size_t before = app.get_subcommands(nullptr).size();
    auto handler = add(app);
    handlers.emplace_back(app.get_subcommands(nullptr)[before], handler);
  };
  for (auto add : commands) reg(add);
  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (!args.empty() && !args[0].empty() && args[0][0] != '-') {  // a mistyped subcommand gets a suggestion
      std::vector<std::string> names;
      for (const auto* sub : app.get_subcommands(nullptr)) names.push_back(sub->get_name());
      if (std::find(names.begin(), names.end(), args[0]) == names.end()) {
        fmt::print(stderr, "xlr8: error: {:?} is not a command{}; the commands are {}\n", args[0],
                   text::suggestion(args[0], names), text::join(names));
        return 2;
      }
    }
    if (!args.empty() && (args[0] == "launch" || args[0] == "verify" || args[0] == "advise")) {
      auto rest = normalize_launch_args(*app.get_subcommand(args[0]), {args.begin() + 1, args.end()});
      args.resize(1);
      args.insert(args.end(), rest.begin(), rest.end());
    }
    std::reverse(args.begin(), args.end());  // CLI11 takes a vector last word first
    app.parse(args);
  } catch (const CLI::ConversionError& e) {
    fmt::print(stderr, "xlr8: error: {}\n", conversion_message(app, e.what()));
    return 1;
  } catch (const CLI::ValidationError& e) {
    fmt::print(stderr, "xlr8: error: {}\n", e.what());
    return 1;
  } catch (const CLI::ArgumentMismatch& e) {  // "--num_processes: At Most 1 required but received 2"
    fmt::print(stderr, "xlr8: error: {}: an option that takes one value was given more than once; give it once\n",
               e.what());
    return 1;
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const Error& e) {
    fmt::print(stderr, "xlr8: error: {}\n", e.what());
    return 1;
  }
  try {
    for (auto& [sub, handler] : handlers)
      if (sub->parsed()) return handler();
  } catch (const Error& e) {
    fmt::print(stderr, "xlr8: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "xlr8: unexpected error: {}\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace xlr8::cli
