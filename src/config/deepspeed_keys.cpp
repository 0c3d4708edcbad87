// The tables of deepspeed_keys.hpp.
#include "config/deepspeed_keys.hpp"

namespace xlr8::deepspeed::keys {

const std::vector<Key> kTopLevel = {
    {"train_batch_size", Use::READ},
    {"train_micro_batch_size_per_gpu", Use::READ},
    {"gradient_accumulation_steps", Use::READ},
    {"gradient_clipping", Use::READ},
    {"fp16", Use::READ},
    {"bf16", Use::READ},
    {"bfloat16", Use::READ},
    {"zero_optimization", Use::READ},
    {"optimizer", Use::READ},
    {"scheduler", Use::READ},
    {"steps_per_print", Use::READ},
    {"wall_clock_breakdown", Use::READ},
    {"checkpoint", Use::READ},
    {"dataloader_drop_last", Use::READ},
    {"tensor_parallel", Use::READ},
    {"sequence_parallel_size", Use::READ},
    {"data_parallel_size", Use::READ},
    {"zero_allow_untested_optimizer", Use::HINT},
    {"zero_force_ds_cpu_optimizer", Use::HINT},
    {"memory_breakdown", Use::HINT},
    {"dump_state", Use::HINT},
    {"aio", Use::READ},
    {"pipeline", Use::READ},
    {"sparse_attention", Use::HINT},
    {"timers", Use::HINT},
    {"prescale_gradients", Use::DEFAULT, "false", "gradient prescaling"},
    {"gradient_predivide_factor", Use::DEFAULT, "1.0", "gradient predivision"},
    {"communication_data_type", Use::DEFAULT, "null", "a separate communication dtype"},
    {"seq_parallel_communication_data_type", Use::DEFAULT, "\"fp32\"", "a sequence-parallel communication dtype"},
    {"sparse_gradients", Use::DEFAULT, "false", "sparse gradients"},
    {"disable_allgather", Use::DEFAULT, "false", "broadcasts instead of all-gathers"},
    {"graph_harvesting", Use::DEFAULT, "false", "CUDA graph harvesting"},
    {"use_data_before_expert_parallelism", Use::DEFAULT, "false", "expert parallelism"},
    {"data_types", Use::DEFAULT, "{\"grad_accum_dtype\":null}", "a separate gradient accumulation dtype"},
    {"amp", Use::FEATURE, "", "NVIDIA Apex AMP"},
    {"torch_autocast", Use::FEATURE, "", "torch_autocast (use fp16 or bf16)"},
    {"activation_checkpointing", Use::FEATURE, "", "DeepSpeed's activation checkpointing"},
    {"flops_profiler", Use::FEATURE, "", "the flops profiler"},
    {"tensorboard", Use::FEATURE, "", "DeepSpeed's TensorBoard monitor (use Accelerator trackers)"},
    {"wandb", Use::FEATURE, "", "DeepSpeed's W&B monitor"},
    {"csv_monitor", Use::FEATURE, "", "DeepSpeed's CSV monitor (use Accelerator trackers)"},
    {"comet", Use::FEATURE, "", "DeepSpeed's Comet monitor"},
    {"comms_logger", Use::FEATURE, "", "the communication logger"},
    {"autotuning", Use::FEATURE, "", "the autotuner"},
    {"nebula", Use::FEATURE, "", "Nebula checkpointing"},
    {"elasticity", Use::READ},
    {"curriculum_learning", Use::FEATURE, "", "curriculum learning"},
    {"data_efficiency", Use::FEATURE, "", "data efficiency"},
    {"progressive_layer_drop", Use::FEATURE, "", "progressive layer drop"},
    {"eigenvalue", Use::FEATURE, "", "eigenvalue computation"},
    {"quantize_training", Use::FEATURE, "", "quantized training"},
    {"compression_training", Use::FEATURE, "", "compression training"},
    {"weight_quantization", Use::FEATURE, "", "weight quantization"},
    {"hybrid_engine", Use::FEATURE, "", "the hybrid engine"},
    {"compile", Use::FEATURE, "", "DeepCompile"},
};

const std::vector<Key> kFp16 = {
    {"enabled", Use::READ},
    {"auto_cast", Use::READ},
    {"loss_scale", Use::READ},
    {"initial_scale_power", Use::READ},
    {"loss_scale_window", Use::READ},
    {"hysteresis", Use::READ},
    {"consecutive_hysteresis", Use::READ},
    {"min_loss_scale", Use::READ},
    {"fp16_master_weights_and_grads", Use::DEFAULT, "false", "fp16 master weights"},
};

const std::vector<Key> kBf16 = {
    {"enabled", Use::READ},
    {"immediate_grad_update", Use::HINT},
    {"check_grad_overflow", Use::HINT},
    {"bf16_master_weights_and_grads", Use::DEFAULT, "false", "bf16 master weights"},
    {"bf16_optimizer_states", Use::DEFAULT, "false", "bf16 optimizer states"},
};

const std::vector<Key> kZero = {
    {"stage", Use::READ},
    {"overlap_comm", Use::READ},
    {"reduce_bucket_size", Use::READ},
    {"allgather_bucket_size", Use::READ},
    {"stage3_prefetch_bucket_size", Use::READ},
    {"prefetch_bucket_size", Use::READ},
    {"stage3_param_persistence_threshold", Use::READ},
    {"param_persistence_threshold", Use::READ},
    {"stage3_max_live_parameters", Use::READ},
    {"max_live_parameters", Use::READ},
    {"stage3_max_reuse_distance", Use::READ},
    {"max_reuse_distance", Use::READ},
    {"stage3_gather_16bit_weights_on_model_save", Use::READ},
    {"gather_16bit_weights_on_model_save", Use::READ},
    {"stage3_gather_fp16_weights_on_model_save", Use::READ},
    {"ignore_unused_parameters", Use::READ},
    {"offload_optimizer", Use::READ},
    {"offload_param", Use::READ},
    {"cpu_offload", Use::READ},
    {"cpu_offload_param", Use::READ},
    {"cpu_offload_use_pin_memory", Use::HINT},
    {"leaf_module", Use::READ},
    {"contiguous_gradients", Use::HINT},
    {"reduce_scatter", Use::HINT},
    {"allgather_partitions", Use::HINT},
    {"use_multi_rank_bucket_allreduce", Use::HINT},
    {"load_from_fp32_weights", Use::HINT},
    {"elastic_checkpoint", Use::HINT},
    {"sub_group_size", Use::HINT},
    {"round_robin_gradients", Use::HINT},
    {"memory_efficient_linear", Use::HINT},
    {"pipeline_loading_checkpoint", Use::HINT},
    {"override_module_apply", Use::HINT},
    {"log_trace_cache_warnings", Use::HINT},
    {"enable_sanity_checks", Use::HINT},
    {"save_muon_momentum_buffer_in_memory", Use::HINT},
    {"stage3_model_persistence_threshold", Use::HINT},
    {"model_persistence_threshold", Use::HINT},
    {"stage3_module_granularity_threshold", Use::HINT},
    {"module_granularity_threshold", Use::HINT},
    {"stage3_use_all_reduce_for_fetch_params", Use::HINT},
    {"use_all_reduce_for_fetch_params", Use::HINT},
    {"stage3_allgather_sequential", Use::HINT},
    {"allgather_sequential", Use::HINT},
    {"stage3_partition_stream_chunk_size", Use::HINT},
    {"partition_stream_chunk_size", Use::HINT},
    {"legacy_stage1", Use::DEFAULT, "false", "the legacy stage 1"},
    {"zero_hpz_partition_size", Use::DEFAULT, "1", "ZeRO++ hierarchical partitioning"},
    {"zero_quantized_weights", Use::DEFAULT, "false", "ZeRO++ quantized weights"},
    {"zero_quantized_nontrainable_weights", Use::DEFAULT, "false", "ZeRO++ quantized frozen weights"},
    {"zero_quantized_gradients", Use::DEFAULT, "false", "ZeRO++ quantized gradients"},
    {"zeropp_loco_param", Use::DEFAULT, "null", "LoCo-ZeRO++"},
    {"mics_shard_size", Use::DEFAULT, "-1", "MiCS sharding"},
    {"mics_hierarchical_params_gather", Use::DEFAULT, "false", "MiCS hierarchical gathers"},
    {"zenflow", Use::DEFAULT, "null", "ZenFlow"},
};

const std::vector<Key> kOffloadOptimizer = {
    {"device", Use::READ},         {"nvme_path", Use::READ},      {"pin_memory", Use::READ},
    {"ratio", Use::READ},          {"buffer_count", Use::READ},   {"pipeline_read", Use::READ},
    {"pipeline_write", Use::READ}, {"fast_init", Use::HINT},      {"cpuadam_cores_perc", Use::HINT},
    {"super_offload", Use::DEFAULT, "false", "SuperOffload"},
};

const std::vector<Key> kOffloadParam = {
    {"device", Use::READ},       {"nvme_path", Use::READ},   {"pin_memory", Use::READ},
    // buffer_size and max_in_cpu: xlr8's buffers are the largest shard's size, and it caches no shard in host
    // memory between uses.
    {"buffer_count", Use::READ}, {"buffer_size", Use::HINT}, {"max_in_cpu", Use::HINT},
};

// The transfers of offload's disk tier (DeepSpeed's runtime/swap_tensor/aio_config.py); thread_count is
// intra_op_parallelism's old name.
const std::vector<Key> kAio = {
    // queue_depth, single_submit, overlap_events tune libaio's submissions; xlr8's threads issue one blocking call
    // each (their count is the queue's depth).
    {"block_size", Use::READ},     {"queue_depth", Use::HINT},    {"intra_op_parallelism", Use::READ},
    {"thread_count", Use::READ},   {"single_submit", Use::HINT},  {"overlap_events", Use::HINT},
    {"use_gds", Use::READ},
};

const std::vector<Key> kLeafModule = {{"classes", Use::READ}, {"names", Use::READ}, {"name_suffixes", Use::READ}};

const std::vector<Key> kCheckpoint = {
    {"tag_validation", Use::READ},
    {"use_node_local_storage", Use::HINT},
    {"parallel_write", Use::HINT},
    {"load_universal", Use::DEFAULT, "false", "universal checkpoints (xlr8's own checkpoints reshard: load them directly)"},
};

const std::vector<Key> kTensorParallel = {
    {"autotp_size", Use::READ},       // the engine splits the model over the launch's tp dimension
    {"partition_config", Use::READ},  // tp::plan_from_deepspeed
    {"preset_model", Use::READ},      // tp::plan_from_deepspeed: DeepSpeed's presets
    {"tp_overlap_comm", Use::HINT},
    {"tp_grain_size", Use::HINT},
    {"keep_module_on_host", Use::HINT},
    {"injection_policy_tuple", Use::HINT},
    {"dtype", Use::HINT},
};

const std::vector<Key> kPipeline = {
    {"stages", Use::READ},                          // the launch's pp size ("auto": the PipelineModule's)
    {"partition", Use::READ},                       // must agree with the PipelineModule's partition_method
    {"activation_checkpoint_interval", Use::READ},  // the PipelineModule's when it sets none
    {"seed_layers", Use::HINT},                     // xlr8 always seeds each layer (the values of every layout agree)
    {"pipe_partitioned", Use::HINT},
    {"grad_partitioned", Use::HINT},
    {"use_reentrant", Use::HINT},
};

}  // namespace xlr8::deepspeed::keys
