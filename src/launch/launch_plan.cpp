// Turning `xlr8 launch` flags plus a config file into validated LaunchOptions.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <map>
#include <fstream>
#include <sstream>

#include "config/config_section.hpp"
#include "core/log.hpp"
#include "launch/mpirun_launch.hpp"
#include "launch/etcd_rendezvous.hpp"
#include "os/net.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"

namespace xlr8 {
namespace {

// A DeepSpeed JSON's pipeline.stages, tensor_parallel.autotp_size and sequence_parallel_size as the mesh's pp, tp and sp (the
// other ranks data parallel), and its data_parallel_size checked against what is left; a launch that
// already names a mesh must agree with the JSON.
// DeepSpeed's batch relation (train_batch_size = micro x accumulation x data-parallel ranks) when the JSON fixes
// its terms: checked here once rather than by every worker. "auto" terms are the Accelerator's to fill.
void check_batch_sizes(const deepspeed::Config& ds, int data_parallel) {
  for (const auto& key : ds.auto_keys)
    if (key == "train_batch_size" || key == "train_micro_batch_size_per_gpu" || key == "gradient_accumulation_steps")
      return;
  if (ds.elasticity.enabled || ds.train_batch_size || ds.train_micro_batch_size_per_gpu)
    deepspeed::resolve_batch_sizes(ds, data_parallel);
}

void mesh_from_deepspeed(const deepspeed::Config& ds, int num_processes, std::optional<ParallelismSettings>& p,
                         bool elastic) {
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
  const int stages = static_cast<int>(ds.pipeline.stages.value_or(1));
  if (p && ds.pipeline.stages && p->pp != stages)
    throw ConfigError(fmt::format("{} sets pipeline.stages {} but the launch says parallelism_config_pp_size {}; make "
                                  "them equal",
                                  ds.origin, stages, p->pp));
  if (!p && (autotp > 1 || sp > 1 || stages > 1)) {
    const int split = std::max(autotp, 1) * sp * stages;
    if (num_processes % split != 0) {
      std::vector<std::string> parts;
      if (stages > 1) parts.push_back(fmt::format("pipeline.stages {}", stages));
      if (autotp > 1) parts.push_back(fmt::format("tensor_parallel.autotp_size {}", autotp));
      if (sp > 1) parts.push_back(fmt::format("sequence_parallel_size {}", sp));
      throw ConfigError(fmt::format("{} sets {}, which does not divide the {} processes; launch a multiple of {} "
                                    "processes",
                                    ds.origin, fmt::join(parts, " x "), num_processes, split));
    }
    p = ParallelismSettings{.dp_shard = num_processes / split, .sp = sp, .tp = std::max(autotp, 1), .pp = stages};
  }
  const int dp = p ? p->dp_replicate * p->dp_shard : num_processes;
  if (ds.data_parallel_size && *ds.data_parallel_size != dp)
    throw ConfigError(fmt::format("{} sets data_parallel_size {} but this launch has {} data-parallel ranks ({} "
                                  "processes{}); make them agree",
                                  ds.origin, *ds.data_parallel_size, dp, num_processes,
                                  p ? fmt::format(" over pp {} x tp {} x sp {} x cp {}", p->pp, p->tp, p->sp, p->cp)
                                    : ""));
  if (!elastic) check_batch_sizes(ds, dp);  // an elastic job's world size is known only at each rendezvous
}

// --nnodes "N" or "MIN:MAX".
std::pair<int, int> parse_nnodes(const std::string& text) {
  auto number = [&](const std::string& part) {
    const bool digits = !part.empty() && part.size() < 7 && part.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoi(part) < 1)
      throw ConfigError(fmt::format("--nnodes {:?}: give a number of machines N, or MIN:MAX for an elastic job (1 or "
                                    "more each)",
                                    text));
    return std::stoi(part);
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) return {number(text), number(text)};
  const int lo = number(text.substr(0, colon)), hi = number(text.substr(colon + 1));
  if (lo > hi) throw ConfigError(fmt::format("--nnodes {:?}: the minimum {} is above the maximum {}", text, lo, hi));
  return {lo, hi};
}

// torchrun's etcd keys of --rdzv_conf; false for a key that is not one of them.
bool etcd_conf(const std::string& key, const std::string& value, ElasticOptions& e) {
  if (key == "protocol") {
    if (value != "http")
      throw ConfigError(fmt::format("--rdzv_conf protocol={:?}: only http is supported (no TLS: keep etcd's client "
                                    "port on the cluster's private network)",
                                    value));
  } else if (key == "cacert" || key == "cert" || key == "key") {
    throw ConfigError(fmt::format("--rdzv_conf {}: TLS to etcd is not supported; use protocol=http on the cluster's "
                                  "private network",
                                  key));
  } else if (key == "read_timeout") {
    char* end = nullptr;
    e.etcd_timeout_s = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(e.etcd_timeout_s > 0))
      throw ConfigError(fmt::format("--rdzv_conf read_timeout={:?}: give a positive number of seconds", value));
  } else if (key == "etcd_prefix") {
    if (value.empty() || value[0] != '/')
      throw ConfigError(fmt::format("--rdzv_conf etcd_prefix={:?}: give a key path starting with '/'", value));
    e.etcd_key_prefix = value.back() == '/' ? value.substr(0, value.size() - 1) : value;
  } else {
    return false;
  }
  return true;
}

// --rdzv_endpoint for etcd: "host:port[,host:port...]" (an http:// in front is accepted).
std::vector<std::string> etcd_endpoints(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    if (item.rfind("https://", 0) == 0)
      throw ConfigError(fmt::format("--rdzv_endpoint {:?}: TLS to etcd is not supported; give its http client address",
                                    item));
    if (item.rfind("http://", 0) == 0) item = item.substr(7);
    if (!item.empty() && item.back() == '/') item.pop_back();
    out.push_back(os::parse_host_port(item, 2379, "--rdzv_endpoint").str());
  }
  if (out.empty()) throw ConfigError(fmt::format("--rdzv_endpoint {:?} names no etcd member", text));
  return out;
}

// --rdzv_conf "key=value,...", torchrun's keys.
void apply_rdzv_conf(const std::string& text, ElasticOptions& e) {
  std::map<std::string, double*> seconds{{"join_timeout", &e.join_timeout_s},
                                         {"last_call_timeout", &e.last_call_timeout_s},
                                         {"close_timeout", &e.close_timeout_s},
                                         {"keep_alive_interval", &e.keep_alive_interval_s}};
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const double number = std::strtod(value.c_str(), &end);
    const bool positive = !value.empty() && end && *end == '\0' && number > 0;
    if (key == "keep_alive_max_attempt") {
      // One missed beat must not drop a machine: the beat and the check are not in step.
      if (!positive || number != static_cast<int>(number) || number < 2)
        throw ConfigError(fmt::format("--rdzv_conf {}={:?}: give a whole number of 2 or more", key, value));
      e.keep_alive_max_attempt = static_cast<int>(number);
    } else if (e.backend == "etcd" && etcd_conf(key, value, e)) {
    } else if (auto it = seconds.find(key); it != seconds.end()) {
      if (!positive) throw ConfigError(fmt::format("--rdzv_conf {}={:?}: give a positive number of seconds", key, value));
      *it->second = number;
    } else {
      throw ConfigError(fmt::format("--rdzv_conf: unknown key {:?}; known: join_timeout, last_call_timeout, "
                                    "close_timeout, keep_alive_interval, keep_alive_max_attempt{}",
                                    key, e.backend == "etcd" ? ", and with etcd: protocol, read_timeout, etcd_prefix" : ""));
    }
  }
}

// torchrun's rendezvous flags: nullopt for a static launch (machine ranks given), else the elastic options.
// An elastic launch describes this machine alone: `yaml` gets num_machines 1 and its processes.
std::optional<ElasticOptions> plan_rendezvous(const LaunchRequest& r, YAML::Node& yaml) {
  const auto [min_nodes, max_nodes] = r.nnodes ? parse_nnodes(*r.nnodes) : std::pair<int, int>{0, 0};
  std::string backend = r.rdzv_backend.value_or("static");
  if (backend == "etcd-v2") backend = "etcd";  // torchrun's two etcd handlers; here one (etcd's v3 API)
  if (backend != "static" && backend != "c10d" && backend != "etcd")
    throw ConfigError(fmt::format("--rdzv_backend {:?} is not supported: use c10d or etcd (elastic) or static", backend));
  if (backend == "static") {
    if (min_nodes != max_nodes)
      throw ConfigError(fmt::format("--nnodes {} is a range, which needs the elastic rendezvous: add --rdzv_backend "
                                    "c10d --rdzv_endpoint host:port",
                                    *r.nnodes));
    for (const auto& [flag, given] : {std::pair{"--rdzv_endpoint", r.rdzv_endpoint.has_value()},
                                      std::pair{"--rdzv_conf", r.rdzv_conf.has_value()}})
      if (given)
        throw ConfigError(fmt::format("{} needs --rdzv_backend c10d (a static launch takes --master_addr and "
                                      "--master_port)",
                                      flag));
    if (max_nodes > 0) yaml["num_machines"] = max_nodes;
    return std::nullopt;
  }
  if (r.machine_rank)
    throw ConfigError(fmt::format("--node_rank/--machine_rank: with --rdzv_backend {} the rendezvous assigns machine "
                                  "ranks; remove it",
                                  backend));
  if (!r.nproc_per_node)
    throw ConfigError(fmt::format("--rdzv_backend {} places machines at run time: give --nproc_per_node (the processes "
                                  "on this machine) instead of a total --num_processes",
                                  backend));
  ElasticOptions e;
  e.min_nodes = std::max(min_nodes, 1);
  e.max_nodes = std::max(max_nodes, 1);
  e.backend = backend;
  if (backend == "etcd") {
    if (!r.rdzv_endpoint)
      throw ConfigError("--rdzv_backend etcd needs --rdzv_endpoint host:port[,host:port...]: the etcd members' client "
                        "addresses (port 2379 by default); list several so that losing one is survived");
    e.etcd_endpoints = etcd_endpoints(*r.rdzv_endpoint);
  } else if (r.rdzv_endpoint) {
    const auto endpoint = os::parse_host_port(*r.rdzv_endpoint, 29400, "--rdzv_endpoint");
    e.endpoint_host = endpoint.host;
    e.endpoint_port = endpoint.port;
  } else if (e.max_nodes == 1) {
    e.endpoint_port = pick_free_port();  // one machine: its own rendezvous
  } else {
    throw ConfigError("--rdzv_backend c10d with several machines needs --rdzv_endpoint host[:port]: the address of the "
                      "machine that serves the rendezvous (its `xlr8 launch` does; port 29400 by default)");
  }
  if (r.rdzv_id) e.run_id = *r.rdzv_id;
  if (r.rdzv_conf) apply_rdzv_conf(*r.rdzv_conf, e);
  const double life = e.keep_alive_interval_s * e.keep_alive_max_attempt;
  if (e.backend == "etcd") e.etcd_timeout_s = launcher::etcd_request_timeout_s(e);
  if (e.backend == "etcd" && e.etcd_timeout_s >= life)
    throw ConfigError(fmt::format("--rdzv_conf read_timeout={} must be below the etcd lease's life (keep_alive_interval "
                                  "x keep_alive_max_attempt = {} s): one request to a dead member would outlast it",
                                  e.etcd_timeout_s, life));
  yaml["num_machines"] = 1;
  yaml["machine_rank"] = 0;
  yaml["num_processes"] = *r.nproc_per_node;
  return e;
}

// Inside a Slurm job step of several tasks (`srun -N 2 --ntasks-per-node 1 xlr8 launch ...`) each task is one
// machine's launcher: the machine count and rank and machine 0's address come from Slurm's variables, as
// the workers' own would (core/topology.cpp), unless the flags or the config file name machines.
void machines_from_slurm(const LaunchRequest& r, YAML::Node& root) {
  if (r.num_machines || r.nnodes || r.machine_rank || r.main_process_ip || r.mpirun_hostfile || r.rdzv_backend) return;
  if (root["num_machines"] && root["num_machines"].as<int>(1) != 1) return;
  Topology t;
  try {
    t = topology_from_env(Env::current());
  } catch (const Error&) {
    return;  // inconsistent variables: the workers will say what is wrong
  }
  if (t.source != "slurm" || t.world_size < 2) return;
  root["num_machines"] = t.world_size;
  root["machine_rank"] = t.rank;
  root["main_process_ip"] = t.master_addr;
  if (!r.main_process_port) root["main_process_port"] = t.master_port;
  log::info("xlr8 launch: machine {} of {} from Slurm's job step (machine 0: {}:{})", t.rank, t.world_size,
            t.master_addr, t.master_port);
}

// The config file's YAML (an empty file: an empty map).
YAML::Node config_file_yaml(const std::string& path) {
  if (std::error_code unreadable; std::filesystem::is_directory(path, unreadable))
    throw ConfigError(fmt::format("--config_file {:?} is a directory: give the YAML file (`xlr8 config` writes one)", path));
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("--config_file {:?} does not exist or cannot be read", path));
  std::stringstream text;
  text << in.rdbuf();
  YAML::Node root;
  try {
    root = YAML::Load(text.str());
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: not valid YAML: {}", path, e.what()));
  }
  if (root.IsNull()) return YAML::Node(YAML::NodeType::Map);
  config::refuse_repeated_keys(root, path);  // before the flags overlay the file, with the file's lines
  root = config::without_repeated_keys(root);  // a flag then sets the one entry left
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}: the file must be a mapping of keys to values (such as `num_processes: 2`), not a "
                                  "{}; `xlr8 config` writes one",
                                  path, root.IsSequence() ? "list" : "single value"));
  return root;
}

// The counts given twice, in torchrun's spelling and in Accelerate's, must agree: neither silently wins.
void refuse_disagreeing_counts(const LaunchRequest& r) {
  if (r.nproc_per_node && *r.nproc_per_node < 1)
    throw ConfigError(fmt::format("--nproc_per_node {} must be at least 1 (or auto, cpu, gpu)", *r.nproc_per_node));
  const auto [min_nodes, max_nodes] = r.nnodes ? parse_nnodes(*r.nnodes) : std::pair<int, int>{0, 0};
  if (r.num_machines && min_nodes != max_nodes)
    throw ConfigError(fmt::format("--nnodes {} is a range (an elastic job) and takes no --num_machines: remove --num_machines",
                                  *r.nnodes));
  if (r.num_machines && max_nodes > 0 && max_nodes != *r.num_machines)
    throw ConfigError(fmt::format("--nnodes {} and --num_machines {} disagree: give one of them", *r.nnodes, *r.num_machines));
}

// --nproc_per_node times the machines (from the flags, the file or Slurm) must be --num_processes where both are given.
void refuse_disagreeing_process_count(const LaunchRequest& r, const YAML::Node& root) {
  if (!r.nproc_per_node || !r.num_processes) return;
  const int machines = root["num_machines"].as<int>(1);
  if (*r.nproc_per_node * machines != *r.num_processes)
    throw ConfigError(fmt::format("--nproc_per_node {} on {} machine(s) is {} processes, but --num_processes is {}: give "
                                  "one of them (--num_processes counts every machine's)",
                                  *r.nproc_per_node, machines, *r.nproc_per_node * machines, *r.num_processes));
}

// The flags that set the file's keys of what the job does (precision, strategy, sections), over the file's values.
void overlay_settings(const LaunchRequest& r, YAML::Node& root) {
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
  for (auto& [flag, v] : r.fp8) root["fp8_config"][flag == "fp8_format" ? flag : flag.substr(4)] = v;  // as Accelerate
  if (r.gradient_accumulation_steps) {
    root["gradient_accumulation_steps"] = *r.gradient_accumulation_steps;
    // The file's DeepSpeed section may name it too; the flag wins there as well (Accelerate keeps an explicit flag).
    if (root["deepspeed_config"].IsMap() && root["deepspeed_config"]["gradient_accumulation_steps"])
      root["deepspeed_config"]["gradient_accumulation_steps"] = *r.gradient_accumulation_steps;
  }
  if (r.mpirun_hostfile) root["mpirun_config"]["mpirun_hostfile"] = *r.mpirun_hostfile;
  for (const auto& [key, v] : r.other_keys) {
    const auto dot = key.find('.');
    if (dot == std::string::npos) root[key] = v;
    else root[key.substr(0, dot)][key.substr(dot + 1)] = v;
  }
  // An older file's top-level dynamo_backend gives way to the flag too, as in Accelerate.
  if (r.other_keys.count("dynamo_config.dynamo_backend") && root["dynamo_backend"])
    root["dynamo_backend"] = r.other_keys.at("dynamo_config.dynamo_backend");
}

// A DeepSpeed or FSDP flag on a launch of another strategy would do nothing: --offload_optimizer_device nvme under
// DDP wrote no swap file and said nothing.
void refuse_flags_of_another_strategy(const LaunchRequest& r, DistributedType type) {
  const auto first_of = [](const std::map<std::string, std::string>& flags) { return "--" + flags.begin()->first; };
  if (!r.deepspeed.empty() && type != DistributedType::DEEPSPEED)
    throw ConfigError(fmt::format("{} is a DeepSpeed option, but this launch is {}: add --use_deepspeed (or "
                                  "distributed_type: DEEPSPEED in the config file), or drop it (FSDP offloads with "
                                  "--fsdp_offload_params true)",
                                  first_of(r.deepspeed), to_string(type)));
  if (!r.fsdp.empty() && type != DistributedType::FSDP)
    throw ConfigError(fmt::format("{} is an FSDP option, but this launch is {}: add --use_fsdp (or distributed_type: "
                                  "FSDP in the config file), or drop it",
                                  first_of(r.fsdp), to_string(type)));
}

}  // namespace

LaunchOptions plan_launch(const LaunchRequest& r) {
  if (r.command.empty()) throw ConfigError("no program given: usage `xlr8 launch [options] program [args...]`");
  // Start from the file's YAML, overlay the flags as the same keys, then parse once: one validator, and
  // the same messages for a bad flag and a bad key.
  std::string path = r.config_file.value_or("");
  if (path.empty() && std::filesystem::exists(default_config_path())) path = default_config_path();
  refuse_disagreeing_counts(r);
  YAML::Node root = path.empty() ? YAML::Node(YAML::NodeType::Map) : config_file_yaml(path);
  if (r.num_processes) root["num_processes"] = *r.num_processes;
  if (r.num_machines) root["num_machines"] = *r.num_machines;
  auto elastic = plan_rendezvous(r, root);
  if (!elastic) machines_from_slurm(r, root);
  if (!elastic) refuse_disagreeing_process_count(r, root);
  if (r.nproc_per_node && !elastic) root["num_processes"] = *r.nproc_per_node * root["num_machines"].as<int>(1);
  if (r.machine_rank) root["machine_rank"] = *r.machine_rank;
  if (r.main_process_ip) root["main_process_ip"] = *r.main_process_ip;
  if (r.main_process_port) root["main_process_port"] = *r.main_process_port;
  overlay_settings(r, root);

  std::string origin = path.empty() ? "xlr8 launch options" : fmt::format("xlr8 launch options over {}", path);
  YAML::Emitter emitter;
  emitter << root;
  LaunchConfig cfg = parse_config(emitter.c_str(), origin);
  refuse_flags_of_another_strategy(r, cfg.distributed_type);
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
                        o.settings.parallelism, elastic.has_value());
  o.elastic = elastic;
  if (elastic) o.run_id = elastic->run_id;
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
  if (!o.mpirun_hostfile.empty()) launcher::check_mpirun_launch(o);
  return o;
}

}  // namespace xlr8
