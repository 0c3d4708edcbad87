// `xlr8 config`: questions on a terminal (or answers piped on stdin), or --default.
#include <fmt/format.h>
#include <unistd.h>

#include <iostream>

#include "cli/commands.hpp"
#include "compat/torch_compat.hpp"
#include "core/text.hpp"
#include "xlr8/config.hpp"
#include "xlr8/error.hpp"

namespace xlr8::cli {
namespace {

// Asks until the answer is valid; an empty answer (or end of input) takes the default. Input that ends right after a
// refused answer (piped answers with a typo) is an error, not the default in its place.
class Asker {
 public:
  std::string ask(const std::string& question, const std::string& fallback, const std::vector<std::string>& choices = {}) {
    for (;;) {
      fmt::print("{}{} [{}]: ", question, choices.empty() ? "" : " (" + text::join(choices, "/") + ")", fallback);
      std::fflush(stdout);
      std::string line;
      if (!std::getline(std::cin, line)) {
        fmt::print("\n");
        if (!refused_.empty())
          throw ConfigError(fmt::format("xlr8 config: the answer {:?} to {:?} was refused and the input ended before "
                                        "another; nothing was written",
                                        refused_, question));
        return fallback;
      }
      line = text::trim(line);
      refused_.clear();
      if (line.empty()) return fallback;
      if (choices.empty()) return line;
      for (auto& c : choices)
        if (text::lower(c) == text::lower(line)) return c;
      refused_ = line;
      fmt::print("  please answer one of: {}\n", text::join(choices, ", "));
    }
  }
  int ask_int(const std::string& question, int fallback, int min) {
    for (;;) {
      std::string a = ask(question, std::to_string(fallback));
      try {
        int v = std::stoi(a);
        if (v >= min) return v;
      } catch (const std::exception&) {
      }
      refused_ = a;
      fmt::print("  please answer a whole number >= {}\n", min);
    }
  }
  bool ask_bool(const std::string& question, bool fallback) {
    return ask(question, fallback ? "yes" : "no", {"yes", "no"}) == "yes";
  }

 private:
  std::string refused_;  // the last answer refused, until another line comes
};

LaunchConfig interview() {
  Asker a;
  LaunchConfig c;
  int gpus = compat::cuda_device_count();
  std::string type = a.ask("Which kind of training", gpus > 0 ? "MULTI_GPU" : "MULTI_CPU",
                           {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"});
  c.distributed_type = parse_distributed_type(type, "distributed_type");
  if (c.distributed_type != DistributedType::NO) {
    c.num_machines = a.ask_int("How many machines", 1, 1);
    if (c.num_machines > 1) {
      c.machine_rank = a.ask_int("Rank of this machine (0 is the main one)", 0, 0);
      c.main_process_ip = a.ask("Address of machine 0", "127.0.0.1");
      c.main_process_port = a.ask_int("Rendezvous port on machine 0", 29500, 1);
    }
    c.num_processes = a.ask_int("How many processes in total, over all machines", std::max(2, gpus) * c.num_machines, 1);
  }
  if (c.distributed_type == DistributedType::FSDP) {
    c.fsdp.sharding_strategy = parse_sharding_strategy(
        a.ask("Sharding strategy", "FULL_SHARD", {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}),
        "fsdp_sharding_strategy");
    c.fsdp.auto_wrap_policy = a.ask("Auto wrap policy", "TRANSFORMER_BASED_WRAP", kAutoWrapPolicies);
    if (c.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP")
      c.fsdp.transformer_layer_cls_to_wrap = text::split(a.ask("Layer class names to wrap (comma-separated)", "TransformerBlock"), ',');
    if (c.fsdp.auto_wrap_policy == "SIZE_BASED_WRAP") c.fsdp.min_num_params = a.ask_int("Minimum parameters per unit", 100000000, 0);
    c.fsdp.offload_params = a.ask_bool("Offload parameters to CPU", false);
    c.fsdp.state_dict_type = a.ask("State dict type", "SHARDED_STATE_DICT", {"FULL_STATE_DICT", "SHARDED_STATE_DICT"});
  }
  if (c.distributed_type == DistributedType::DEEPSPEED) {
    c.deepspeed.zero_stage = std::stoi(a.ask("ZeRO stage", "2", {"0", "1", "2", "3"}));
    c.deepspeed.offload_optimizer_device = a.ask("Offload optimizer states to", "none", kOffloadDevices);
    c.deepspeed.offload_param_device = a.ask("Offload parameters to", "none", kOffloadDevices);
    // The default answer leaves the choice to the program; any other answer overrides the program's.
    if (int steps = a.ask_int("Gradient accumulation steps", 1, 1); steps != 1) c.gradient_accumulation_steps = steps;
  }
  // As Accelerate's questionnaire writes it: MULTI_CPU on the CPU, the GPU kinds not (a file written on a login
  // node without GPUs must not keep the GPU nodes' jobs on the CPU), NO as asked.
  if (c.distributed_type == DistributedType::MULTI_CPU) c.use_cpu = true;
  else if (c.distributed_type == DistributedType::NO) c.use_cpu = gpus == 0 || a.ask_bool("Train on CPU only", false);
  else c.use_cpu = false;
  c.mixed_precision = parse_mixed_precision(a.ask("Mixed precision", "no", {"no", "fp16", "bf16"}), "mixed_precision");
  c.validate();
  return c;
}

}  // namespace

Handler add_config(CLI::App& app) {
  auto* cmd = app.add_subcommand("config", "Write a launch config file (Accelerate's YAML format)");
  auto path = std::make_shared<std::string>();
  auto use_default = std::make_shared<bool>(false);
  auto precision = std::make_shared<std::string>("no");
  cmd->add_option("--config_file,--config-file", *path, "Where to write (default: ~/.cache/xlr8/default_config.yaml)");
  cmd->add_flag("--default", *use_default, "Write a default config without asking");
  cmd->add_option("--mixed_precision,--mixed-precision", *precision, "With --default: no | fp16 | bf16");
  return [=]() {
    std::string target = path->empty() ? default_config_path() : *path;
    LaunchConfig c;
    if (*use_default) {
      int gpus = compat::cuda_device_count();
      c.distributed_type = gpus > 1 ? DistributedType::MULTI_GPU : DistributedType::NO;
      c.num_processes = std::max(1, gpus);
      c.use_cpu = gpus == 0;
      c.mixed_precision = parse_mixed_precision(*precision, "--mixed_precision");
    } else {
      if (!isatty(0)) fmt::print("(reading answers from standard input)\n");
      c = interview();
    }
    save_config(c, target);
    fmt::print("xlr8 config: wrote {}\n", target);
    return 0;
  };
}

}  // namespace xlr8::cli
