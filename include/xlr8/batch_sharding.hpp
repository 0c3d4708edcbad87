#pragma once
// Accelerate's BatchSamplerShard, exactly (accelerate/data_loader.py): how one epoch's sample order is
// cut into global batches and dealt to ranks. Pure arithmetic, no communication.
#include <cstdint>
#include <vector>

namespace xlr8 {

struct ShardingOptions {
  int64_t batch_size = 1;      // per process; with split_batches, the global batch
  int num_processes = 1;
  int process_index = 0;
  bool split_batches = false;  // each global batch is split between processes
  bool even_batches = true;    // pad the last round from the start of the epoch so all ranks get the same count
  bool drop_last = false;      // the underlying batch sampler drops its short last batch
  // `xlr8 verify`'s third run: this process stands for this many ranks (num_processes x micro_batches in all)
  // and yields their shares of each global batch one after another, in rank order.
  int micro_batches = 1;
};

// This rank's batches (lists of sample indices) for an epoch whose sample order is `order`.
std::vector<std::vector<int64_t>> shard_batches(const std::vector<int64_t>& order, const ShardingOptions& options);

// Samples in the last global round that are real rather than padding (Accelerate's `remainder`):
// dataset size % total batch size, or 0 when it divides or drop_last is set.
int64_t padding_remainder(int64_t dataset_size, const ShardingOptions& options);

// Accelerate's split_between_processes: [begin, end) of this rank's share of n items.
std::pair<int64_t, int64_t> split_range(int64_t n, int num_processes, int process_index);

}  // namespace xlr8
