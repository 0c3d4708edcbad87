#pragma once
// Data-parallel gradient synchronisation for any torch::nn::Module, from AccumulateGrad post-hooks.
// Gradients are packed into flat buckets in reverse parameter order (first bucket ~1 MB, then
// bucket_cap_mb); each bucket's async all-reduce starts from the AccumulateGrad post-hook as soon as
// its last gradient is ready, so communication overlaps the rest of backward; the end-of-backward
// callback waits and writes the averaged gradients back. Nothing is communicated while sync is off.
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8 {

struct DDPOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool find_unused_parameters = false;  // unused parameters then count as zero gradients instead of an error
  bool broadcast_buffers = true;        // sync_buffers() broadcasts buffers from rank 0
  // Send fp32 gradients as bf16 (PyTorch's bf16_compress_hook): half the bytes on the wire, gradients
  // rounded to bf16 before averaging. Off by default: it changes the numbers.
  bool compress_bf16 = false;
};

class DistributedDataParallel {
 public:
  // Collective: verifies that every rank has the same parameter names, dtypes and shapes (an error names
  // the first difference and the ranks), then broadcasts parameters and buffers from rank 0.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, Communicator comm, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // false: backward accumulates locally (no_sync); the next backward with true averages the sum.
  void set_sync(bool enabled);
  bool sync_enabled() const;
  // Outside a backward: averages now the gradients accumulated under set_sync(false), every parameter's (a
  // parameter no backward reached counts as a zero gradient).
  void reduce_accumulated_now();
  // Broadcasts buffers (e.g. batch-norm statistics) from rank 0, when broadcast_buffers is set.
  void sync_buffers();

  const std::shared_ptr<torch::nn::Module>& module() const;
  // Parameter indices (in module->parameters() order) of each bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_layout() const;
  // All-reduces started in total, and how many of them while other gradients were still being computed
  // (communication overlapping backward). For tests and benchmarks.
  size_t launches() const;
  size_t overlapped_launches() const;
  // Seconds the ends of backward have spent waiting for all-reduces still running: the communication
  // that overlap did not hide, summed over synchronised backward passes.
  double exposed_comm_seconds() const;

  struct Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace xlr8
