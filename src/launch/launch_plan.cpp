// Turning `xlr8 launch` flags plus a config file into validated LaunchOptions.
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "launch/mpirun_launch.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"

namespace xlr8 {
namespace {

// A DeepSpeed JSON's tensor_parallel.autotp_size and sequence_parallel_size as the mesh's tp and sp (the
// other ranks data parallel), and its data_parallel_size checked against what is left; a launch that
// already names a mesh must agree with the JSON.
void mesh_from_deepspeed(const deepspeed::Config& ds, int num_processes, std::optional<ParallelismSettings>& p) {
  const int autotp = static_cast<int>(ds.autotp_size);
  const int sp = static_cast<int>(ds.sequence_parallel_size.value_or(1));
  if (p && autotp > 1 && p->tp != autotp)
    throw ConfigError(fmt::format("{} sets tensor_parallel.autotp_size {} but the launch says "
                                  "parallelism_config_tp_size {}; make them equal",
                                  ds.origin, autotp, p->tp));
  if (p && ds.sequence_parallel_size && p->sp != sp)
    throw ConfigError(fmt::format("{} sets sequence_parallel_size {} but the launch says parallelism_config_sp_size "
                                  "{}; make them equal",
                                  ds.origin, sp, p->sp));
  if (!p && (autotp > 1 || sp > 1)) {
    const int split = std::max(autotp, 1) * sp;
    if (num_processes % split != 0)
      throw ConfigError(fmt::format("{} sets {}, which does not divide the {} processes", ds.origin,
                                    autotp > 1 && sp > 1 ? fmt::format("tensor_parallel.autotp_size {} x "
                                                                       "sequence_parallel_size {}", autotp, sp)
                                    : autotp > 1     ? fmt::format("tensor_parallel.autotp_size {}", autotp)
                                                     : fmt::format("sequence_parallel_size {}", sp),
                                    num_processes));
    p = ParallelismSettings{.dp_shard = num_processes / split, .sp = sp, .tp = std::max(autotp, 1)};
  }
  const int dp = p ? p->dp_replicate * p->dp_shard : num_processes;
  if (ds.data_parallel_size && *ds.data_parallel_size != dp)
    throw ConfigError(fmt::format("{} sets data_parallel_size {} but this launch has {} data-parallel ranks ({} "
                                  "processes{}); make them agree",
                                  ds.origin, *ds.data_parallel_size, dp, num_processes,
                                  p ? fmt::format(" over tp {} x sp {} x cp {}", p->tp, p->sp, p->cp) : ""));
}

}  // namespace

LaunchOptions plan_launch(const LaunchRequest& r) {
  if (r.command.empty()) throw ConfigError("no program given: usage `xlr8 launch [options] program [args...]`");
  // Start from the file's YAML, overlay the flags as the same keys, then parse once: one validator, and
  // the same messages for a bad flag and a bad key.
  std::string path = r.config_file.value_or("");
  if (path.empty() && std::filesystem::exists(default_config_path())) path = default_config_path();
  YAML::Node root(YAML::NodeType::Map);
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) throw ConfigError(fmt::format("--config_file {:?} does not exist or cannot be read", path));
    std::stringstream text;
    text << in.rdbuf();
    try {
      root = YAML::Load(text.str());
    } catch (const YAML::Exception& e) {
      throw ConfigError(fmt::format("{}: not valid YAML: {}", path, e.what()));
    }
    if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  }
  if (r.num_processes) root["num_processes"] = *r.num_processes;
  if (r.num_machines) root["num_machines"] = *r.num_machines;
  if (r.nproc_per_node) root["num_processes"] = *r.nproc_per_node * root["num_machines"].as<int>(1);
  if (r.machine_rank) root["machine_rank"] = *r.machine_rank;
  if (r.main_process_ip) root["main_process_ip"] = *r.main_process_ip;
  if (r.main_process_port) root["main_process_port"] = *r.main_process_port;
  if (r.mixed_precision) root["mixed_precision"] = *r.mixed_precision;
  if (r.cpu) root["use_cpu"] = true;
  if (r.debug) root["debug"] = true;
  if (r.enable_cpu_affinity) root["enable_cpu_affinity"] = true;
  if (r.gpu_ids) root["gpu_ids"] = *r.gpu_ids;
  if (r.log_with) root["log_with"] = *r.log_with;
  if (r.use_fsdp && r.use_deepspeed) throw ConfigError("--use_fsdp and --use_deepspeed were both given; choose one");
  if (r.use_fsdp) root["distributed_type"] = "FSDP";
  if (r.use_deepspeed) root["distributed_type"] = "DEEPSPEED";
  for (auto& [k, v] : r.fsdp) root["fsdp_config"][k] = v;
  for (auto& [k, v] : r.deepspeed) root["deepspeed_config"][k] = v;
  for (auto& [k, v] : r.parallelism) root["parallelism_config"][k] = v;
  if (r.gradient_accumulation_steps) root["gradient_accumulation_steps"] = *r.gradient_accumulation_steps;
  if (r.mpirun_hostfile) root["mpirun_config"]["mpirun_hostfile"] = *r.mpirun_hostfile;

  std::string origin = path.empty() ? "xlr8 launch options" : fmt::format("xlr8 launch options over {}", path);
  YAML::Emitter emitter;
  emitter << root;
  LaunchConfig cfg = parse_config(emitter.c_str(), origin);
  if (cfg.num_processes == -1)
    throw ConfigError(fmt::format("{}: num_processes is -1, which means it must be given: pass --num_processes N", origin));

  LaunchOptions o;
  o.command = r.command;
  o.num_machines = cfg.num_machines;
  o.machine_rank = cfg.machine_rank;
  o.nproc_per_node = cfg.processes_per_machine();
  o.master_addr = cfg.main_process_ip.empty() ? "127.0.0.1" : cfg.main_process_ip;
  o.master_port = cfg.main_process_port.value_or(0);
  if (o.master_port == 0 && o.num_machines > 1) o.master_port = 29500;  // every machine must agree on it
  o.settings = cfg.settings();
  // A DeepSpeed JSON that is missing, unreadable or wrong stops the launch before any worker starts. Its
  // tensor_parallel.autotp_size and sequence_parallel_size make the mesh's tp and sp dimensions (the rest
  // data parallel), as DeepSpeed's engine makes its groups from them.
  if (o.settings.deepspeed && !o.settings.deepspeed->config_file.empty())
    mesh_from_deepspeed(deepspeed::load_config(o.settings.deepspeed->config_file), cfg.num_processes,
                        o.settings.parallelism);
  o.max_restarts = r.max_restarts;
  if (o.max_restarts < 0) throw ConfigError(fmt::format("--max_restarts {} must be 0 or more", o.max_restarts));
  o.log_dir = r.log_dir;
  if (r.rdzv_timeout_s) {
    if (*r.rdzv_timeout_s <= 0) throw ConfigError(fmt::format("--rdzv_timeout {} must be a positive number of seconds", *r.rdzv_timeout_s));
    o.extra_env["XLR8_RDZV_TIMEOUT"] = std::to_string(*r.rdzv_timeout_s);
  }
  if (r.num_cpu_threads_per_process) {
    if (*r.num_cpu_threads_per_process < 1)
      throw ConfigError(fmt::format("--num_cpu_threads_per_process {} must be at least 1", *r.num_cpu_threads_per_process));
    o.extra_env["OMP_NUM_THREADS"] = std::to_string(*r.num_cpu_threads_per_process);
  }
  if (!cfg.gpu_ids.empty() && cfg.gpu_ids != "all") o.extra_env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids;
  if (!cfg.log_with.empty()) o.extra_env["XLR8_LOG_WITH"] = cfg.log_with;
  o.mpirun_hostfile = cfg.mpirun_hostfile;
  if (!o.mpirun_hostfile.empty()) detail::check_mpirun_launch(o);
  return o;
}

}  // namespace xlr8
