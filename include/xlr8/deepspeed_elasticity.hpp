#pragma once
// DeepSpeed's `elasticity` section: for whatever data-parallel world size a (re)start has, the global batch,
// micro-batch and gradient accumulation DeepSpeed's compute_elastic_config chooses (deepspeed/elasticity, as
// in DeepSpeed 0.19.7, the last release that has it), so a job that loses or gains machines keeps its global
// batch and its trajectory without split_batches. Versions 0.1 and 0.2 (the default) and their quirks are
// DeepSpeed's: tests/unit/test_deepspeed_elasticity.cpp checks them against the real program's answers.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace xlr8::deepspeed {

struct ElasticityConfig {
  bool enabled = false;
  int64_t max_train_batch_size = 0;  // required when enabled
  std::vector<int64_t> micro_batch_sizes;  // required when enabled
  int64_t min_gpus = 1, max_gpus = 10000;
  int64_t model_parallel_size = 1, num_gpus_per_node = 1;  // version 0.2
  double min_time = 0;  // minutes a scheduler waits before rescaling: checked (>= 0), unused, as in DeepSpeed
  double version = 0.2;
  bool prefer_larger_batch = true;
  bool ignore_non_elastic_batch_info = false;  // the JSON's batch keys are then ignored instead of refused
};

// Reads the section (DeepSpeed's keys and checks); `origin` names the config in errors. Throws ConfigError.
ElasticityConfig read_elasticity(const nlohmann::json& section, const std::string& origin);

struct ElasticBatch {
  int64_t train_batch_size = 0, micro_batch_size = 0, gradient_accumulation_steps = 0;
  std::vector<int64_t> valid_world_sizes;  // the data-parallel sizes that keep train_batch_size
};

// DeepSpeed's choice for `world_size` data-parallel ranks. A world size the section does not allow is a
// ConfigError naming the valid ones (DeepSpeed's ElasticityIncompatibleWorldSize).
ElasticBatch compute_elastic_batch(const ElasticityConfig& config, int64_t world_size);

}  // namespace xlr8::deepspeed
