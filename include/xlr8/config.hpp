#pragma once
// The launch config file: Accelerate's default_config.yaml format (keys as `accelerate config` writes
// them, accelerate/commands/config/config_args.py), so a file written by `accelerate config` works unchanged.
#include <optional>
#include <string>
#include <vector>

#include "xlr8/settings.hpp"

namespace xlr8 {

struct LaunchConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::NO;
  MixedPrecision mixed_precision = MixedPrecision::NO;
  bool use_cpu = false;
  bool debug = false;
  int num_processes = 1;  // total across machines; -1 means "must be given on the command line"
  int num_machines = 1;
  int machine_rank = 0;
  std::string gpu_ids = "all";
  std::string log_with;                   // trackers for the workers (XLR8_LOG_WITH): "all" or names
  std::string main_process_ip;            // empty: 127.0.0.1 on one machine
  std::optional<int> main_process_port;   // empty or 0: pick a free port
  std::string rdzv_backend = "static";
  bool same_network = true;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  std::string downcast_bf16 = "no";
  std::optional<int> gradient_accumulation_steps;  // empty: the program decides
  std::string mpirun_hostfile;            // mpirun_config.mpirun_hostfile: mpirun starts the job over its hosts
  Fp8Settings fp8;                        // fp8_config, used when mixed_precision is fp8
  FsdpSettings fsdp;                      // used when distributed_type is FSDP
  DeepSpeedSettings deepspeed;            // used when distributed_type is DEEPSPEED
  std::optional<ParallelismSettings> parallelism;
  std::vector<std::string> ignored_keys;  // accepted for compatibility, no effect in xlr8 (tpu_*, dynamo_config...)
  std::string path;                       // file it was read from, for messages

  // What the workers get; throws ConfigError for inconsistent settings (machine_rank >= num_machines...).
  Settings settings() const;
  void validate() const;
  int processes_per_machine() const { return num_processes / num_machines; }
};

// Reads YAML (or JSON). Unknown keys name the closest valid key; wrong types and values name the key,
// the value and what is allowed. Throws ConfigError.
LaunchConfig load_config(const std::string& path);
LaunchConfig parse_config(const std::string& yaml_text, const std::string& origin = "<string>");
std::string to_yaml(const LaunchConfig& config);
// Writes atomically (temporary file + rename), creating parent directories.
void save_config(const LaunchConfig& config, const std::string& path);
// $XDG_CACHE_HOME/xlr8/default_config.yaml, else ~/.cache/xlr8/default_config.yaml.
std::string default_config_path();

}  // namespace xlr8
