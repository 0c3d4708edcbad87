#pragma once
// Offload's disk tier: a checkpoint reads or writes what strategies keep on disk one group at a time
// (ParallelStrategy::hold_in_memory; the tensors of one group share its handle), so the state on disk never needs to
// fit in memory.
#include <memory>

#include "xlr8/parallel_strategy.hpp"

namespace xlr8 {

class GroupInMemory {
 public:
  // The group holding `leaf` in memory (`optimizer`: its state of it; none: its values). A group's tensors share its
  // storage; another group's: the one held goes first, so that two groups never hold the swap's buffers together
  // (writing one back takes a buffer more).
  void hold(ParallelStrategy& model, const at::Tensor& leaf, torch::optim::Optimizer* optimizer, HoldFor purpose) {
    const auto* storage = leaf.has_storage() ? leaf.storage().unsafeGetStorageImpl() : nullptr;
    if (storage != storage_ || &model != model_ || optimizer != optimizer_) release();
    auto next = model.hold_in_memory(leaf, optimizer, purpose);
    if (current_ && current_ != next) current_->release();
    current_ = std::move(next);
    storage_ = storage;
    model_ = &model;
    optimizer_ = optimizer;
  }
  // Throws when what was written cannot go back to disk.
  void release() {
    if (current_) current_->release();
    current_.reset();
    storage_ = nullptr;
  }

 private:
  std::shared_ptr<HeldInMemory> current_;
  const c10::StorageImpl* storage_ = nullptr;  // of the tensor current_ was held for
  const ParallelStrategy* model_ = nullptr;
  const torch::optim::Optimizer* optimizer_ = nullptr;
};

}  // namespace xlr8
