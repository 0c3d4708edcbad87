#pragma once
// What a job asks for (strategy, precision, FSDP / DeepSpeed / parallelism settings) and where the
// process sits (topology), in the exact variables `accelerate launch` and torchrun set for each worker.
// Launcher and workers share these mappings.
#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/env.hpp"

namespace xlr8 {

enum class DistributedType { NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED };
enum class MixedPrecision { NO, FP16, BF16, FP8 };
enum class ShardingStrategy { FULL_SHARD = 1, SHARD_GRAD_OP = 2, NO_SHARD = 3, HYBRID_SHARD = 4, HYBRID_SHARD_ZERO2 = 5 };

std::string to_string(DistributedType t);
std::string to_string(MixedPrecision p);  // "no", "fp16", "bf16", "fp8"
std::string to_string(ShardingStrategy s);
// Parsers name `what` (the key or variable) in their error, with the allowed values.
MixedPrecision parse_mixed_precision(const std::string& value, const std::string& what);
ShardingStrategy parse_sharding_strategy(const std::string& value, const std::string& what);
DistributedType parse_distributed_type(const std::string& value, const std::string& what);

struct FsdpSettings {
  int version = 1;
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  std::optional<bool> reshard_after_forward;                   // FSDP2; FSDP1 derives it from the strategy
  std::string auto_wrap_policy = "NO_WRAP";                    // TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP
  std::vector<std::string> transformer_layer_cls_to_wrap;
  long min_num_params = 100000000;
  std::string backward_prefetch;                               // BACKWARD_PRE | BACKWARD_POST | NO_PREFETCH | ""
  std::string state_dict_type = "FULL_STATE_DICT";             // FULL_ | SHARDED_ | LOCAL_STATE_DICT
  bool forward_prefetch = false;
  bool use_orig_params = true;
  bool cpu_ram_efficient_loading = true;
  bool sync_module_states = true;
  bool offload_params = false;
  bool activation_checkpointing = false;
  bool operator==(const FsdpSettings&) const = default;
};

// The FSDP switches, one row each: the member, its key in the config file, its environment variable.
struct FsdpFlag {
  bool FsdpSettings::*member;
  const char* config_key;
  const char* env_var;
};
const std::vector<FsdpFlag>& fsdp_flags();
// Allowed values, shared by the config file, the environment and `xlr8 config`.
extern const std::vector<std::string> kAutoWrapPolicies;
extern const std::vector<std::string> kBackwardPrefetchValues;
extern const std::vector<std::string> kStateDictTypes;
extern const std::vector<std::string> kOffloadDevices;

struct DeepSpeedSettings {
  int zero_stage = 2;
  std::string offload_optimizer_device = "none";  // none | cpu | nvme
  std::string offload_param_device = "none";
  std::string offload_optimizer_nvme_path;
  std::string offload_param_nvme_path;
  std::optional<double> gradient_clipping;
  // Record the build at ZeRO-3 (DeepSpeed's zero.Init) so that no rank holds the whole model; unset: on at
  // ZeRO-3, as Accelerate's default (is_zero3).
  std::optional<bool> zero3_init_flag;
  bool zero3_save_16bit_model = false;
  std::string config_file;                        // a full DeepSpeed JSON config
  bool operator==(const DeepSpeedSettings&) const = default;
};

// Accelerate's ParallelismConfig sizes, in mesh order pp, dp_replicate, dp_shard, cp, sp, tp. cp (context
// parallelism) and sp (Ulysses sequence parallelism) both split the sequence; at most one is above 1. pp (pipeline
// stages, the outermost) is xlr8's, named as Accelerate names the others, with torchtitan's meaning.
struct ParallelismSettings {
  int dp_replicate = 1, dp_shard = 1, cp = 1, sp = 1, tp = 1;
  int pp = 1;
  // GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble (torch.distributed.pipelining's names)
  std::string pp_schedule = "1F1B";
  int pp_microbatches = 0;           // micro-batches a step under pp; 0: the pp size
  int pp_virtual_stages = 0;         // chunks a rank (interleaved schedules); 0: 2 under Interleaved1F1B, else 1
  std::string cp_comm_strategy = "allgather";  // allgather | alltoall (context-parallel attention)
  // parallelism_config_sp_seq_length / _is_variable: with a fixed length, every sharded batch must have it.
  std::optional<long> sp_seq_length;
  bool sp_seq_length_is_variable = true;
  // parallelism_config_tp_head_dim (xlr8's key): the features of one attention head, for the plans prepare()
  // makes (AutoTP, XLR8_TP_PLAN_FILE) and the check of a program's own; a split that cuts a head is refused.
  std::optional<long> tp_head_dim;
  int total() const { return pp * dp_replicate * dp_shard * cp * sp * tp; }
  bool operator==(const ParallelismSettings&) const = default;
};
// ConfigError when cp and sp are both above 1: both split the sequence (Accelerate refuses it too).
void check_sequence_split(const ParallelismSettings& p);

// Accelerate's fp8 settings (the config file's fp8_config, `--fp8_*` flags, ACCELERATE_FP8_* variables), with
// Accelerate's defaults. Read with mixed_precision fp8 only.
struct Fp8Settings {
  std::string backend;           // AO (torchao's dynamic scaling) | TE (Transformer Engine's delayed) | "": AO
  bool use_autocast_during_eval = false;
  int margin = 0;                // TE: the scale leaves 2^margin of headroom
  int interval = 1;              // TE: steps between scale updates
  std::string fp8_format = "HYBRID";  // TE: HYBRID (e4m3 forward, e5m2 gradients) | E4M3
  int amax_history_len = 1024;   // TE
  std::string amax_compute_algo = "most_recent";  // TE: max | most_recent
  std::array<bool, 3> override_linear_precision{};  // TE: fprop, dgrad, wgrad gemms in the compute precision
  std::string opt_level = "O2";  // MS-AMP's; read for Accelerate's files, MS-AMP itself is refused
  bool enable_fsdp_float8_all_gather = true;  // AO
  bool pad_inner_dim = true;                  // AO
  // The program's alone (AcceleratorOptions::fp8; no file key, flag or variable), as Accelerate's AORecipeKwargs:
  std::string ao_recipe = "tensorwise";  // AO: torchao's recipe, tensorwise | rowwise
  bool skip_first_and_last_linear = true;  // the filter Accelerate gives AO (TE converts every layer it can)
  int64_t min_linear_features = 0;         // torchao's size filter: smaller layers stay in the compute dtype
  bool strict_linear_widths = false;       // a Linear whose widths are not multiples of 16 is refused, not skipped
  bool operator==(const Fp8Settings&) const = default;
};

struct Settings {
  MixedPrecision mixed_precision = MixedPrecision::NO;
  Fp8Settings fp8;  // exported and read with mixed_precision fp8
  // Set when the launch (flag, config key or ACCELERATE_GRADIENT_ACCUMULATION_STEPS) named it; it then wins
  // over the program's own AcceleratorOptions value, as in Accelerate. Empty: the program decides (else 1).
  std::optional<int> gradient_accumulation_steps;
  bool use_cpu = false;
  bool debug = false;
  bool cpu_affinity = false;  // ACCELERATE_CPU_AFFINITY: bind each local rank to its own cores
  std::optional<FsdpSettings> fsdp;           // set: ACCELERATE_USE_FSDP=true
  std::optional<DeepSpeedSettings> deepspeed; // set: ACCELERATE_USE_DEEPSPEED=true
  std::optional<ParallelismSettings> parallelism;
  bool operator==(const Settings&) const = default;
  // The one place the strategy is decided (as Accelerate's PartialState does): DeepSpeed when asked for;
  // otherwise NO on one process; else FSDP when asked for, else MULTI_GPU or MULTI_CPU.
  DistributedType distributed_type(bool distributed, bool gpu) const;
  // Which family of Accelerate's distributed types these settings ask for, whatever the device and size:
  // "ddp", "fsdp" or "deepspeed" (the data-parallel strategy itself is ParallelStrategy::name()).
  std::string distributed_type_name() const;
};

struct Topology {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;
  int node_rank = 0, num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  // which protocol the values came from: torchrun, slurm, openmpi, pmi, none
  std::string job_id;           // scheduler_job_id(): ranks of other jobs are refused at rendezvous
  bool distributed() const { return world_size > 1; }
  bool operator==(const Topology&) const = default;
};

// Environment protocol. `*_to_env` gives exactly the variables `accelerate launch` / torchrun set.
std::map<std::string, std::string> settings_to_env(const Settings& settings);
std::map<std::string, std::string> topology_to_env(const Topology& topology);
Settings settings_from_env(const Env& env);

// The accumulation a program runs with: the launch's value when it named one (as Accelerate's
// ACCELERATE_GRADIENT_ACCUMULATION_STEPS wins over the constructor's argument), else the program's, else 1.
// When `report`, a program value the launch overrides is named in a warning: neither side is dropped silently.
int gradient_accumulation_steps_for(const Settings& launch, std::optional<int> program, bool report);
// torchrun / Accelerate variables first, then Slurm, OpenMPI, MVAPICH, PMI; no variables: a single
// process. Without MASTER_PORT, a Slurm or MPI job rendezvouses on port_for_job(scheduler_job_id(...));
// without MASTER_ADDR, on 127.0.0.1 when it runs on one node, on the first host of the Slurm step's
// node list across Slurm nodes, and is a ConfigError naming MASTER_ADDR across MPI nodes.
Topology topology_from_env(const Env& env);

// Whether the starter of `topology` sets no node index (OpenMPI, MVAPICH, PMI): the node index and count
// then come from the hosts every rank reports at rendezvous.
bool node_index_from_hosts(const Topology& topology);
// "slurm:<cluster>:<job>.<step>", "OMPI_MCA_ess_base_jobid:<id>", ...: what identifies one job (step) of the
// scheduler that started the process; nullopt when it sets nothing of the kind.
std::optional<std::string> scheduler_job_id(const Env& env, const std::string& source);
// A port in 20000-29999 that every rank derives alike from the job's id.
int port_for_job(const std::string& job_id);
// First host of a Slurm host list: "node[07-09,12],gpu3" -> "node07", "r[1-2]-n[01-04]" -> "r1-n01".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace xlr8
