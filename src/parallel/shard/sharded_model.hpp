#pragma once
// A model sharded as ZeRO stages 1-3 (and FSDP's strategies) shard it: its units (parallel/shard/sharding_unit.hpp:
// stage-3 modules, or stage-1/2 gradient buckets), the hooks that reduce gradients group by group as
// backward produces them, the order units run in (prefetching), the sharded optimizer step and the
// global gradient norm.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <vector>

#include "compat/torch_compat.hpp"
#include "xlr8/grad_norm.hpp"
#include "parallel/shard/sharding_unit.hpp"
#include "xlr8/communicator.hpp"
#include "xlr8/gradient_state.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/zero.hpp"

namespace xlr8::shard {

// What a ZeRO stage changes, as data rather than branches.
class GradientsOnDisk;
class OptimizerSwap;
class ShardStore;
struct UnitPlan;

struct StagePolicy {
  int stage = 1;
  bool shards_parameters = false;  // 3: units are modules whose groups own their shards and are freed between uses
  bool shards_gradients = false;   // 2-3: reduce-scatter; whole gradient buffers freed once reduced
  static StagePolicy of(int stage);  // Error for a stage that does not exist
};

class ShardedModel : public std::enable_shared_from_this<ShardedModel> {
 public:
  // Collective over `comm`, the group the parameters are sharded over. `replicate` (hybrid sharding):
  // the same shard's holders in the other groups, over which sharded gradients are averaged too.
  // Call attach() once the object is owned by a shared_ptr.
  ShardedModel(std::shared_ptr<torch::nn::Module> module, Communicator comm, Communicator replicate, int stage,
             ZeroOptions options, bool find_unused_parameters, std::shared_ptr<const GradientState> gradient_state);
  ~ShardedModel();
  void attach();  // installs the gradient hooks and registers the units

  int stage() const { return policy_.stage; }
  void begin_step(bool suspend_sync);
  void end_step();
  // Outside a backward: reduces (and hands to the shards) now the whole gradients backwards accumulated with sync
  // suspended, as a synchronising backward's end would.
  void reduce_accumulated_now();
  std::vector<at::Tensor> optimizer_parameters() const;
  bool owns(const at::Tensor& tensor) const;  // either identity of a sharded parameter, or a whole frozen one
  // Gives `optimizer` this rank's leaves for the parameters it was given (and, with the optimizer's state on disk,
  // reserves its swap file).
  void bind_optimizer(torch::optim::Optimizer& optimizer);
  void optimizer_step(torch::optim::Optimizer& optimizer);
  void optimizer_state_in_memory(torch::optim::Optimizer& optimizer, bool in_memory);
  // One group's shard (no optimizer) or its state of `optimizer`, in memory until released (held_in_memory.cpp).
  std::shared_ptr<HeldInMemory> hold_in_memory(const at::Tensor& leaf, torch::optim::Optimizer* optimizer,
                                               HoldFor purpose);
  GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type);
  StateDict state_dict(StateDictKind kind);
  void load_state_dict(const StateDict& state, StateDictKind kind);
  // Drops prefetches (loads write what they return); `bring_in`: shards on disk are read into memory, until
  // parameter_pieces_loaded; otherwise they stay there, for hold_in_memory.
  std::vector<ParameterPiece> parameter_pieces(bool bring_in);
  bool keeps_state_on_disk() const {
    return options_.optimizer_on_disk.enabled() || options_.params_on_disk.enabled();
  }
  std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& parameters) const;
  // Gradients on disk (ZeroOptions::Disk::gradients): ParallelStrategy's queue_on_disk_gradients and
  // non_finite_gradients_on_disk.
  bool queue_on_disk_gradients(const std::vector<at::Tensor>& parameters, const std::function<void(at::Tensor&)>& op);
  bool non_finite_gradients_on_disk(const std::vector<at::Tensor>& parameters);
  void visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn);
  StateDict full_state_layout(StateDictKind kind) const;
  void parameter_pieces_loaded(bool whole_parameters_written);
  void gather_full_parameters();
  void release_full_parameters(bool writeback);
  nlohmann::json stats() const;

  // From the unit guards and the backward pre-hook (stage 3); `unit` indexes units_.
  void unit_forward_begins(size_t unit);
  std::vector<at::Tensor> unit_forward_ends(size_t unit, const std::vector<at::Tensor>& outputs);
  void unit_forward_abandoned(size_t unit);
  void unit_backward_begins(size_t unit);
  // Every node one forward of the unit created has run in backward (`generation`: the backward it
  // was recorded for): its frozen groups are released once no other forward of it awaits backward.
  void unit_backward_done(size_t unit, uint64_t generation);
  // One forward's graph was freed before its backward finished with the unit: it awaits nothing more.
  // (Called from a destructor, perhaps while this thread holds the lock: it gives up rather than wait.)
  void unit_graph_dropped(size_t unit, uint64_t generation);
  // From the gradient accumulator hooks; `group` indexes groups_.
  void gradient_ready(size_t group, size_t index);

 private:
  // Where a parameter lives: groups_[group].params[index] (the module's view) and .shard_params[index]
  // (the optimizer's leaf over this rank's part); `is_leaf` says which of the two a tensor is.
  struct Slot {
    size_t group = 0, index = 0;
    bool is_leaf = false;
  };
  FlatGroup& group(size_t g) { return *groups_[g]; }
  const FlatGroup& group(size_t g) const { return *groups_[g]; }
  ShardingUnit& unit_of(size_t g) { return *units_[unit_of_group_[g]]; }
  void arm_end_of_backward();
  void backward_abandoned(uint64_t generation);  // its end-of-backward callback was discarded unrun
  void drop_backward_state();                    // a failed backward's buffers and counts, forgotten
  void finish_backward();
  // At the end of a synchronised backward: the gradients no hook saw, the reductions still to launch
  // and wait for, and each chunk handed to the optimizer's leaves.
  void reduce_and_hand_over();
  void hand_over_reduced();  // launches what is pending, awaits every reduction, gives the leaves their parts
  void stash_gradient(size_t group, size_t index);
  // Gradients on disk: group g's reduced chunk written to its optimizer's swap (true), or left in memory (no swap
  // holds g's gradients: the optimizer is not bound yet, or they stay in memory).
  bool gradient_to_disk(size_t g, const at::Tensor& reduced);
  struct OnDisk {
    GradientsOnDisk* gradients = nullptr;
    size_t group = 0;  // in the swap's order
  };
  std::optional<OnDisk> gradient_on_disk(size_t g);  // where group g's gradient waits for the step, if it does
  void group_complete(size_t group);
  void launch_ready();
  void launch(size_t group);
  void retire_oldest();
  void reset_backward_state();
  const Slot* slot_of(const at::Tensor& tensor) const;  // either identity; null for a tensor not sharded here
  // Every whole copy that is alive (stages 1-2; stage-3 groups held whole) catches up with its shards.
  // After an optimizer step frozen groups are skipped: their shards did not change.
  void refresh_whole_copies(bool frozen_too);

  // Stage 3: the order units run in, prefetching by it, and the checks made after the first step.
  struct UnitOrder {
    std::vector<size_t> last, current;  // the last complete pass; the one under way
    void record(size_t unit);           // a unit seen again in `current` starts a new pass
  };
  void prefetch(size_t unit, bool in_backward);  // within FSDP's limit of gathered units
  void prefetch_after(const UnitOrder& order, size_t unit, bool in_backward);
  // Parameters on disk: the first unit after `unit` in `order` (the last pass's) that is not gathered or being
  // prefetched starts reading its shards from disk, so that its gather finds them in memory, not on the disk.
  void read_ahead_after(const UnitOrder& order, size_t unit) const;
  // DeepSpeed's bounds (ZeroOptions::max_live_elements): the units after `next`'s place, within the bucket.
  void prefetch_within_bounds(const UnitOrder& order, std::vector<size_t>::const_iterator next, bool in_backward);
  void settle_prefetches();
  // Prefetched units nobody used (the order mispredicted): waited for and freed, before anything reads
  // `full` as current or changes the shards.
  void drop_prefetches();
  // Collective, once per pass kind: every rank ran the units in the same order (ConfigError naming the
  // first unit where two ranks differ otherwise). Prefetching waits for both checks.
  void check_order_across_ranks(const std::vector<size_t>& order, const char* pass);
  // After the first backward (GUARDED_MODULES): each unit whose guard never opened rides with its
  // nearest ancestor unit whose guard did.
  void assign_riders();
  // After the first backward: units whose forward never opened their guard (and ride with no unit)
  // stay whole on every rank.
  void report_unguarded_units();
  // At the end of every backward until both orders are checked (collective; ConfigError on failure).
  void check_first_backward();
  bool prefetch_allowed() const { return forward_order_checked_ && backward_order_checked_; }

  std::shared_ptr<torch::nn::Module> module_;
  Communicator comm_;
  Communicator replicate_;  // invalid unless hybrid
  StagePolicy policy_;
  ZeroOptions options_;
  bool find_unused_;
  std::shared_ptr<const GradientState> gradient_state_;
  std::vector<std::pair<std::string, at::Tensor>> frozen_at_prepare_;  // must stay frozen
  int64_t groups_made_from_recording_ = 0;  // of a deferred build (DeferredInitScope), as each group was made
  int64_t groups_received_from_rank0_ = 0;  // of those, the ones whose values rank 0 computed and sent
  UnitContext context_;
  std::vector<std::unique_ptr<ShardingUnit>> units_;
  std::vector<FlatGroup*> groups_;     // every unit's groups, in unit order
  std::vector<size_t> unit_of_group_;
  std::vector<size_t> launch_order_;   // groups with gradients, in the order they become ready
  // Both identities of every parameter: the module's view and the optimizer's leaf.
  std::unordered_map<const c10::TensorImpl*, Slot> slots_;
  std::vector<compat::GradAccumulatorPtr> accumulators_;
  std::vector<std::shared_ptr<void>> unit_handles_;

  mutable std::mutex mutex_;
  bool sync_ = true;
  bool detached_ = false;
  bool in_backward_ = false;
  bool warned_unguarded_ = false, unguarded_checked_ = false;
  bool forward_order_checked_ = false, backward_order_checked_ = false, riders_assigned_ = false;
  uint64_t backward_generation_ = 0;
  // One forward of `generation`'s fewer awaits backward: at none, the unit's frozen groups go.
  void no_longer_awaited(size_t unit, uint64_t generation);
  // Reduction state, per group.
  std::vector<std::vector<bool>> ready_;
  std::vector<bool> hooked_;  // a hook saw at least one of its gradients this backward
  std::vector<size_t> pending_;
  std::vector<at::Tensor> grad_shards_;
  std::vector<Work> works_;
  std::deque<size_t> in_flight_;
  size_t next_launch_ = 0;
  // Prefetching (stage 3): the units' order in forward and in backward as they last ran.
  UnitOrder forward_order_, backward_order_;

  int64_t launches_ = 0, overlapped_ = 0;
  double heap_trim_seconds_ = 0;  // the disk tier's, after each step (optimizer_step)
  // Offload's disk tier: per optimizer, its state's swap file (ZeroOptions::optimizer_on_disk); the parameter
  // shards' (ZeroOptions::params_on_disk), shared with every group.
  std::map<const torch::optim::Optimizer*, std::unique_ptr<OptimizerSwap>> swaps_;
  std::shared_ptr<ShardStore> shard_store_;
  // The groups held in memory now (hold_in_memory), by group and optimizer (none: the shard), shared by holders.
  std::map<std::pair<size_t, const torch::optim::Optimizer*>, std::weak_ptr<HeldInMemory>> held_;
  std::shared_ptr<ShardStore> make_shard_store(const std::vector<UnitPlan>& plans) const;
  // Parameters on disk: every group's shard read into memory (a checkpoint or a state dict reads or writes it), or
  // written back and let go.
  void all_shards_in_memory(bool in_memory);
};

}  // namespace xlr8::shard
