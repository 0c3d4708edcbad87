// Offload's disk tier, one group at a time (ParallelStrategy::hold_in_memory): a group's parameter shard, or its
// state of one optimizer, in memory while a checkpoint reads or writes it, so that neither needs the whole model's
// state in memory at once.
#include <fmt/format.h>

#include <optional>

#include "core/log.hpp"
#include "parallel/shard/flat_group.hpp"
#include "parallel/shard/optimizer_swap.hpp"
#include "parallel/shard/sharded_model.hpp"

namespace xlr8::shard {
namespace {

// Released once, by the holder (a failure throws) or by the destructor (a failure is logged: an exception is already
// on its way, or the holder let go without releasing).
class OnceReleased : public HeldInMemory {
 public:
  void release() final {
    if (released_) return;
    released_ = true;
    put_back();
  }
  bool released() const { return released_; }
  void also_for(HoldFor purpose) { writing_ = writing_ || purpose == HoldFor::writing; }

 protected:
  explicit OnceReleased(HoldFor purpose) : writing_(purpose == HoldFor::writing) {}
  void release_quietly() noexcept {
    try {
      release();
    } catch (const std::exception& e) {
      log::warning("xlr8: {} could not go back to disk: {}", what(), e.what());
    }
  }
  virtual void put_back() = 0;
  virtual std::string what() const = 0;
  bool writing_;

 private:
  bool released_ = false;
};

class ShardInMemory final : public OnceReleased {
 public:
  // Under the model's mutex. A mixed group's values are its fp32 master, always in memory: its shard follows the
  // master when written back, and is never read here.
  ShardInMemory(FlatGroup& flat, std::mutex& mutex, HoldFor purpose)
      : OnceReleased(purpose), flat_(flat), mutex_(mutex), was_on_disk_(flat.shard_on_disk) {
    if (!flat.mixed()) flat.load_shard();
  }
  ~ShardInMemory() override { release_quietly(); }

 private:
  void put_back() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (writing_) flat_.store_shard();
    else if (was_on_disk_) flat_.drop_shard();  // unchanged: its values are still on disk
  }
  std::string what() const override { return fmt::format("the parameter shard of {}", flat_.label); }
  FlatGroup& flat_;
  std::mutex& mutex_;
  bool was_on_disk_;
};

class StateInMemory final : public OnceReleased {
 public:
  StateInMemory(OptimizerSwap& swap, size_t group, torch::optim::Optimizer& optimizer, std::string label,
                HoldFor purpose)
      : OnceReleased(purpose),
        swap_(swap),
        group_(group),
        optimizer_(optimizer),
        label_(std::move(label)),
        lent_(swap.hold_group(group, optimizer)) {}
  ~StateInMemory() override { release_quietly(); }

 private:
  void put_back() override { swap_.release_group(group_, optimizer_, std::move(lent_), writing_); }
  std::string what() const override { return fmt::format("the optimizer state of {}", label_); }
  OptimizerSwap& swap_;
  size_t group_;
  torch::optim::Optimizer& optimizer_;
  std::string label_;
  std::map<std::string, at::Tensor> lent_;
};

}  // namespace

std::shared_ptr<HeldInMemory> ShardedModel::hold_in_memory(const at::Tensor& leaf, torch::optim::Optimizer* optimizer,
                                                           HoldFor purpose) {
  const auto* slot = slot_of(leaf);
  if (!slot) return nullptr;
  auto& flat = group(slot->group);
  OptimizerSwap* swap = nullptr;
  std::optional<size_t> in_swap;
  if (optimizer) {
    const auto it = swaps_.find(optimizer);
    if (it == swaps_.end()) return nullptr;
    swap = it->second.get();
    in_swap = swap->group_of(&flat);
    if (!in_swap) return nullptr;  // no leaf of this group has elements here
  } else if (!flat.disk) {
    return nullptr;
  }
  auto& held = held_[{slot->group, optimizer}];
  if (auto live = held.lock(); live && !static_cast<OnceReleased&>(*live).released()) {
    static_cast<OnceReleased&>(*live).also_for(purpose);
    return live;
  }
  std::shared_ptr<HeldInMemory> made;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_prefetches();  // one in flight would read the shard, or gather it, while it is held
    if (swap) made = std::make_shared<StateInMemory>(*swap, *in_swap, *optimizer, flat.label, purpose);
    else made = std::make_shared<ShardInMemory>(flat, mutex_, purpose);
  }
  held = made;
  return made;
}

}  // namespace xlr8::shard
