// ShardedModel: the reduction of gradients as backward produces them (its making: sharded_model_make.cpp).
#include "parallel/shard/sharded_model.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "parallel/recompute/recompute.hpp"
#include "parallel/replicate/gradient_ready.hpp"
#include "parallel/replicate/replica_sync.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {

// ------------------------------------------------------------------------------------------ gradients

void ShardedModel::begin_step(bool suspend_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = !suspend_sync && (!gradient_state_ || gradient_state_->sync_gradients);
  context_.step_peak_gathered_bytes = context_.gathered_bytes;
}

void ShardedModel::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = true;
}

void ShardedModel::arm_end_of_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  std::weak_ptr<ShardedModel> weak = shared_from_this();
  const uint64_t generation = backward_generation_;
  // If a node throws, the pass ends without the callback: forget its state, so that the next backward
  // arms its own callback instead of finding this one armed (and never handing gradients over).
  recompute::at_end_of_backward(
      [weak] {
        if (auto self = weak.lock()) self->finish_backward();
      },
      [weak, generation] {
        if (auto self = weak.lock()) self->backward_abandoned(generation);
      });
}

void ShardedModel::backward_abandoned(uint64_t generation) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || detached_ || generation != backward_generation_ || !in_backward_) return;
  drop_backward_state();
}

void ShardedModel::drop_backward_state() {
  in_flight_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    works_[g] = Work();  // in-flight collectives hold their own references to these buffers
    grad_shards_[g] = at::Tensor();
    if (policy_.shards_gradients) group(g).grad_full = at::Tensor();
  }
  for (auto& unit : units_) {
    try {
      unit->backward_ends();
    } catch (const std::exception&) {  // its prefetch failed too: the error already thrown is the one to report
    }
  }
  reset_backward_state();
}

void ShardedModel::gradient_ready(size_t g, size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return;
  arm_end_of_backward();
  if (ready_[g][i]) throw Error(recompute::accumulated_twice(group(g).names[i]));
  ready_[g][i] = true;
  hooked_[g] = true;
  if (sync_) stash_gradient(g, i);
  if (--pending_[g] == 0) group_complete(g);
  if (sync_) launch_ready();
}

// The gradient moves into the group's flat buffer and leaves the parameter: a sharded rank keeps
// only its chunk after the reduction. Off the sync boundary it stays in .grad and accumulates there
// (as FSDP's no_sync: whole gradients for the window).
void ShardedModel::stash_gradient(size_t g, size_t i) {
  auto& flat = group(g);
  if (!flat.grad_full.defined()) {
    auto options = flat.full.options().dtype(options_.reduce_dtype.value_or(flat.full.scalar_type()));
    // Stage 1 keeps it across steps: in memory its peers read directly when they share a host.
    flat.grad_full = policy_.shards_gradients ? at::empty({flat.padded()}, options)
                                              : comm_.symmetric_empty({flat.padded()}, options);
    flat.grad_full.zero_();
  }
  auto& grad = flat.params[i].mutable_grad();
  auto view = flat.grad_full.narrow(0, flat.offsets[i], flat.params[i].numel());
  if (grad.defined()) view.copy_(grad.reshape(-1));
  else view.zero_();
  grad = at::Tensor();
}

void ShardedModel::group_complete(size_t g) {
  // Every gradient of the group is computed, so nothing in backward reads its parameters any more.
  if (!policy_.shards_parameters) return;
  unit_of(g).gradients_reduced();
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST)
    prefetch_after(backward_order_, unit_of_group_[g], /*in_backward=*/true);
}

void ShardedModel::launch_ready() {
  while (next_launch_ < launch_order_.size() && pending_[launch_order_[next_launch_]] == 0)
    launch(launch_order_[next_launch_++]);
}

// Groups launch in one fixed order on every rank, so every rank issues the same collective sequence.
void ShardedModel::launch(size_t g) {
  auto& flat = group(g);
  flat.grad_full.div_(comm_.size());
  if (policy_.shards_gradients) {
    grad_shards_[g] = at::empty({flat.shard_numel}, flat.grad_full.options());
    works_[g] = comm_.reduce_scatter_async(grad_shards_[g], flat.grad_full, ReduceOp::SUM);
  } else {
    works_[g] = comm_.all_reduce_async(flat.grad_full, ReduceOp::SUM);
  }
  ++launches_;
  for (auto p : pending_)
    if (p > 0) {
      ++overlapped_;
      break;
    }
  in_flight_.push_back(g);
  // At most two groups' whole gradients are alive at once (FSDP's limit on unsharded buffers): the one
  // in flight and the next one filling up.
  while (policy_.shards_gradients && in_flight_.size() > 1) retire_oldest();
}

void ShardedModel::retire_oldest() {
  const size_t g = in_flight_.front();
  in_flight_.pop_front();
  works_[g].wait();
  works_[g] = Work();
  if (policy_.shards_gradients) group(g).grad_full = at::Tensor();
  // Hybrid: this chunk's holders in the other shard groups average it too (same order on every rank).
  if (replicate_.valid() && replicate_.size() > 1) {
    grad_shards_[g].div_(replicate_.size());
    replicate_.all_reduce(grad_shards_[g], ReduceOp::SUM);
  }
  // Gradients on disk: the chunk leaves memory now, not at the end of backward.
  if (policy_.shards_gradients && gradient_to_disk(g, grad_shards_[g])) grad_shards_[g] = at::Tensor();
}

void ShardedModel::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    reduce_and_hand_over();
  } catch (...) {
    // A collective timed out or failed (or parameters got no gradient): the next backward must not find
    // this one's half-counted state, and what it gathered or filled is dropped.
    drop_backward_state();
    throw;
  }
  for (auto& unit : units_) unit->backward_ends();
  std::exception_ptr failed;  // thrown once this backward's state is reset
  try {
    check_first_backward();
  } catch (...) {
    failed = std::current_exception();
  }
  reset_backward_state();
  if (failed) std::rethrow_exception(failed);
}

void ShardedModel::reduce_accumulated_now() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_backward_) throw Error("reduce_accumulated_now() during a backward; call it after the backwards");
  std::vector<std::string> unused;  // as a synchronising backward would say of them
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t i = 0; i < group(g).params.size(); ++i)
      if (!ready_[g][i] && !group(g).params[i].grad().defined()) unused.push_back(group(g).names[i]);
  if (!unused.empty() && !find_unused_) throw replicate::unused_parameters_error(comm_.rank(), unused, "reduction");
  sync_ = true;
  try {
    // Every backward has ended: no unit's gradients are awaited (group_complete's resharding is done), only moved.
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < group(g).params.size(); ++i)
        if (!ready_[g][i]) {
          ready_[g][i] = true;
          stash_gradient(g, i);
        }
      pending_[g] = 0;
    }
    hand_over_reduced();
  } catch (...) {
    drop_backward_state();
    throw;
  }
  reset_backward_state();
}

void ShardedModel::reduce_and_hand_over() {
  if (sync_) {
    std::vector<std::string> unused;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < group(g).params.size(); ++i)
        if (!ready_[g][i]) unused.push_back(group(g).names[i]);
    if (!unused.empty() && !find_unused_) throw replicate::unused_parameters_error(comm_.rank(), unused, "reduction");
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < group(g).params.size(); ++i)
        if (!ready_[g][i]) {
          ready_[g][i] = true;
          stash_gradient(g, i);
          if (--pending_[g] == 0) group_complete(g);
        }
    hand_over_reduced();
  }
}

// The groups' reductions launched (in the one order) and awaited, and the optimizer's leaves given their parts.
void ShardedModel::hand_over_reduced() {
  launch_ready();
  while (!in_flight_.empty()) retire_oldest();
  // The optimizer's leaves get their parts of the averaged chunks.
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& flat = group(g);
    if (flat.frozen) continue;
    at::Tensor chunk = policy_.shards_gradients
                           ? grad_shards_[g]
                           : flat.grad_full.narrow(0, static_cast<int64_t>(flat.rank) * flat.shard_numel, flat.shard_numel);
    if (!chunk.defined() || (!policy_.shards_gradients && gradient_to_disk(g, chunk))) {  // on disk
      // Leaves with no elements here get their empty gradient as below (the optimizer keeps state for them).
      for (size_t i = 0; i < flat.params.size(); ++i)
        if (flat.owned_part(i).count == 0) flat.shard_params[i].mutable_grad() = at::empty({0}, flat.master.options());
      continue;
    }
    // In the master's dtype, and (offload) in host memory, where the optimizer steps.
    chunk = chunk.to(flat.master.device(), flat.master.scalar_type());
    for (size_t i = 0; i < flat.params.size(); ++i) {
      auto part = flat.owned_part(i);
      flat.shard_params[i].mutable_grad() = chunk.narrow(0, part.in_shard, part.count);
    }
    grad_shards_[g] = at::Tensor();  // owned by the leaves' gradients now: zero_grad(set_to_none) frees it
  }
}

void ShardedModel::reset_backward_state() {
  ready_.assign(groups_.size(), {});
  pending_.assign(groups_.size(), 0);
  hooked_.assign(groups_.size(), false);
  for (size_t g = 0; g < groups_.size(); ++g) {
    // A frozen group has no gradient to wait for: ready from the start, never launched.
    ready_[g].assign(group(g).params.size(), group(g).frozen);
    pending_[g] = group(g).frozen ? 0 : group(g).params.size();
  }
  next_launch_ = 0;
  in_backward_ = false;
  ++backward_generation_;
  for (auto& unit : units_) unit->awaiting = 0;
}

}  // namespace xlr8::shard
