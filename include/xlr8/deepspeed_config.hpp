#pragma once
// A DeepSpeed JSON config, read with DeepSpeed's keys, defaults and checks (research/peers.md §1.2-1.4),
// so that a file written for DeepSpeed configures xlr8 the same way:
// - a key DeepSpeed does not have is a ConfigError naming the closest valid one;
// - a key DeepSpeed has and xlr8 does not implement is accepted while it keeps its feature off (its
//   default, or `"enabled": false`), and refused with one line when it turns the feature on;
// - performance hints without a counterpart here (contiguous_gradients, reduce_scatter, ...) are accepted;
// - "auto" (the values Accelerate fills when it drives DeepSpeed) is recorded in `auto_keys` and must be
//   filled (fill_auto) before the config is used.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/deepspeed_elasticity.hpp"
#include "xlr8/loss_scaler.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::deepspeed {

// "fp16": DeepSpeed's dynamic loss scaler when loss_scale is 0, a static scale otherwise.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
  bool auto_cast = false;
};

// "zero_optimization.offload_optimizer" / "offload_param".
struct OffloadConfig {
  std::string device = "none";  // none | cpu | nvme
  std::string nvme_path;
  bool pin_memory = true;
  double ratio = 1.0;
  // device nvme: the pool of aligned host buffers the state moves through (DeepSpeed's defaults: 4 for the
  // optimizer, 5 for parameters; 0 here means that default).
  int buffer_count = 0;
  int64_t buffer_size = 100'000'000;   // offload_param: elements of each buffer
  int64_t max_in_cpu = 1'000'000'000;  // offload_param: elements kept in host memory
  bool pipeline_read = false, pipeline_write = false;  // offload_optimizer: reads ahead / writes behind
};

// The top-level "aio" section: how the disk tier's transfers are issued.
struct AioConfig {
  int64_t block_size = 1'048'576;
  int queue_depth = 8;
  int intra_op_parallelism = 1;  // its old name thread_count is read too
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;  // GPUDirect Storage: refused
};

// "zero_optimization.leaf_module": under ZeRO-3 a leaf module is one unit, gathered whole.
struct LeafModuleConfig {
  std::vector<std::string> classes, names, name_suffixes;
};

// "zero_optimization". Sizes count elements, not bytes, as DeepSpeed's do.
struct ZeroConfig {
  int stage = 0;
  bool overlap_comm = false;  // when absent, DeepSpeed turns it on for stage 3 only
  int64_t reduce_bucket_size = 500'000'000;
  int64_t allgather_bucket_size = 500'000'000;
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  int64_t stage3_param_persistence_threshold = 100'000;
  int64_t stage3_max_live_parameters = 1'000'000'000;
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool ignore_unused_parameters = true;
  OffloadConfig offload_optimizer, offload_param;
  AioConfig aio;  // the top-level "aio" section, kept here beside the offload it serves
  LeafModuleConfig leaf_module;
  bool offloads() const { return offload_optimizer.device != "none" || offload_param.device != "none"; }
};

// "optimizer" / "scheduler": a type and its params, as given (params may still hold "auto").
struct TypedSection {
  std::string type;
  nlohmann::json params = nlohmann::json::object();
};

struct Config {
  // Any two of the three derive the third (resolve_batch_sizes); unset when absent.
  std::optional<int64_t> train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps;
  double gradient_clipping = 1.0;  // 0 disables
  // The mesh deepspeed.initialize builds when both are given (Ulysses: sequence_parallel_size ranks split
  // each sample's sequence; data_parallel_size ranks read different samples). Unset when absent.
  std::optional<int64_t> sequence_parallel_size, data_parallel_size;
  int64_t autotp_size = 0;  // tensor_parallel.autotp_size: the mesh's tp (0 or 1: none)
  Fp16Config fp16;
  bool bf16 = false;  // "bf16.enabled" (or its older name "bfloat16")
  ZeroConfig zero_optimization;
  std::optional<TypedSection> optimizer, scheduler;
  int steps_per_print = 10;
  bool wall_clock_breakdown = false;
  std::string tag_validation = "Warn";  // checkpoint.tag_validation: Warn | Ignore | Fail
  bool dataloader_drop_last = false;
  // "pipeline" (deepspeed_pipeline.hpp): DeepSpeed itself takes these from the PipelineModule's arguments and
  // ignores the section; here `stages` sets the launch's pp size, `partition` must agree with the module's
  // partition_method ("best", the default, is its "parameters"), and activation_checkpoint_interval applies when
  // the module sets none.
  struct Pipeline {
    std::optional<int64_t> stages;  // unset: "auto" or absent
    std::string partition = "best";
    int64_t activation_checkpoint_interval = 0;
  } pipeline;
  // "elasticity": when enabled, resolve_batch_sizes takes the batch terms from compute_elastic_batch.
  ElasticityConfig elasticity;
  // Dotted paths whose value is "auto" (e.g. "optimizer.params.lr"), in the order they are read.
  std::vector<std::string> auto_keys;
  nlohmann::json document;  // as given
  std::string origin;       // its path, or "the DeepSpeed config": errors name it
};

// Reads a config from a JSON object. `origin` names it in errors (a path, or "the DeepSpeed config").
Config parse_config(const nlohmann::json& document, const std::string& origin = "the DeepSpeed config");
// A path to a JSON file, or JSON text (starting with '{'): as DeepSpeed's `config` argument.
Config load_config(const std::string& path_or_json);

// ConfigError naming `section`'s first parameter that is not one of `known` (with the closest one);
// `kind` is "optimizer" or "scheduler".
void check_section_params(const TypedSection& section, const char* kind, const std::vector<std::string>& known);

// Replaces "auto" at the given dotted paths and reads the result again; paths that are not "auto" in
// the document are left alone (the file's own value wins, as in Accelerate).
Config fill_auto(const Config& config, const std::map<std::string, nlohmann::json>& values);
// ConfigError naming every key still "auto" (and who fills such values) when any is left.
void require_resolved(const Config& config);

// DeepSpeed's batch-size relation train_batch_size = micro × accumulation × data-parallel ranks: any two
// derive the third, one alone takes accumulation 1; values that disagree are DeepSpeed's error. With
// elasticity enabled, all three come from compute_elastic_batch for this data-parallel size.
struct BatchSizes {
  int64_t train_batch_size = 0, micro_batch_per_gpu = 0, gradient_accumulation_steps = 0;
};
BatchSizes resolve_batch_sizes(const Config& config, int data_parallel_size);

// The fp16 section's scaler, for a program that checks its rules step by step. Stage 0 (DeepSpeed's
// non-ZeRO fp16 optimizer) ignores hysteresis: every overflow halves the scale.
LossScalerOptions loss_scaler_options(const Fp16Config& fp16, int zero_stage);

// What a resolved config means for a training, in one place (src/config/deepspeed_meaning.cpp); the ZeRO keys
// map onto the strategies' options in parallel/shard/zero_options.hpp.
// Its precision: fp16, else bf16, else none.
MixedPrecision mixed_precision(const Config& config);
// Its fp16 section's scaler at its ZeRO stage.
LossScalerOptions loss_scaler(const Config& config);
// Its tensor_parallel section when it has partition_config rules or a preset_model (what splits the model);
// null otherwise (AutoTP splits it).
nlohmann::json tensor_rules(const Config& config);
// The mesh the JSON names (sequence_parallel_size, data_parallel_size, tensor_parallel.autotp_size, pipeline.stages)
// must be the job's: ConfigError naming the key, both sizes and the launch flag otherwise.
struct MeshSizes {
  int dp = 1, sp = 1, tp = 1, pp = 1;
};
void check_mesh(const Config& config, const MeshSizes& mesh);
// The engine takes its settings from the JSON only: a launch that selects FSDP, or another accumulation, is a
// ConfigError naming both.
void check_launch(const Settings& settings, const BatchSizes& sizes);

}  // namespace xlr8::deepspeed
