#include "xlr8/config.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "config/config_compat.hpp"
#include "config/config_section.hpp"
#include "config/fp8_config.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace fs = std::filesystem;

namespace xlr8 {
namespace {

using config::Section;

const std::vector<std::string> kTrackerNames = {"jsonl", "csv", "tensorboard", "all"};

const std::vector<std::string> kTopKeys = {
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "num_machines", "machine_rank", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "downcast_bf16",
    "gradient_accumulation_steps", "fsdp_config", "deepspeed_config", "parallelism_config", "log_with",
    "mpirun_config", "fp8_config"};
const std::vector<std::string> kFsdpKeys = {
    "fsdp_version", "fsdp_activation_checkpointing", "fsdp_auto_wrap_policy", "fsdp_backward_prefetch",
    "fsdp_backward_prefetch_policy", "fsdp_cpu_ram_efficient_loading", "fsdp_forward_prefetch",
    "fsdp_min_num_params", "fsdp_offload_params", "fsdp_reshard_after_forward", "fsdp_sharding_strategy",
    "fsdp_state_dict_type", "fsdp_sync_module_states", "fsdp_transformer_layer_cls_to_wrap", "fsdp_use_orig_params",
    "fsdp_ignored_modules"};
const std::vector<std::string> kDeepSpeedKeys = {
    "deepspeed_config_file", "zero_stage", "gradient_accumulation_steps", "gradient_clipping",
    "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
    "zero3_init_flag", "zero3_save_16bit_model"};
// Only read for what they would turn on (checked in read_deepspeed).
const std::vector<std::string> kLauncherDeepSpeedKeys = {
    "deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names"};
const std::vector<std::string> kParallelismKeys = {
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
    "parallelism_config_pp_size", "parallelism_config_pp_schedule", "parallelism_config_pp_microbatches",
    "parallelism_config_pp_virtual_stages",
    "parallelism_config_cp_size", "parallelism_config_cp_comm_strategy", "parallelism_config_cp_backend",
    "parallelism_config_sp_size", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation",
    "parallelism_config_tp_head_dim"};

const std::vector<std::string> kMpirunKeys = {"mpirun_hostfile", "mpirun_ccl"};
const std::vector<std::string> kNone;

// Accelerate 0.7-0.11 wrote fsdp_config keys without the prefix, and `accelerate launch` still adds it.
YAML::Node with_fsdp_prefix(const YAML::Node& node) {
  if (!node || !node.IsMap()) return node;
  YAML::Node out(YAML::NodeType::Map);
  for (const auto& kv : node) {
    auto key = kv.first.as<std::string>();
    if (key.rfind("fsdp_", 0) != 0) {
      if (node["fsdp_" + key]) continue;  // both spellings (an old file under a --fsdp_* flag): the current one wins
      key = "fsdp_" + key;
    }
    out[key] = kv.second;
  }
  return out;
}

void read_fsdp(const Section& s, FsdpSettings& f) {
  if (!s.is_off("fsdp_ignored_modules"))
    throw s.error("fsdp_ignored_modules", fmt::format("value {} is not supported: xlr8 shards every module; remove "
                                                      "the key or set it to null",
                                                      s.shown("fsdp_ignored_modules")));
  if (auto v = s.integer("fsdp_version", 1, 2)) f.version = static_cast<int>(*v);
  const auto strategy = s.str("fsdp_sharding_strategy");
  if (strategy) f.sharding_strategy = parse_sharding_strategy(*strategy, s.where("fsdp_sharding_strategy"));
  // FSDP1 files from `accelerate config` name the strategy under fsdp_reshard_after_forward; given both (the
  // file's and a --fsdp_sharding_strategy), fsdp_sharding_strategy wins, as FSDP_SHARDING_STRATEGY does in Accelerate.
  if (auto v = s.str("fsdp_reshard_after_forward")) {
    if (auto b = parse_bool(*v)) f.reshard_after_forward = b;
    else if (auto named = parse_sharding_strategy(*v, s.where("fsdp_reshard_after_forward")); !strategy)
      f.sharding_strategy = named;
  }
  if (auto v = s.choice("fsdp_auto_wrap_policy", kAutoWrapPolicies, true)) f.auto_wrap_policy = *v;
  f.transformer_layer_cls_to_wrap = s.list("fsdp_transformer_layer_cls_to_wrap");
  if (auto v = s.integer("fsdp_min_num_params", 0, std::numeric_limits<long>::max())) f.min_num_params = *v;
  for (auto key : {"fsdp_backward_prefetch", "fsdp_backward_prefetch_policy"})
    if (auto v = s.choice(key, kBackwardPrefetchValues, true)) f.backward_prefetch = *v;
  if (auto v = s.str("fsdp_state_dict_type"))
    f.state_dict_type = config::state_dict_type_of(*v, s.where("fsdp_state_dict_type"));
  else if (f.version == 2) f.state_dict_type = "SHARDED_STATE_DICT";  // Accelerate's FSDP2 default
  for (const auto& flag : fsdp_flags())
    if (auto b = s.boolean(flag.config_key)) f.*flag.member = *b;
}

void read_deepspeed(const Section& s, LaunchConfig& c) {
  if (!s.is_off("deepspeed_moe_layer_cls_names"))
    throw s.error("deepspeed_moe_layer_cls_names",
                  fmt::format("value {} asks for DeepSpeed mixture-of-experts layers, which xlr8 does not have; remove "
                              "the key",
                              s.shown("deepspeed_moe_layer_cls_names")));
  // Across machines, `accelerate launch` may start the other machines itself (pdsh, ssh, mpirun...);
  // xlr8 launch runs on every machine, as DeepSpeed's "standard" launcher does.
  if (auto v = s.str("deepspeed_multinode_launcher"); v && *v != "standard" && *v != "nossh" && c.num_machines > 1)
    throw s.error("deepspeed_multinode_launcher",
                  fmt::format("value {:?} asks the launcher to start the other machines, which xlr8 launch does not "
                              "do; set it to \"standard\" (or \"nossh\") and run xlr8 launch on every machine (or start "
                              "the job with "
                              "srun or mpirun)",
                              *v));
  auto& d = c.deepspeed;
  if (auto v = s.str("deepspeed_config_file")) d.config_file = *v;
  if (auto v = s.integer("zero_stage", 0, 3)) d.zero_stage = static_cast<int>(*v);
  if (auto v = s.integer("gradient_accumulation_steps", 1, 1L << 30)) c.gradient_accumulation_steps = static_cast<int>(*v);
  d.gradient_clipping = s.number("gradient_clipping");
  // DeepSpeed takes a negative value as no clipping; xlr8 refuses it (a sign typo would clip nothing), the JSON's too
  if (d.gradient_clipping && *d.gradient_clipping < 0)
    throw s.error("gradient_clipping", fmt::format("value {} must be >= 0 (0 disables clipping)", *d.gradient_clipping));
  if (auto v = s.choice("offload_optimizer_device", kOffloadDevices, false)) d.offload_optimizer_device = *v;
  if (auto v = s.choice("offload_param_device", kOffloadDevices, false)) d.offload_param_device = *v;
  if (auto v = s.str("offload_optimizer_nvme_path")) d.offload_optimizer_nvme_path = *v;
  if (auto v = s.str("offload_param_nvme_path")) d.offload_param_nvme_path = *v;
  if (auto v = s.boolean("zero3_init_flag")) d.zero3_init_flag = *v;
  d.zero3_save_16bit_model = s.boolean("zero3_save_16bit_model").value_or(d.zero3_save_16bit_model);
}

constexpr std::array<const char*, 6> kMeshSizeKeys{
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
    "parallelism_config_cp_size",           "parallelism_config_sp_size",       "parallelism_config_pp_size"};

void read_parallelism(const Section& s, LaunchConfig& c) {
  ParallelismSettings p;
  constexpr long kMax = 1 << 20;
  p.dp_replicate = static_cast<int>(s.integer("parallelism_config_dp_replicate_size", 1, kMax).value_or(1));
  p.dp_shard = static_cast<int>(s.integer("parallelism_config_dp_shard_size", 1, kMax).value_or(1));
  p.tp = static_cast<int>(s.integer("parallelism_config_tp_size", 1, kMax).value_or(1));
  p.tp_head_dim = s.integer("parallelism_config_tp_head_dim", 1, kMax);
  p.cp = static_cast<int>(s.integer("parallelism_config_cp_size", 1, kMax).value_or(1));
  p.pp = static_cast<int>(s.integer("parallelism_config_pp_size", 1, kMax).value_or(1));
  if (auto schedule = s.choice("parallelism_config_pp_schedule", config::pp_schedules(), /*upper=*/false))
    p.pp_schedule = config::pp_schedule_spelling(*schedule);
  p.pp_microbatches = static_cast<int>(s.integer("parallelism_config_pp_microbatches", 1, kMax).value_or(0));
  p.pp_virtual_stages = static_cast<int>(s.integer("parallelism_config_pp_virtual_stages", 1, kMax).value_or(0));
  if (auto strategy = s.choice("parallelism_config_cp_comm_strategy", {"allgather", "alltoall"}, /*upper=*/false))
    p.cp_comm_strategy = *strategy;
  (void)s.choice("parallelism_config_cp_backend", {"torch"}, /*upper=*/false);  // Accelerate's only one; nothing to set
  // Ulysses (DeepSpeed's ALST, Accelerate's sp_backend deepspeed: the only backend).
  p.sp = static_cast<int>(s.integer("parallelism_config_sp_size", 1, kMax).value_or(1));
  s.choice("parallelism_config_sp_backend", {"deepspeed"}, /*upper=*/false);
  p.sp_seq_length = s.integer("parallelism_config_sp_seq_length", 1, kMax);
  p.sp_seq_length_is_variable = s.boolean("parallelism_config_sp_seq_length_is_variable").value_or(true);
  // xlr8::attention is scaled-dot-product attention: sdpa is what it computes.
  s.choice("parallelism_config_sp_attn_implementation", {"sdpa"}, /*upper=*/false);
  if (!p.sp_seq_length_is_variable && !p.sp_seq_length)
    throw s.error("parallelism_config_sp_seq_length_is_variable",
                  "is false, but parallelism_config_sp_seq_length is not set; set the length every batch has, or "
                  "make it true");
  if (p.sp_seq_length && *p.sp_seq_length % p.sp != 0)
    throw s.error("parallelism_config_sp_seq_length",
                  fmt::format("value {} is not divisible by parallelism_config_sp_size {}; choose a multiple of it",
                              *p.sp_seq_length, p.sp));
  check_sequence_split(p);
  // No size given (only pp_microbatches or a schedule, for pipeline_step without stages): every rank data parallel,
  // FSDP's sharded, as Accelerate's default mesh; it was a mesh of 1 that no launch of 2 could take.
  const bool sized = std::any_of(kMeshSizeKeys.begin(), kMeshSizeKeys.end(), [&](const char* key) { return s.has(key); });
  if (!sized && c.num_processes > 0)
    (c.distributed_type == DistributedType::FSDP ? p.dp_shard : p.dp_replicate) = c.num_processes;
  c.parallelism = p;
}

}  // namespace

LaunchConfig parse_config(const std::string& yaml_text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: not valid YAML: {}", origin, e.what()));
  }
  config::refuse_repeated_keys(root, origin);
  LaunchConfig c;
  c.path = origin;
  Section top(root, "", origin);
  config::refuse_foreign_environment(top);
  const Section fsdp(with_fsdp_prefix(top.child("fsdp_config")), "fsdp_config.", origin);
  const Section deepspeed(top.child("deepspeed_config"), "deepspeed_config.", origin);
  const Section mpi(top.child("mpirun_config"), "mpirun_config.", origin);
  const Section parallelism(top.child("parallelism_config"), "parallelism_config.", origin);
  // Accelerate reads fp8_config with mixed_precision fp8 only; other files keep whatever they hold there.
  const bool fp8_on = text::lower(top.str("mixed_precision").value_or("")) == "fp8";
  const Section fp8(fp8_on ? top.child("fp8_config") : YAML::Node(), "fp8_config.", origin);
  std::vector<std::string> unknown = top.unknown_keys(kTopKeys, config::kCompatTopKeys, &c.ignored_keys);
  for (const auto& [section, known, ignored] :
       {std::tuple{&fsdp, &kFsdpKeys, &kNone}, std::tuple{&deepspeed, &kDeepSpeedKeys, &kLauncherDeepSpeedKeys},
        std::tuple{&mpi, &kMpirunKeys, &kNone}, std::tuple{&parallelism, &kParallelismKeys, &kNone},
        std::tuple{&fp8, &config::kFp8Keys, &kNone}})  // empty unless fp8
    for (auto& message : section->unknown_keys(*known, *ignored, &c.ignored_keys)) unknown.push_back(std::move(message));
  top.refuse_unknown(unknown);
  config::refuse_unsupported_features(top);
  if (auto v = top.str("distributed_type")) {
    try {
      c.distributed_type = parse_distributed_type(*v, "distributed_type");
    } catch (const ConfigError&) {
      throw top.error("distributed_type", fmt::format("value {:?} is not supported; allowed: NO, MULTI_CPU, MULTI_GPU, "
                                                      "FSDP, DEEPSPEED",
                                                      *v));
    }
  }
  if (auto v = top.str("mixed_precision"))
    c.mixed_precision = parse_mixed_precision(*v, fmt::format("{}: mixed_precision", origin));
  else if (top.boolean("fp16").value_or(false))  // Accelerate < 0.6
    c.mixed_precision = MixedPrecision::FP16;
  c.use_cpu = top.boolean("use_cpu").value_or(false);
  c.debug = top.boolean("debug").value_or(false);
  if (auto v = top.integer("num_processes", -1, 1 << 20)) {
    if (*v == 0) throw top.error("num_processes", "value 0 is not allowed; use a positive count (or -1 to require --num_processes)");
    c.num_processes = static_cast<int>(*v);
  }
  if (auto v = top.integer("num_machines", 1, 1 << 16)) c.num_machines = static_cast<int>(*v);
  if (auto v = top.integer("machine_rank", 0, 1 << 16)) c.machine_rank = static_cast<int>(*v);
  if (auto v = top.str("gpu_ids")) c.gpu_ids = *v;
  if (auto v = top.str("log_with")) {
    // xlr8/trackers.hpp's builtin_trackers() and "all" (a test keeps the two lists equal); checked here
    // so that a typo stops the launch, not the run.
    std::string words = *v;
    std::replace(words.begin(), words.end(), ',', ' ');
    std::istringstream in(words);
    for (std::string word; in >> word;)
      if (std::find(kTrackerNames.begin(), kTrackerNames.end(), word) == kTrackerNames.end())
        throw top.error("log_with", fmt::format("value {:?} is not a tracker; allowed: {}{}", word,
                                                text::join(kTrackerNames), text::suggestion(word, kTrackerNames)));
    c.log_with = *v;
  }
  if (auto v = top.str("main_process_ip")) c.main_process_ip = *v;
  if (auto v = top.integer("main_process_port", 0, 65535)) c.main_process_port = static_cast<int>(*v);
  if (auto v = top.choice("rdzv_backend", {"static", "c10d"}, false)) c.rdzv_backend = *v;
  c.same_network = top.boolean("same_network").value_or(true);
  if (auto v = top.str("main_training_function")) c.main_training_function = *v;
  c.enable_cpu_affinity = top.boolean("enable_cpu_affinity").value_or(false);
  if (auto v = top.str("downcast_bf16")) c.downcast_bf16 = *v;
  if (auto v = top.integer("gradient_accumulation_steps", 1, 1L << 30)) c.gradient_accumulation_steps = static_cast<int>(*v);
  read_fsdp(fsdp, c.fsdp);
  read_deepspeed(deepspeed, c);
  // As `accelerate launch` does with it: start the job through mpirun over the file's hosts (mpirun_ccl
  // sizes Intel oneCCL's workers, which xlr8 does not use).
  c.mpirun_hostfile = mpi.str("mpirun_hostfile").value_or("");
  if (top.has("parallelism_config")) read_parallelism(parallelism, c);
  if (c.mixed_precision == MixedPrecision::FP8) config::read_fp8(fp8, c.fp8);
  c.validate();
  return c;
}

LaunchConfig load_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw ConfigError(fmt::format("config file {:?} {}; create one with `xlr8 config` or `xlr8 config --default`", path,
                                  fs::exists(path) ? "cannot be read" : "does not exist"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_config(buffer.str(), path);
}

void LaunchConfig::validate() const {
  auto fail = [&](const std::string& why) { return ConfigError(fmt::format("{}: {}", path.empty() ? "config" : path, why)); };
  if (machine_rank >= num_machines)
    throw fail(fmt::format("machine_rank {} must be below num_machines {} (ranks count from 0)", machine_rank, num_machines));
  if (num_processes > 0 && num_processes % num_machines != 0)
    throw fail(fmt::format("num_processes {} (the total over all machines) is not divisible by num_machines {}",
                           num_processes, num_machines));
  if (num_processes > 0 && num_processes < num_machines)
    throw fail(fmt::format("num_processes {} is smaller than num_machines {}; num_processes counts all machines",
                           num_processes, num_machines));
  if (num_machines > 1 && main_process_ip.empty())
    throw fail(fmt::format("main_process_ip is required when num_machines is {}; set it to the host of machine 0",
                           num_machines));
  if (parallelism && num_processes > 0 && parallelism->total() != num_processes)
    throw fail(fmt::format("parallelism_config sizes multiply to {} (pp {} x dp_replicate {} x dp_shard {} x cp {} x sp "
                           "{} x tp {}) but num_processes is {}",
                           parallelism->total(), parallelism->pp, parallelism->dp_replicate, parallelism->dp_shard,
                           parallelism->cp, parallelism->sp, parallelism->tp, num_processes));
  if (distributed_type == DistributedType::DEEPSPEED && deepspeed.offload_optimizer_device == "nvme" &&
      deepspeed.offload_optimizer_nvme_path.empty())
    throw fail("deepspeed_config.offload_optimizer_device is nvme but offload_optimizer_nvme_path is empty");
}

Settings LaunchConfig::settings() const {
  validate();
  Settings s;
  s.mixed_precision = mixed_precision;
  if (mixed_precision == MixedPrecision::FP8) s.fp8 = fp8;
  s.gradient_accumulation_steps = gradient_accumulation_steps;
  s.use_cpu = use_cpu;
  s.debug = debug;
  s.cpu_affinity = enable_cpu_affinity;
  if (distributed_type == DistributedType::FSDP) s.fsdp = fsdp;
  if (distributed_type == DistributedType::DEEPSPEED) s.deepspeed = deepspeed;
  s.parallelism = parallelism;
  return s;
}

namespace {

// parallelism_config, as Accelerate writes it, with xlr8's keys (tp_head_dim, pp) where they are set.
void write_parallelism(YAML::Emitter& out, const ParallelismSettings& p) {
  out << YAML::Key << "parallelism_config" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "parallelism_config_dp_replicate_size" << YAML::Value << p.dp_replicate;
  out << YAML::Key << "parallelism_config_dp_shard_size" << YAML::Value << p.dp_shard;
  out << YAML::Key << "parallelism_config_cp_size" << YAML::Value << p.cp;
  out << YAML::Key << "parallelism_config_tp_size" << YAML::Value << p.tp;
  if (p.pp > 1) {
    out << YAML::Key << "parallelism_config_pp_size" << YAML::Value << p.pp;
    out << YAML::Key << "parallelism_config_pp_schedule" << YAML::Value << p.pp_schedule;
    if (p.pp_microbatches > 0)
      out << YAML::Key << "parallelism_config_pp_microbatches" << YAML::Value << p.pp_microbatches;
    if (p.pp_virtual_stages > 0)
      out << YAML::Key << "parallelism_config_pp_virtual_stages" << YAML::Value << p.pp_virtual_stages;
  }
  if (p.tp_head_dim)
    out << YAML::Key << "parallelism_config_tp_head_dim" << YAML::Value << *p.tp_head_dim;
  if (p.cp > 1)
    out << YAML::Key << "parallelism_config_cp_comm_strategy" << YAML::Value << p.cp_comm_strategy;
  if (p.sp > 1) {
    out << YAML::Key << "parallelism_config_sp_size" << YAML::Value << p.sp;
    out << YAML::Key << "parallelism_config_sp_backend" << YAML::Value << "deepspeed";
    if (p.sp_seq_length)
      out << YAML::Key << "parallelism_config_sp_seq_length" << YAML::Value << *p.sp_seq_length;
    out << YAML::Key << "parallelism_config_sp_seq_length_is_variable" << YAML::Value
        << p.sp_seq_length_is_variable;
    out << YAML::Key << "parallelism_config_sp_attn_implementation" << YAML::Value << "sdpa";
  }
  out << YAML::EndMap;
}

}  // namespace

std::string to_yaml(const LaunchConfig& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "compute_environment" << YAML::Value << c.compute_environment;
  out << YAML::Key << "debug" << YAML::Value << c.debug;
  const std::string distributed = to_string(c.distributed_type);  // quoted NO: YAML 1.1 (PyYAML) reads it as false
  out << YAML::Key << "distributed_type" << YAML::Value << (distributed == "NO" ? YAML::SingleQuoted : YAML::Auto) << distributed;
  out << YAML::Key << "downcast_bf16" << YAML::Value << YAML::SingleQuoted << c.downcast_bf16;
  out << YAML::Key << "enable_cpu_affinity" << YAML::Value << c.enable_cpu_affinity;
  if (c.mixed_precision == MixedPrecision::FP8) config::write_fp8(out, c.fp8);
  if (c.distributed_type == DistributedType::FSDP) {
    const auto& f = c.fsdp;
    out << YAML::Key << "fsdp_config" << YAML::Value << YAML::BeginMap;
    for (const auto& flag : fsdp_flags()) out << YAML::Key << flag.config_key << YAML::Value << f.*flag.member;
    out << YAML::Key << "fsdp_auto_wrap_policy" << YAML::Value << f.auto_wrap_policy;
    if (!f.backward_prefetch.empty()) out << YAML::Key << "fsdp_backward_prefetch" << YAML::Value << f.backward_prefetch;
    if (f.auto_wrap_policy == "SIZE_BASED_WRAP") out << YAML::Key << "fsdp_min_num_params" << YAML::Value << f.min_num_params;
    if (f.reshard_after_forward) out << YAML::Key << "fsdp_reshard_after_forward" << YAML::Value << *f.reshard_after_forward;
    out << YAML::Key << "fsdp_sharding_strategy" << YAML::Value << to_string(f.sharding_strategy);
    out << YAML::Key << "fsdp_state_dict_type" << YAML::Value << f.state_dict_type;
    if (!f.transformer_layer_cls_to_wrap.empty())
      out << YAML::Key << "fsdp_transformer_layer_cls_to_wrap" << YAML::Value << text::join(f.transformer_layer_cls_to_wrap, ",");
    out << YAML::Key << "fsdp_version" << YAML::Value << f.version;
    out << YAML::EndMap;
  }
  if (c.distributed_type == DistributedType::DEEPSPEED) {
    const auto& d = c.deepspeed;
    out << YAML::Key << "deepspeed_config" << YAML::Value << YAML::BeginMap;
    if (!d.config_file.empty()) out << YAML::Key << "deepspeed_config_file" << YAML::Value << d.config_file;
    if (c.gradient_accumulation_steps)
      out << YAML::Key << "gradient_accumulation_steps" << YAML::Value << *c.gradient_accumulation_steps;
    if (d.gradient_clipping) out << YAML::Key << "gradient_clipping" << YAML::Value << *d.gradient_clipping;
    out << YAML::Key << "offload_optimizer_device" << YAML::Value << d.offload_optimizer_device;
    out << YAML::Key << "offload_param_device" << YAML::Value << d.offload_param_device;
    if (d.zero3_init_flag) out << YAML::Key << "zero3_init_flag" << YAML::Value << *d.zero3_init_flag;
    out << YAML::Key << "zero3_save_16bit_model" << YAML::Value << d.zero3_save_16bit_model;
    out << YAML::Key << "zero_stage" << YAML::Value << d.zero_stage;
    out << YAML::EndMap;
  } else if (c.gradient_accumulation_steps) {
    out << YAML::Key << "gradient_accumulation_steps" << YAML::Value << *c.gradient_accumulation_steps;
  }
  out << YAML::Key << "gpu_ids" << YAML::Value << c.gpu_ids;
  if (!c.log_with.empty()) out << YAML::Key << "log_with" << YAML::Value << c.log_with;
  out << YAML::Key << "machine_rank" << YAML::Value << c.machine_rank;
  if (!c.main_process_ip.empty()) out << YAML::Key << "main_process_ip" << YAML::Value << c.main_process_ip;
  if (c.main_process_port) out << YAML::Key << "main_process_port" << YAML::Value << *c.main_process_port;
  out << YAML::Key << "main_training_function" << YAML::Value << c.main_training_function;
  out << YAML::Key << "mixed_precision" << YAML::Value << YAML::SingleQuoted << to_string(c.mixed_precision);
  if (!c.mpirun_hostfile.empty())
    out << YAML::Key << "mpirun_config" << YAML::Value << YAML::BeginMap << YAML::Key << "mpirun_hostfile"
        << YAML::Value << c.mpirun_hostfile << YAML::EndMap;
  out << YAML::Key << "num_machines" << YAML::Value << c.num_machines;
  out << YAML::Key << "num_processes" << YAML::Value << c.num_processes;
  if (c.parallelism) write_parallelism(out, *c.parallelism);
  out << YAML::Key << "rdzv_backend" << YAML::Value << c.rdzv_backend;
  out << YAML::Key << "same_network" << YAML::Value << c.same_network;
  out << YAML::Key << "use_cpu" << YAML::Value << c.use_cpu;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

void save_config(const LaunchConfig& config, const std::string& path) {
  fs::path target(path);
  if (std::error_code unreadable; fs::is_directory(target, unreadable))
    throw ConfigError(fmt::format("cannot write the config to {:?}: it is a directory; give a file's path, such as {:?}",
                                  path, (target / "default_config.yaml").string()));
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  fs::path tmp = target;
  tmp += ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw ConfigError(fmt::format("cannot write config file {:?}", tmp.string()));
    out << to_yaml(config);
    if (!out.flush()) throw ConfigError(fmt::format("cannot write config file {:?}", tmp.string()));
  }
  std::error_code failed;
  fs::rename(tmp, target, failed);
  if (failed) {
    const auto why = failed.message();
    fs::remove(tmp, failed);
    throw ConfigError(fmt::format("cannot write config file {:?}: {}", path, why));
  }
}

std::string default_config_path() {
  if (const auto xdg = env_var("XDG_CACHE_HOME")) return *xdg + "/xlr8/default_config.yaml";
  return env_var("HOME").value_or(".") + "/.cache/xlr8/default_config.yaml";
}

}  // namespace xlr8
