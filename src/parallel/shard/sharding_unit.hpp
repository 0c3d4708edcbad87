#pragma once
// One sharding unit: what FSDP2 calls an FSDPParamGroup and ZeRO-3 a submodule. Under stage 3 it is a
// module whose forward opens a guard (xlr8::unshard / xlr8::sharded), or the root; under stages 1-2 a
// gradient bucket that is never freed. Under GUARDED_MODULES a unit whose module never opened its guard
// rides with its nearest ancestor unit that did (its host): gathered and freed with it, as DeepSpeed
// gathers a submodule inside its parent's forward. It owns its flat groups, its state and its prefetch; the
// ShardedModel owns the order of reductions and the optimizer side. Every method is called under the
// sharded model's lock.
//
// [Note: a unit's tensors]
// A unit holds one FlatGroup for its trainable parameters and one for its frozen ones (either may be
// missing). For each group, over N ranks, with Ψ its elements padded to N·shard_numel:
//   params        the user's parameters: views of `full` (the same objects, so autograd, hooks and the
//                 module see them).
//   full          the whole group, end to end, in the compute dtype. Stages 1-2 keep it. Stage 3 frees
//                 its memory whenever the unit is sharded (same storage object, 0 bytes: the views keep
//                 their shapes) and all-gathers into new memory to unshard.
//   shard         rank r's chunk [r·shard_numel, (r+1)·shard_numel) of `full`: a view of it for stages
//                 1-2, a tensor of its own for stage 3 (in memory the group's peers can read).
//   master        the chunk the optimizer updates: `shard` itself, or an fp32 copy of it when the
//                 parameters compute in a lower precision (mixed precision), or a copy in host memory
//                 (offload: FlatGroup::host; stage 3 may keep `shard` there too, copied to the device to gather).
//   shard_params  per parameter, a leaf over the part of it inside `master` (possibly empty): what the
//                 optimizer, sharded checkpoints and clip_grad_norm see. Frozen groups' leaves require
//                 no gradient, so optimizers skip them.
//   grad_full     gradients laid out like `full`, in the reduce dtype, while backward fills them; stages
//                 2-3 free it once reduce-scattered, stage 1 keeps it (its chunk is what the leaves read).
// The reduce-scattered gradient chunk is the sharded model's until the end of backward, then the leaves' .grad.
// Padding holds zeros and never reaches the optimizer, a checkpoint or a result.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/shard/flat_group.hpp"
#include "xlr8/communicator.hpp"

namespace xlr8::shard {

// Counts every unit of a sharded model adds to (for stats()), and the switch summon_full_params sets.
struct UnitContext {
  Communicator* comm = nullptr;
  int summoned = 0;  // gather_full_parameters depth: nothing is freed while above 0
  int64_t gathers = 0, releases = 0, forward_prefetches = 0, backward_prefetches = 0, frozen_released_in_backward = 0;
  int64_t gathered_bytes = 0, peak_gathered_bytes = 0, step_peak_gathered_bytes = 0;
  void gathered(int64_t bytes);
};

class ShardingUnit {
 public:
  // FSDP2's TrainingState. The sharded state is each group's memory (FlatGroup::gathered()): a unit's
  // frozen group may be freed before its trainable one, whose gradients are still being reduced.
  enum class State { IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD };
  enum class Which { ALL, TRAINABLE, FROZEN };

  // `reshards`: its groups own their shards and are freed between uses (stage 3). `starts_sharded`:
  // freed from the start (rank-0 loading), so its guard must gather it.
  ShardingUnit(std::string label, const torch::nn::Module* module, bool is_root, bool named_by_user,
               std::vector<FlatGroup> groups, UnitContext& context, bool reshards, bool starts_sharded);

  const std::string& label() const { return label_; }
  const torch::nn::Module* module() const { return module_; }
  bool is_root() const { return is_root_; }
  bool named_by_user() const { return named_by_user_; }
  std::vector<FlatGroup>& groups() { return groups_; }
  const std::vector<FlatGroup>& groups() const { return groups_; }
  State state() const { return state_; }
  bool guard_opened() const { return guard_opened_; }
  // Freed between uses: stage 3, once its guard opened (or from the start under rank-0 loading).
  bool managed() const { return managed_; }
  bool has_frozen() const;
  bool carries_frozen() const;  // its own groups or a rider's
  bool any_gathered() const;
  int64_t full_bytes() const;
  int64_t full_numel() const;  // its parameters' elements and its riders', as gathered together

  // From now on `rider` is gathered and freed with this unit (its own guard never opened); freed now.
  void carry(ShardingUnit& rider);
  bool rides() const { return host_ != nullptr; }

  // Transitions, each asserting the state it leaves (an internal error names the unit otherwise). A
  // host's riders are gathered and freed with it.
  void forward_begins();                      // -> FORWARD, gathered
  // -> IDLE; freed, except the root when backward follows, and a recomputed unit (activation
  // checkpointing) whose backward comes next
  void forward_ends(bool backward_follows, bool keep_gathered = false);
  void forward_abandoned();                   // -> IDLE, freed (the forward threw)
  bool backward_begins();                     // -> PRE_BACKWARD, gathered; false when already there
  void gradients_reduced();                   // -> POST_BACKWARD; the trainable group freed
  void backward_ends();                       // -> IDLE, freed

  // Gathers and releases, by group (the sharded model's checkpoint side works group by group) or all at once.
  void gather(size_t group);
  bool release(size_t group);  // whether it freed the gathered parameters
  void gather_all();
  bool release(Which which);
  // Issues the all-gathers without waiting (nothing when every group is gathered already); `wait_prefetch`
  // waits and forgets them. Returns whether anything was issued / pending.
  bool prefetch(bool in_backward);
  bool wait_prefetch();
  bool prefetching() const { return !prefetch_.empty(); }
  // Parameters on disk: its groups' and riders' shards start coming back from disk (no collective, no wait).
  void read_ahead() const;

  // Frozen parameters have no gradient to say when backward is done with them: the unit's own autograd
  // nodes do. `forward_start` is where the unit's last forward began in the graph; each forward whose
  // nodes backward must still run counts once in `awaiting`, for one backward (`generation`).
  uint64_t forward_start = 0;
  int awaiting = 0;
  // One forward fewer awaits backward; at none (and outside the unit's own forward) the frozen groups
  // are freed. Returns whether they were.
  bool forward_no_longer_awaited();

 private:
  void expect(std::initializer_list<State> allowed, const char* transition) const;
  bool issue_prefetch();
  void gather_riders();
  void release_riders(Which which);

  std::string label_;
  const torch::nn::Module* module_;
  bool is_root_, named_by_user_;
  std::vector<FlatGroup> groups_;
  UnitContext& context_;
  bool reshards_;
  bool managed_;
  bool guard_opened_ = false;
  State state_ = State::IDLE;
  std::vector<Work> prefetch_;
  ShardingUnit* host_ = nullptr;
  std::vector<ShardingUnit*> riders_;
};

const char* to_string(ShardingUnit::State state);

}  // namespace xlr8::shard
