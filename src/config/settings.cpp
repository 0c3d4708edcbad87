#include "xlr8/settings.hpp"

#include <fmt/format.h>

#include <map>

#include "config/config_section.hpp"
#include "config/fp8_config.hpp"
#include "core/log.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

[[noreturn]] void invalid_value(const std::string& value, const std::vector<std::string>& allowed, const std::string& what) {
  throw ConfigError(fmt::format("{}: invalid value {:?}; allowed: {}{}", what, value, text::join(allowed),
                                text::suggestion(value, allowed)));
}

template <class E>
struct Names {
  std::vector<std::pair<E, std::string>> items;
  std::string name(E e) const {
    for (auto& [v, n] : items)
      if (v == e) return n;
    return "?";
  }
  std::vector<std::string> all() const {
    std::vector<std::string> out;
    for (auto& [v, n] : items) out.push_back(n);
    return out;
  }
  E parse(const std::string& value, const std::string& what, bool case_insensitive = true) const {
    for (auto& [v, n] : items)
      if (n == value || (case_insensitive && text::upper(n) == text::upper(value))) return v;
    invalid_value(value, all(), what);
  }
};

const Names<DistributedType> kDistributedTypes{{{DistributedType::NO, "NO"},
                                                {DistributedType::MULTI_CPU, "MULTI_CPU"},
                                                {DistributedType::MULTI_GPU, "MULTI_GPU"},
                                                {DistributedType::FSDP, "FSDP"},
                                                {DistributedType::DEEPSPEED, "DEEPSPEED"}}};
const Names<MixedPrecision> kPrecisions{
    {{MixedPrecision::NO, "no"}, {MixedPrecision::FP16, "fp16"}, {MixedPrecision::BF16, "bf16"}, {MixedPrecision::FP8, "fp8"}}};
const Names<ShardingStrategy> kStrategies{{{ShardingStrategy::FULL_SHARD, "FULL_SHARD"},
                                           {ShardingStrategy::SHARD_GRAD_OP, "SHARD_GRAD_OP"},
                                           {ShardingStrategy::NO_SHARD, "NO_SHARD"},
                                           {ShardingStrategy::HYBRID_SHARD, "HYBRID_SHARD"},
                                           {ShardingStrategy::HYBRID_SHARD_ZERO2, "HYBRID_SHARD_ZERO2"}}};

std::string bool_text(bool b) { return b ? "true" : "false"; }

}  // namespace

void config::check_choice(const std::string& value, const std::vector<std::string>& allowed, const std::string& what) {
  for (auto& a : allowed)
    if (a == value) return;
  invalid_value(value, allowed, what);
}

std::string config::state_dict_type_of(const std::string& value, const std::string& what) {
  static const std::map<std::string, std::string> by_number{
      {"1", "FULL_STATE_DICT"}, {"2", "LOCAL_STATE_DICT"}, {"3", "SHARDED_STATE_DICT"}};
  if (auto it = by_number.find(value); it != by_number.end()) return it->second;
  const auto name = text::upper(value);
  check_choice(name, kStateDictTypes, what);
  return name;
}

const std::vector<std::string>& config::pp_schedules() {
  static const std::vector<std::string> schedules = {"gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble"};
  return schedules;
}

std::string config::pp_schedule_spelling(const std::string& lower) {
  return lower == "gpipe"             ? "GPipe"
         : lower == "1f1b"            ? "1F1B"
         : lower == "interleaved1f1b" ? "Interleaved1F1B"
                                      : "InterleavedZeroBubble";
}

const std::vector<std::string> kAutoWrapPolicies = {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"};
const std::vector<std::string> kBackwardPrefetchValues = {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"};
const std::vector<std::string> kStateDictTypes = {"FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"};
const std::vector<std::string> kOffloadDevices = {"none", "cpu", "nvme"};

const std::vector<FsdpFlag>& fsdp_flags() {
  static const std::vector<FsdpFlag> flags = {
      {&FsdpSettings::forward_prefetch, "fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH"},
      {&FsdpSettings::use_orig_params, "fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS"},
      {&FsdpSettings::cpu_ram_efficient_loading, "fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING"},
      {&FsdpSettings::sync_module_states, "fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES"},
      {&FsdpSettings::offload_params, "fsdp_offload_params", "FSDP_OFFLOAD_PARAMS"},
      {&FsdpSettings::activation_checkpointing, "fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING"},
  };
  return flags;
}

std::string to_string(DistributedType t) { return kDistributedTypes.name(t); }
std::string to_string(MixedPrecision p) { return kPrecisions.name(p); }
std::string to_string(ShardingStrategy s) { return kStrategies.name(s); }

MixedPrecision parse_mixed_precision(const std::string& value, const std::string& what) {
  return kPrecisions.parse(value, what);
}

ShardingStrategy parse_sharding_strategy(const std::string& value, const std::string& what) {
  // Accelerate also accepts the enum's integer value (1..5).
  if (value.size() == 1 && value[0] >= '1' && value[0] <= '5') return static_cast<ShardingStrategy>(value[0] - '0');
  return kStrategies.parse(value, what);
}

DistributedType parse_distributed_type(const std::string& value, const std::string& what) {
  return kDistributedTypes.parse(value, what, /*case_insensitive=*/false);
}

DistributedType Settings::distributed_type(bool distributed, bool gpu) const {
  if (deepspeed) return DistributedType::DEEPSPEED;
  if (!distributed) return DistributedType::NO;
  if (fsdp) return DistributedType::FSDP;
  return gpu ? DistributedType::MULTI_GPU : DistributedType::MULTI_CPU;
}

std::string Settings::distributed_type_name() const {
  switch (distributed_type(/*distributed=*/true, /*gpu=*/false)) {
    case DistributedType::DEEPSPEED: return "deepspeed";
    case DistributedType::FSDP: return "fsdp";
    default: return "ddp";
  }
}

std::map<std::string, std::string> settings_to_env(const Settings& s) {
  std::map<std::string, std::string> env;
  env["ACCELERATE_MIXED_PRECISION"] = to_string(s.mixed_precision);
  if (s.mixed_precision == MixedPrecision::FP8) config::fp8_to_env(s.fp8, env);
  if (s.gradient_accumulation_steps)
    env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = std::to_string(*s.gradient_accumulation_steps);
  if (s.use_cpu) env["ACCELERATE_USE_CPU"] = "true";
  if (s.debug) env["ACCELERATE_DEBUG_MODE"] = "true";
  if (s.cpu_affinity) env["ACCELERATE_CPU_AFFINITY"] = "1";
  if (const auto& f = s.fsdp) {
    env["ACCELERATE_USE_FSDP"] = "true";
    env["FSDP_VERSION"] = std::to_string(f->version);
    env["FSDP_SHARDING_STRATEGY"] = to_string(f->sharding_strategy);
    if (f->reshard_after_forward) env["FSDP_RESHARD_AFTER_FORWARD"] = bool_text(*f->reshard_after_forward);
    env["FSDP_AUTO_WRAP_POLICY"] = f->auto_wrap_policy;
    if (!f->transformer_layer_cls_to_wrap.empty())
      env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = text::join(f->transformer_layer_cls_to_wrap, ",");
    env["FSDP_MIN_NUM_PARAMS"] = std::to_string(f->min_num_params);
    if (!f->backward_prefetch.empty()) env["FSDP_BACKWARD_PREFETCH"] = f->backward_prefetch;
    env["FSDP_STATE_DICT_TYPE"] = f->state_dict_type;
    for (const auto& flag : fsdp_flags()) env[flag.env_var] = bool_text((*f).*flag.member);
  }
  if (const auto& d = s.deepspeed) {
    env["ACCELERATE_USE_DEEPSPEED"] = "true";
    env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = std::to_string(d->zero_stage);
    if (d->gradient_clipping) env["ACCELERATE_GRADIENT_CLIPPING"] = fmt::format("{}", *d->gradient_clipping);
    env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] = d->offload_optimizer_device;
    env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] = d->offload_param_device;
    if (!d->offload_optimizer_nvme_path.empty())
      env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] = d->offload_optimizer_nvme_path;
    if (!d->offload_param_nvme_path.empty())
      env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] = d->offload_param_nvme_path;
    if (d->zero3_init_flag) env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = bool_text(*d->zero3_init_flag);
    env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] = bool_text(d->zero3_save_16bit_model);
    if (!d->config_file.empty()) env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = d->config_file;
  }
  if (const auto& p = s.parallelism) {
    env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true";
    env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] = std::to_string(p->dp_replicate);
    env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] = std::to_string(p->dp_shard);
    env["PARALLELISM_CONFIG_CP_SIZE"] = std::to_string(p->cp);
    env["PARALLELISM_CONFIG_TP_SIZE"] = std::to_string(p->tp);
    // Without stages pipeline_step() still accumulates the micro-batches.
    if (p->pp_microbatches > 0) env["PARALLELISM_CONFIG_PP_MICROBATCHES"] = std::to_string(p->pp_microbatches);
    if (p->pp > 1) {
      env["PARALLELISM_CONFIG_PP_SIZE"] = std::to_string(p->pp);
      env["PARALLELISM_CONFIG_PP_SCHEDULE"] = p->pp_schedule;
      if (p->pp_virtual_stages > 0) env["PARALLELISM_CONFIG_PP_VIRTUAL_STAGES"] = std::to_string(p->pp_virtual_stages);
    }
    if (p->tp_head_dim) env["PARALLELISM_CONFIG_TP_HEAD_DIM"] = std::to_string(*p->tp_head_dim);
    if (p->cp > 1) env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] = p->cp_comm_strategy;
    if (p->sp > 1) {
      env["PARALLELISM_CONFIG_SP_SIZE"] = std::to_string(p->sp);
      env["PARALLELISM_CONFIG_SP_BACKEND"] = "deepspeed";
      if (p->sp_seq_length) env["PARALLELISM_CONFIG_SP_SEQ_LENGTH"] = std::to_string(*p->sp_seq_length);
      env["PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE"] = bool_text(p->sp_seq_length_is_variable);
      env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] = "sdpa";
    }
  }
  return env;
}

std::map<std::string, std::string> topology_to_env(const Topology& t) {
  return {
      {"RANK", std::to_string(t.rank)},
      {"WORLD_SIZE", std::to_string(t.world_size)},
      {"LOCAL_RANK", std::to_string(t.local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(t.local_world_size)},
      {"GROUP_RANK", std::to_string(t.node_rank)},
      {"NODE_RANK", std::to_string(t.node_rank)},
      {"ROLE_RANK", std::to_string(t.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(t.world_size)},
      {"MASTER_ADDR", t.master_addr},
      {"MASTER_PORT", std::to_string(t.master_port)},
  };
}

namespace {


// A variable `accelerate launch` set to a value the user gave, not to an empty string or Python's None.
std::optional<std::string> given(const Env& env, const char* name) {
  auto v = env.get(name);
  if (v && (v->empty() || *v == "None")) return std::nullopt;
  return v;
}

FsdpSettings fsdp_from_env(const Env& env) {
  FsdpSettings f;
  f.version = static_cast<int>(env.get_positive("FSDP_VERSION", 1));
  if (f.version > 2) throw ConfigError(fmt::format("FSDP_VERSION={}: allowed values are 1 and 2", f.version));
  if (auto v = env.get("FSDP_SHARDING_STRATEGY")) f.sharding_strategy = parse_sharding_strategy(*v, "FSDP_SHARDING_STRATEGY");
  // `accelerate launch` exports FSDP_SHARDING_STRATEGY always (FULL_SHARD unless given) and the strategy an
  // FSDP1 file names under fsdp_reshard_after_forward here: a strategy given on its own variable wins, else this one.
  if (auto v = env.get("FSDP_RESHARD_AFTER_FORWARD")) {
    if (auto b = parse_bool(*v)) f.reshard_after_forward = b;
    else if (f.version != 1)
      throw ConfigError(fmt::format("FSDP_RESHARD_AFTER_FORWARD={:?} must be true or false with FSDP_VERSION=2", *v));
    else if (auto named = parse_sharding_strategy(*v, "FSDP_RESHARD_AFTER_FORWARD");
             f.sharding_strategy == ShardingStrategy::FULL_SHARD)
      f.sharding_strategy = named;
  }
  if (auto v = env.get("FSDP_AUTO_WRAP_POLICY")) {
    f.auto_wrap_policy = text::upper(*v);
    config::check_choice(f.auto_wrap_policy, kAutoWrapPolicies, "FSDP_AUTO_WRAP_POLICY");
  }
  if (auto v = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")) f.transformer_layer_cls_to_wrap = text::split(*v, ',');
  if (auto v = env.get_int("FSDP_MIN_NUM_PARAMS")) f.min_num_params = *v;
  if (auto v = env.get("FSDP_BACKWARD_PREFETCH")) {
    f.backward_prefetch = text::upper(*v);
    config::check_choice(f.backward_prefetch, kBackwardPrefetchValues, "FSDP_BACKWARD_PREFETCH");
  }
  if (auto v = env.get("FSDP_STATE_DICT_TYPE")) {
    f.state_dict_type = config::state_dict_type_of(*v, "FSDP_STATE_DICT_TYPE");
  } else if (f.version == 2) {
    f.state_dict_type = "SHARDED_STATE_DICT";  // Accelerate's FSDP2 default
  }
  for (const auto& flag : fsdp_flags())
    if (auto b = env.get_bool(flag.env_var)) f.*flag.member = *b;
  // What xlr8 launch refuses arrives only from another launcher (`accelerate launch`): not dropped in silence.
  if (auto v = given(env, "FSDP_IGNORED_MODULES"))
    throw ConfigError(fmt::format("FSDP_IGNORED_MODULES={:?} is not supported: xlr8 shards every module; unset it", *v));
  if (env.get_bool("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD").value_or(false))
    log::warning("xlr8: FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD is true: xlr8 keeps no checkpointed activation on the "
                 "host (it recomputes them), so the setting is ignored");
  return f;
}

DeepSpeedSettings deepspeed_from_env(const Env& env) {
  DeepSpeedSettings d;
  if (auto v = env.get_int("ACCELERATE_DEEPSPEED_ZERO_STAGE")) {
    if (*v < 0 || *v > 3)
      throw ConfigError(fmt::format("ACCELERATE_DEEPSPEED_ZERO_STAGE={}: allowed values are 0, 1, 2, 3", *v));
    d.zero_stage = static_cast<int>(*v);
  }
  if (auto v = env.get("ACCELERATE_GRADIENT_CLIPPING"); v && !v->empty() && *v != "auto") {
    try {
      d.gradient_clipping = std::stod(*v);
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("ACCELERATE_GRADIENT_CLIPPING={:?} is not a number", *v));
    }
    if (*d.gradient_clipping < 0)
      throw ConfigError(fmt::format("ACCELERATE_GRADIENT_CLIPPING={} must be >= 0 (0 disables clipping)", *v));
  }
  for (auto [var, field] : {std::pair{"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", &d.offload_optimizer_device},
                            std::pair{"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", &d.offload_param_device}}) {
    if (auto v = env.get(var)) {
      *field = text::lower(*v);
      config::check_choice(*field, kOffloadDevices, var);
    }
  }
  d.offload_optimizer_nvme_path = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH").value_or("");
  d.offload_param_nvme_path = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH").value_or("");
  d.zero3_init_flag = env.get_bool("ACCELERATE_DEEPSPEED_ZERO3_INIT");
  d.zero3_save_16bit_model = env.get_bool("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL").value_or(false);
  d.config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE").value_or("");
  if (auto v = given(env, "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"))
    throw ConfigError(fmt::format("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES={:?} asks for DeepSpeed mixture-of-experts "
                                  "layers, which xlr8 does not have; unset it",
                                  *v));
  return d;
}

}  // namespace

Settings settings_from_env(const Env& env) {
  Settings s;
  if (auto v = env.get("ACCELERATE_MIXED_PRECISION")) s.mixed_precision = parse_mixed_precision(*v, "ACCELERATE_MIXED_PRECISION");
  if (s.mixed_precision == MixedPrecision::FP8) s.fp8 = config::fp8_from_env(env);
  if (env.get_int("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"))
    s.gradient_accumulation_steps = static_cast<int>(env.get_positive("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1));
  s.use_cpu = env.get_bool("ACCELERATE_USE_CPU").value_or(false);
  s.debug = env.get_bool("ACCELERATE_DEBUG_MODE").value_or(false);
  s.cpu_affinity = env.get_bool("ACCELERATE_CPU_AFFINITY").value_or(false);
  if (auto v = env.get("ACCELERATE_DYNAMO_BACKEND"); v && !v->empty() && text::upper(*v) != "NO")
    log::warning("xlr8: ACCELERATE_DYNAMO_BACKEND={}: xlr8 has no TorchDynamo (xlr8 launch refuses the backend); the "
                 "model runs as written",
                 *v);
  if (env.get_bool("ACCELERATE_USE_MEGATRON_LM").value_or(false))
    throw ConfigError("ACCELERATE_USE_MEGATRON_LM is true: xlr8 has no Megatron-LM engine; its tensor and pipeline "
                      "parallelism are parallelism_config_tp_size and parallelism_config_pp_size");
  bool use_fsdp = env.get_bool("ACCELERATE_USE_FSDP").value_or(false);
  bool use_deepspeed = env.get_bool("ACCELERATE_USE_DEEPSPEED").value_or(false);
  if (use_fsdp && use_deepspeed)
    throw ConfigError("ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED are both true; choose one strategy");
  if (use_fsdp) s.fsdp = fsdp_from_env(env);
  if (use_deepspeed) s.deepspeed = deepspeed_from_env(env);
  bool any_parallelism = env.get_bool("ACCELERATE_USE_PARALLELISM_CONFIG").value_or(false);
  for (auto n : {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE", "PARALLELISM_CONFIG_CP_SIZE",
                 "PARALLELISM_CONFIG_SP_SIZE", "PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_PP_SIZE"})
    any_parallelism = any_parallelism || env.has(n);
  if (any_parallelism) {
    ParallelismSettings p;
    p.dp_replicate = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", 1));
    p.dp_shard = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_DP_SHARD_SIZE", 1));
    p.cp = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_CP_SIZE", 1));
    p.tp = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_TP_SIZE", 1));
    p.pp = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_PP_SIZE", 1));
    if (auto schedule = env.get("PARALLELISM_CONFIG_PP_SCHEDULE")) {
      const auto lower = text::lower(*schedule);
      config::check_choice(lower, config::pp_schedules(), "PARALLELISM_CONFIG_PP_SCHEDULE");
      p.pp_schedule = config::pp_schedule_spelling(lower);
    }
    if (env.has("PARALLELISM_CONFIG_PP_MICROBATCHES"))
      p.pp_microbatches = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_PP_MICROBATCHES", 1));
    if (env.has("PARALLELISM_CONFIG_PP_VIRTUAL_STAGES"))
      p.pp_virtual_stages = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_PP_VIRTUAL_STAGES", 1));
    if (env.has("PARALLELISM_CONFIG_TP_HEAD_DIM")) p.tp_head_dim = env.get_positive("PARALLELISM_CONFIG_TP_HEAD_DIM", 1);
    if (auto strategy = env.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY")) {
      if (*strategy != "allgather" && *strategy != "alltoall")
        throw ConfigError(fmt::format("PARALLELISM_CONFIG_CP_COMM_STRATEGY={:?}: allowed values are allgather and alltoall",
                                      *strategy));
      p.cp_comm_strategy = *strategy;
    }
    p.sp = static_cast<int>(env.get_positive("PARALLELISM_CONFIG_SP_SIZE", 1));
    if (auto backend = env.get("PARALLELISM_CONFIG_SP_BACKEND"); backend && *backend != "deepspeed")
      throw ConfigError(fmt::format("PARALLELISM_CONFIG_SP_BACKEND={:?}: the allowed value is deepspeed (Ulysses)", *backend));
    // `accelerate launch` exports the Python None of a length not given.
    if (given(env, "PARALLELISM_CONFIG_SP_SEQ_LENGTH"))
      p.sp_seq_length = env.get_positive("PARALLELISM_CONFIG_SP_SEQ_LENGTH", 1);
    p.sp_seq_length_is_variable = env.get_bool("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE").value_or(true);
    if (auto attn = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"); attn && *attn != "sdpa")
      throw ConfigError(fmt::format("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION={:?}: the allowed value is sdpa (what "
                                    "xlr8::attention computes)",
                                    *attn));
    if (!p.sp_seq_length_is_variable && !p.sp_seq_length)
      throw ConfigError("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE is false but PARALLELISM_CONFIG_SP_SEQ_LENGTH is "
                        "not set; set the length every batch has, or make it true");
    if (p.sp_seq_length && *p.sp_seq_length % p.sp != 0)
      throw ConfigError(fmt::format("PARALLELISM_CONFIG_SP_SEQ_LENGTH={} is not divisible by PARALLELISM_CONFIG_SP_SIZE={}",
                                    *p.sp_seq_length, p.sp));
    check_sequence_split(p);
    s.parallelism = p;
  }
  return s;
}

void check_sequence_split(const ParallelismSettings& p) {
  if (p.cp > 1 && p.sp > 1)
    throw ConfigError(fmt::format("parallelism_config_cp_size {} and parallelism_config_sp_size {} both split the sequence "
                                  "(context parallelism and Ulysses); set one of them to 1",
                                  p.cp, p.sp));
}

int gradient_accumulation_steps_for(const Settings& launch, std::optional<int> program, bool report) {
  int steps = launch.gradient_accumulation_steps.value_or(program.value_or(1));
  if (steps < 1) throw ConfigError(fmt::format("gradient_accumulation_steps {} must be at least 1", steps));
  if (report && launch.gradient_accumulation_steps && program && *program != steps)
    log::warning("xlr8: gradient_accumulation_steps is {} as the launch asked (ACCELERATE_GRADIENT_ACCUMULATION_STEPS, "
                 "from `xlr8 launch --gradient_accumulation_steps` or the config file), not the program's {}",
                 steps, *program);
  return steps;
}

}  // namespace xlr8
