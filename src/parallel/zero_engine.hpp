#pragma once
// The sharding engine behind ZeRO stages 1-3 (and FSDP's strategies): flat parameter groups, the hooks
// that reduce gradients group by group as backward produces them, the gathers around stage-3 units,
// the sharded optimizer step and the global gradient norm.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "compat/torch_compat.hpp"
#include "parallel/flat_group.hpp"
#include "xlr8/communicator.hpp"
#include "xlr8/gradient_state.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/zero.hpp"

namespace xlr8::detail {

class ZeroEngine : public std::enable_shared_from_this<ZeroEngine> {
 public:
  // Collective over `comm`, the group the parameters are sharded over. `replicate` (hybrid sharding):
  // the same shard's holders in the other groups, over which sharded gradients are averaged too.
  // Call attach() once the object is owned by a shared_ptr.
  ZeroEngine(std::shared_ptr<torch::nn::Module> module, Communicator comm, Communicator replicate, int stage,
             ZeroOptions options, bool find_unused_parameters, std::shared_ptr<const GradientState> gradient_state);
  ~ZeroEngine();
  void attach();  // installs the gradient hooks and registers the units

  int stage() const { return stage_; }
  void begin_step(bool suspend_sync);
  void end_step();
  std::vector<at::Tensor> optimizer_parameters() const;
  void bind_optimizer(torch::optim::Optimizer& optimizer) const;
  void optimizer_step(torch::optim::Optimizer& optimizer);
  double clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type);
  StateDict state_dict(StateDictKind kind);
  void load_state_dict(const StateDict& state, StateDictKind kind);
  std::vector<ParameterPiece> parameter_pieces();  // drops prefetches: loads write what they return
  std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& parameters) const;
  void visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn);
  StateDict state_dict_shapes(StateDictKind kind) const;
  void pieces_loaded(bool whole_parameters_written);
  void gather_all();
  void release_all(bool writeback);
  nlohmann::json stats() const;

  // From the unit guards and the backward pre-hook (stage 3); `unit` indexes units_.
  void unit_forward_begins(size_t unit);
  at::Tensor unit_forward_ends(size_t unit, const at::Tensor& output);
  void unit_forward_abandoned(size_t unit);
  void unit_backward_begins(size_t unit);
  // Every node one forward of the unit created has run in backward (`generation`: the backward it
  // was recorded for): its frozen groups are released once no other forward of it awaits backward.
  void unit_backward_done(size_t unit, uint64_t generation);
  // One forward's graph was freed before its backward finished with the unit: it awaits nothing more.
  // (Called from a destructor, perhaps while this thread holds the lock: it gives up rather than wait.)
  void unit_graph_dropped(size_t unit, uint64_t generation);
  // From the gradient accumulator hooks.
  void gradient_ready(size_t group, size_t index);

 private:
  struct Slot {
    size_t group = 0, index = 0;
  };
  // Stage 3: a module whose guard gathers its groups (its trainable one, its frozen one, or both).
  struct Unit {
    const torch::nn::Module* module = nullptr;
    std::vector<size_t> groups;
  };
  bool is_root(size_t unit) const { return units_[unit].module == module_.get(); }
  bool has_frozen(size_t unit) const;
  size_t unit_of(size_t group) const { return unit_of_group_[group]; }
  void arm_end_of_backward();
  void backward_abandoned(uint64_t generation);  // its end-of-backward callback was discarded unrun
  void drop_backward_state();                    // a failed backward's buffers and counts, forgotten
  void finish_backward();
  // At the end of a synchronised backward: the gradients no hook saw, the reductions still to launch
  // and wait for, and each chunk handed to the optimizer's leaves.
  void reduce_and_hand_over();
  void stash_gradient(size_t group, size_t index);
  void group_complete(size_t group);
  void launch_ready();
  void launch(size_t group);
  void retire_oldest();
  void gather(size_t group);
  bool release(size_t group);  // whether it freed the gathered parameters
  // Stage 3 prefetching: issue a unit's all-gathers without waiting (a no-op unless a guard manages it
  // and it is not gathered); the next unit after `unit` in `order`; waiting for every prefetch.
  struct UnitOrder {
    std::vector<size_t> last, current;  // the last complete pass; the one under way
    void record(size_t unit);           // a unit seen again in `current` starts a new pass
  };
  void prefetch(size_t unit, bool in_backward);
  bool await_prefetch(size_t group);  // waits for and forgets `group`'s prefetch; false if none was issued
  void prefetch_after(const UnitOrder& order, size_t unit, bool in_backward);
  void settle_prefetches();
  // Prefetched units nobody used (the order mispredicted): waited for and freed, before anything reads
  // `full` as current or changes the shards.
  void drop_prefetches();
  void reset_backward_state();
  const Slot* slot_of(const at::Tensor& tensor) const;
  // Every whole copy that is alive (stages 1-2; stage-3 groups held whole) catches up with its shards.
  // After an optimizer step frozen groups are skipped: their shards did not change.
  void refresh_whole_copies(bool frozen_too);

  std::shared_ptr<torch::nn::Module> module_;
  Communicator comm_;
  Communicator replicate_;  // invalid unless hybrid
  int stage_;
  ZeroOptions options_;
  bool find_unused_;
  std::shared_ptr<const GradientState> gradient_state_;
  std::vector<std::pair<std::string, at::Tensor>> frozen_at_prepare_;  // must stay frozen
  std::vector<FlatGroup> groups_;
  std::vector<Unit> units_;            // stage 3
  std::vector<size_t> unit_of_group_;  // stage 3: the unit each group belongs to
  std::vector<size_t> launch_order_;   // groups with gradients, in the order they become ready
  std::vector<bool> managed_;  // stage 3: a guard gathers and frees it (seen in a forward)
  std::unordered_map<const c10::TensorImpl*, Slot> user_slots_, shard_slots_;
  std::vector<compat::GradAccumulatorPtr> accumulators_;
  std::vector<std::shared_ptr<void>> unit_handles_;

  mutable std::mutex mutex_;
  bool sync_ = true;
  bool detached_ = false;
  bool in_backward_ = false;
  int summoned_ = 0;
  // Stage 3, per unit: where its last forward began in the autograd graph, and how many of its forwards
  // with frozen groups still await their backward (counted for `backward_generation_`).
  std::vector<uint64_t> forward_start_;
  std::vector<bool> guarded_;  // its guard has opened at least once
  std::vector<bool> in_forward_;  // its guard is open now
  // One forward of `generation`'s fewer awaits backward: at none, the unit's frozen groups go.
  void no_longer_awaited(size_t unit, uint64_t generation);
  bool warned_unguarded_ = false;
  std::vector<int> awaiting_backward_;
  uint64_t backward_generation_ = 0;
  std::vector<std::vector<bool>> ready_;
  std::vector<size_t> pending_;
  std::vector<at::Tensor> grad_shards_;
  std::vector<Work> works_;
  std::deque<size_t> in_flight_;
  size_t next_launch_ = 0;
  // Prefetching (stage 3): the units' order in forward and in backward as they last ran, and the
  // all-gathers issued early that nobody waited for yet.
  UnitOrder forward_order_, backward_order_;
  std::unordered_map<size_t, Work> prefetching_;

  // Figures for stats().
  int64_t gathers_ = 0, releases_ = 0, launches_ = 0, overlapped_ = 0, forward_prefetches_ = 0,
          backward_prefetches_ = 0, frozen_released_in_backward_ = 0;
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0, step_peak_gathered_bytes_ = 0;
};

}  // namespace xlr8::detail
