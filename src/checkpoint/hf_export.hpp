#pragma once
// Hugging Face's model layout: model.safetensors, or model-0000i-of-0000n.safetensors shards plus
// model.safetensors.index.json when the tensors exceed max_shard_size. What transformers' and Python
// safetensors' loaders read.
#include <functional>
#include <string>
#include <vector>

#include "xlr8/safetensors.hpp"

namespace xlr8::checkpoint {

// Writes `tensors` (in their order) into `dir`, shards of at most `max_shard_bytes` (a single tensor may
// exceed it), replacing an earlier export there. No communication: the caller picks the process that writes.
void export_hf_model(const NamedTensors& tensors, const std::string& dir, int64_t max_shard_bytes);
// The same for tensors produced one at a time: `fetch(i)` returns the i-th announced tensor when its turn
// comes, so only one need be in memory (merge-weights, save_model of a sharded model).
void export_hf_model(const std::vector<SafetensorsSpec>& specs, const std::function<at::Tensor(size_t)>& fetch,
                     const std::string& dir, int64_t max_shard_bytes);
// "10GB", "500MB", "2GiB", "1000": bytes. ConfigError for anything else.
int64_t parse_size(const std::string& text);

}  // namespace xlr8::checkpoint
