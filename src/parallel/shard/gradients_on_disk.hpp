#pragma once
// Offload's disk tier, the gradients too (ZeroOptions::Disk::gradients; XLR8_GRADIENTS_ON_DISK): at stage 2-3 each
// trainable group's reduced gradient chunk would stay in memory from its reduction to the step, and all of them
// together are as large as the model's fp32 parameters (the 2 B-parameter GPT's 8 GB, most of its peak). Here a
// chunk goes to the optimizer's swap file as soon as it is reduced, and the step reads it back with the group's
// state. Between the two, the leaves' .grad is undefined: elementwise work on the gradients (fp16's unscaling,
// clip_grad_norm's coefficient, clip_grad_value, zero_grad) is queued per leaf and applied in order as the chunk is
// read, which is the arithmetic it would have done in memory. The norms clipping needs are taken as the chunk is
// written (the same kernel over the same views), so clipping reads nothing back unless work was queued before it.
#include <ATen/core/Tensor.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace xlr8::shard {

class TensorSwapper;

class GradientsOnDisk {
 public:
  // One leaf's elements in its group's chunk: the optimizer's leaf shard_params[index], at `offset`, `count` long.
  struct Part {
    size_t index = 0;
    int64_t offset = 0, count = 0;
  };
  // Elementwise work on one leaf's gradient (a 1-dimensional view of the chunk); an empty one sets it to none.
  using Op = std::function<void(at::Tensor&)>;

  // `parts`: per group (the swap's order), its leaves with elements. The swapper holds a slot(group) per group.
  GradientsOnDisk(TensorSwapper& swapper, std::vector<std::vector<Part>> parts);
  static std::string slot(size_t group);

  // The group's reduced chunk (its master's dtype, on the CPU) written out; what was queued for the last one is dropped.
  void write(size_t group, const at::Tensor& chunk);
  bool on_disk(size_t group) const { return groups_[group].on_disk; }
  void prefetch(size_t group);
  // The chunk with the queued work applied (in the swapper's pool until freed), and which leaves have a gradient;
  // the chunk on disk is unchanged.
  at::Tensor read(size_t group, std::vector<bool>& has_gradient);
  void consumed(size_t group);  // the step used it: no gradient on disk until the next write
  // Per part of the group, the norm of order `p` of its gradient now (undefined for a dropped one).
  std::vector<at::Tensor> norms(size_t group, double p);
  // Queues `op` for the gradient of shard_params[index] (no-op when that leaf has none on disk).
  void queue(size_t group, size_t index, Op op);
  const std::vector<Part>& parts(size_t group) const { return groups_[group].parts; }
  // Which part of the group is shard_params[index] (none: that leaf has no elements here).
  std::optional<size_t> part_of(size_t group, size_t index) const;
  nlohmann::json stats() const;

 private:
  struct Group {
    std::vector<Part> parts;
    bool on_disk = false;
    std::vector<std::pair<size_t, Op>> queued;  // (part, op), in the order given
    std::vector<bool> dropped;                  // per part: set to none since it was written
    std::vector<at::Tensor> norm2, norm_inf;    // per part, as written; stale once work is queued
  };
  at::Tensor read_with_work(size_t group, std::vector<bool>& has_gradient);  // read(), uncounted
  static std::vector<at::Tensor> views(const at::Tensor& chunk, const std::vector<Part>& parts);
  TensorSwapper& swapper_;
  std::vector<Group> groups_;
  int64_t writes_ = 0, reads_ = 0, reads_for_norms_ = 0, queued_ = 0;  // reads_: the steps'; the norms' apart
};

}  // namespace xlr8::shard
