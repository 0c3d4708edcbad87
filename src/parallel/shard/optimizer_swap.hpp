#pragma once
// Offload's disk tier for the optimizer (ZeroOptions::optimizer_on_disk, DeepSpeed's offload_optimizer.device
// "nvme"; issue 47). The state a LibTorch optimizer keeps per parameter (Adam's moments, SGD's momentum...) lives
// in a swap file between steps, and a step runs one flat group at a time: the group's state is read into the
// swapper's buffers (the next group's read ahead with pipeline_read), the optimizer steps over that group's
// leaves alone, and the state is written back (waited for unless pipeline_write) and its memory given up. Between
// steps every state tensor the optimizer holds for these leaves is empty; their step counters stay in memory.
// Host memory for the state is the swapper's pool, whatever the model's size.
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "parallel/shard/gradients_on_disk.hpp"
#include "parallel/shard/tensor_swapper.hpp"
#include "xlr8/zero.hpp"

namespace xlr8::shard {

struct FlatGroup;

class OptimizerSwap {
 public:
  // `groups`: the trainable groups whose leaves `optimizer` updates. Lays out and reserves the swap file now, so
  // that a full or unwritable nvme_path fails before training (the stale files of runs that died there are
  // removed first). ConfigError for an optimizer whose state the disk tier cannot name.
  OptimizerSwap(const ZeroOptions::Disk& disk, const torch::optim::Optimizer& optimizer,
                const std::vector<FlatGroup*>& groups);
  ~OptimizerSwap();
  OptimizerSwap(const OptimizerSwap&) = delete;
  OptimizerSwap& operator=(const OptimizerSwap&) = delete;

  // optimizer.step(), group by group, with each group's state (and, parameters on disk, its shard) in memory only
  // while it steps. Parameters of the optimizer outside these groups step last, as usual.
  void step(torch::optim::Optimizer& optimizer);
  // Every group's state in memory of its own (a checkpoint reads or replaces it), or written out again.
  void bring_in(torch::optim::Optimizer& optimizer);
  void put_away(torch::optim::Optimizer& optimizer);
  // One group's state in memory for a checkpoint (the group `flat`; nullopt when none of its leaves has state here):
  // hold_group reads it from disk, its tensors viewing the returned buffers; release_group writes it out and empties
  // it (`write`: a load replaced it), or, read only, empties it again unwritten.
  std::optional<size_t> group_of(const FlatGroup* flat) const;
  std::map<std::string, at::Tensor> hold_group(size_t group, torch::optim::Optimizer& optimizer);
  void release_group(size_t group, torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> lent,
                     bool write);
  // Whether this swap is `optimizer`'s: it keeps the state names this swap lays out, and holds the state tensors whose
  // values are on disk (none yet: any optimizer of that kind). Another optimizer may be bound at a freed one's address.
  bool serves(const torch::optim::Optimizer& optimizer) const;
  // Whether the optimizer it served is gone: the state tensors whose values are on disk are held by this swap alone
  // (false before any went to disk: nothing tells then).
  bool orphaned() const;
  // Gradients on disk (ZeroOptions::Disk::gradients): `flat`'s reduced chunk written out, its leaves' .grad left
  // undefined until the step reads it; false when this swap does not hold that group's gradients.
  bool write_gradient(const FlatGroup* flat, const at::Tensor& chunk);
  GradientsOnDisk* gradients() { return gradients_.get(); }
  // Where the state lives and what moved: the swap file, bytes read and written, seconds the steps took.
  nlohmann::json stats() const;
  // The stats of the swaps of one model's live optimizers as one: bytes, seconds and counts summed, the most held at
  // once the largest, "swap_files" each swap's file ("swap_file" the first's), "optimizers" how many.
  static nlohmann::json combined(const std::vector<nlohmann::json>& each);

 private:
  struct Member {
    at::Tensor leaf;
    int64_t offset = 0;  // in the group's chunk
    size_t index = 0;    // in the group's shard_params
  };
  struct Group {
    FlatGroup* flat = nullptr;
    std::vector<Member> members;  // leaves with elements
    int64_t numel = 0;            // the chunk's
    at::ScalarType dtype;
    bool on_disk = false;  // its state was written out and is not in memory
  };
  std::string slot(size_t group, const std::string& name) const;
  // The group's state read back: each state tensor the optimizer holds for its leaves views the returned buffers.
  std::map<std::string, at::Tensor> swap_in(size_t group, torch::optim::Optimizer& optimizer);
  // The group's state, wherever it is (`lent`'s buffers, or tensors of the optimizer's own), written out and its
  // tensors emptied.
  void swap_out(size_t group, torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> lent);
  // Gradients on disk: the group's read back, its leaves' .grad viewing it (undefined when none is there); and let go
  // after the step.
  at::Tensor lend_gradient(size_t group);
  void return_gradient(size_t group);
  // Steps the optimizer over `leaves` alone (`all`: every group's own parameter list, restored after).
  void step_only(torch::optim::Optimizer& optimizer, const std::vector<std::vector<at::Tensor>>& all,
                 const std::vector<const c10::TensorImpl*>& leaves);

  ZeroOptions::Disk disk_;
  std::vector<std::string> names_;  // the state tensors kept per parameter
  std::vector<Group> groups_;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> emptied_;  // state tensors whose values are on disk
  std::unique_ptr<TensorSwapper> swapper_;  // none when the optimizer keeps no state (and gradients stay in memory)
  std::unique_ptr<GradientsOnDisk> gradients_;  // with Disk::gradients; in swapper_'s file
  bool shards_on_disk_ = false;             // the groups' parameters are on disk too
  size_t stale_removed_ = 0;  // swap files of dead runs removed when this one's was claimed
  int64_t groups_held_ = 0, groups_held_most_ = 0;  // outside steps, by checkpoints (bring_in: every group)
  int64_t groups_read_for_checkpoints_ = 0;
  int64_t steps_ = 0;
  double step_seconds_ = 0;
};

}  // namespace xlr8::shard
