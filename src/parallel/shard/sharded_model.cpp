// ShardedModel: its units built from the wrap plan, and the reduction of gradients as backward produces them.
#include "parallel/shard/sharded_model.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>
#include <unordered_set>

#include "os/memory.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/shard/optimizer_swap.hpp"
#include "parallel/shard/shard_store.hpp"
#include "parallel/replicate/gradient_ready.hpp"
#include "parallel/replicate/replica_sync.hpp"
#include "parallel/shard/unit_registry.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {
namespace {

// Offload, group by group in the units' order: what lives in host memory, until `offload_ratio` of the
// trainable elements does (DeepSpeed's partial offload; every group at 1).
class OffloadBudget {
 public:
  OffloadBudget(const ZeroOptions& options, const StagePolicy& policy, const std::vector<UnitPlan>& plans)
      // Parameters on disk pass through host memory: their groups are placed as offloaded ones.
      : params_((options.offload_params || options.params_on_disk.enabled()) && policy.shards_parameters),
        // The disk tier steps on the host too: the masters it swaps must be there.
        optimizer_(options.offload_optimizer || options.optimizer_on_disk.enabled() || params_),
        pin_(options.offload_pin_memory) {
    if (options.offload_params && !policy.shards_parameters)
      throw ConfigError(fmt::format("offloading parameters needs ZeRO stage 3 (FULL_SHARD); stage {} keeps them whole "
                                    "on every rank: offload the optimizer instead, or use stage 3",
                                    policy.stage));
    // The ratio matters only to an optimizer offloaded without its parameters (DeepSpeed's rule).
    if (optimizer_ && !params_ && !(options.offload_ratio > 0 && options.offload_ratio <= 1))
      throw ConfigError(fmt::format("offload ratio {} must be above 0 and at most 1", options.offload_ratio));
    if (optimizer_ && !params_ && options.offload_ratio < 1 && !policy.shards_parameters)
      throw ConfigError(fmt::format("an offload ratio below 1 ({}) needs ZeRO stage 3; stage {} offloads all or nothing",
                                    options.offload_ratio, policy.stage));
    int64_t trainable = 0;
    for (const auto& plan : plans)
      for (const auto& g : plan.groups)
        for (const auto& p : g.params) trainable += p.requires_grad() ? p.numel() : 0;
    left_ = static_cast<double>(trainable) * options.offload_ratio;
  }
  HostPlacement place(const std::vector<at::Tensor>& params, bool frozen) {
    // Parameters offloaded: every group, its master with it (frozen ones have no optimizer state to move).
    if (params_ || frozen) return {.master = params_, .shard = params_, .pin = pin_};
    int64_t elements = 0;
    for (const auto& p : params) elements += p.numel();
    const bool offloaded = optimizer_ && left_ > 0;
    if (offloaded) left_ -= static_cast<double>(elements);
    return {.master = offloaded, .shard = false, .pin = pin_};
  }

 private:
  bool params_, optimizer_, pin_;
  double left_ = 0;  // trainable elements still to offload
};

struct UnitGroups {
  std::vector<FlatGroup> groups;
  int64_t recorded_now = 0;  // groups whose values came from a recorded build (DeferredInitScope) as made
  int64_t received_now = 0;  // of those, the ones whose values rank 0 computed and sent
};

// Where a recorded build's values come from: computed here, or (every rank recorded it) computed on rank 0
// and sent, the other ranks only making room for them.
size_t give_recorded_values(const std::vector<at::Tensor>& tensors, Communicator& comm, bool from_rank0) {
  return from_rank0 && comm.rank() != 0 ? materialize_empty(tensors) : materialize(tensors);
}

// Whether every rank recorded its build (DeferredInitScope), its values then computed on rank 0 as each group is
// made and sent from there, as DeepSpeed's zero.Init broadcasts each parameter (collective). Under rank-0 loading
// only rank 0 recorded; any other mixture, or a recorded parameter written since (which materialising refuses),
// is refused on every rank before a collective could disagree.
bool recorded_on_every_rank(Communicator& comm, const torch::nn::Module& module, bool rank0_loading) {
  const bool here = has_deferred(module);
  if (comm.size() == 1) return false;
  std::string written;
  try {
    if (here) check_deferred_unchanged(module.parameters());
  } catch (const Error& e) {
    written = e.what();
  }
  auto counts = at::zeros({1 + comm.size()}, at::kInt);  // ranks that recorded; then, per rank, a write
  counts[0] = here ? 1 : 0;
  counts[1 + comm.rank()] = written.empty() ? 0 : 1;
  comm.all_reduce(counts);
  std::vector<int> writers;
  for (int r = 0; r < comm.size(); ++r)
    if (counts[1 + r].item<int>() > 0) writers.push_back(r);
  if (!writers.empty())
    throw ConfigError(written.empty() ? fmt::format("rank(s) {} refused their recorded model (DeferredInitScope): see "
                                                    "their error",
                                                    fmt::join(writers, ", "))
                                      : written);
  const int recorded = counts[0].item<int>();
  if (rank0_loading) return false;
  if (recorded != 0 && recorded != comm.size())
    throw ConfigError(fmt::format("{} of {} ranks recorded the model's build (DeferredInitScope, zero3_init_flag) and "
                                  "the others built it whole (rank {}: {}): build it the same way on every rank",
                                  recorded, comm.size(), comm.rank(), here ? "recorded" : "whole"));
  return recorded == comm.size();
}

// A unit's flat groups, one at a time: a recorded build's values are computed for the group alone, and
// with parameters on disk its shard goes there at once, so at most one group is whole in memory here.
UnitGroups make_unit_groups(UnitPlan& plan, OffloadBudget& offload, Communicator& comm, const ZeroOptions& options,
                            bool owns_shard, bool from_rank0, const std::shared_ptr<ShardStore>& store,
                            size_t& disk_slots) {
  UnitGroups out;
  for (auto& g : plan.groups) {
    const bool frozen = !g.params.front().requires_grad();
    const auto host = offload.place(g.params, frozen);
    if (give_recorded_values(g.params, comm, from_rank0) > 0) {
      ++out.recorded_now;
      out.received_now += from_rank0 && comm.rank() != 0;
    }
    out.groups.push_back(make_flat_group(frozen ? plan.label + " (frozen)" : plan.label, std::move(g.names),
                                         std::move(g.params), comm, owns_shard, options.param_dtype, from_rank0, host));
    if (store) {
      out.groups.back().disk = store;
      out.groups.back().disk_slot = std::to_string(disk_slots++);
      out.groups.back().store_shard();
    }
    os::return_free_memory_to_system();  // the group's original parameter storage, now replaced
  }
  return out;
}

// The parameters no plan's group holds (the frozen ones stages 1-2 keep whole), before the groups are made.
std::vector<at::Tensor> parameters_in_no_group(const torch::nn::Module& module, const std::vector<UnitPlan>& plans) {
  std::unordered_set<const c10::TensorImpl*> grouped;
  for (const auto& plan : plans)
    for (const auto& g : plan.groups)
      for (const auto& p : g.params) grouped.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> kept_whole;
  for (const auto& p : module.parameters())
    if (!grouped.count(p.unsafeGetTensorImpl())) kept_whole.push_back(p);
  return kept_whole;
}

// The values of a recorded build's parameters no group holds: every rank's from rank 0 when every rank recorded it
// (collective; listed from the plans, not by what is still deferred: one sharing storage with a group's parameter
// got values, empty ones off rank 0, with it); else computed here.
void give_values_kept_whole(const torch::nn::Module& module, const std::vector<at::Tensor>& kept_whole,
                            Communicator& comm, bool recorded_everywhere) {
  if (recorded_everywhere) {
    give_recorded_values(kept_whole, comm, /*from_rank0=*/true);
    replicate::broadcast_from_rank0(comm, kept_whole);
  }
  materialize_module(module);
}

}  // namespace

StagePolicy StagePolicy::of(int stage) {
  if (stage < 1 || stage > 3) throw Error(fmt::format("ZeRO stage {} does not exist; use 1, 2 or 3", stage));
  return {stage, /*shards_parameters=*/stage == 3, /*shards_gradients=*/stage >= 2};
}

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> module, Communicator comm, Communicator replicate, int stage,
                       ZeroOptions options, bool find_unused_parameters,
                       std::shared_ptr<const GradientState> gradient_state)
    : module_(std::move(module)),
      comm_(std::move(comm)),
      replicate_(std::move(replicate)),
      policy_(StagePolicy::of(stage)),
      options_(std::move(options)),
      find_unused_(find_unused_parameters),
      gradient_state_(std::move(gradient_state)) {
  context_.comm = &comm_;
  if (keeps_state_on_disk()) os::return_freed_memory_promptly();
  // fsdp_sync_module_states: every rank starts from rank 0's weights (and the same model is checked).
  // Built for rank-0 loading, the other ranks hold no values: each unit's come from rank 0 below, one
  // unit at a time, so no rank ever holds the whole model.
  for (const auto& item : module_->named_parameters())
    if (!item.value().requires_grad()) frozen_at_prepare_.emplace_back(item.key(), item.value());
  const bool from_rank0 = policy_.shards_parameters && options_.values_from_rank0;
  materialize(module_->buffers());  // small, and compared and sent whole below
  const bool recorded_everywhere = recorded_on_every_rank(comm_, *module_, from_rank0);
  if (from_rank0 && options_.param_persistence_threshold > 0)
    throw ConfigError("rank-0 loading (values_from_rank0, fsdp_cpu_ram_efficient_loading) and a parameter persistence "
                      "threshold do not combine: set one of them to off");
  if (from_rank0 && options_.auto_wrap_policy == AutoWrapPolicy::GUARDED_MODULES)
    throw ConfigError("rank-0 loading (values_from_rank0, fsdp_cpu_ram_efficient_loading) needs units known before the "
                      "first forward: use TRANSFORMER_BASED_WRAP or NO_WRAP, not GUARDED_MODULES");
  replicate::make_replicas_equal(comm_, *module_, /*parameters=*/!from_rank0 && !recorded_everywhere);
  auto plans = policy_.shards_parameters ? plan_units(*module_, options_)
                                         : plan_buckets(*module_, options_.first_bucket_mb, options_.bucket_cap_mb);
  OffloadBudget offload(options_, policy_, plans);
  shard_store_ = make_shard_store(plans);
  const auto kept_whole = parameters_in_no_group(*module_, plans);
  size_t disk_slots = 0;
  for (auto& plan : plans) {
    const bool root = plan.module == module_.get();
    auto made = make_unit_groups(plan, offload, comm_, options_, /*owns_shard=*/policy_.shards_parameters,
                                 from_rank0 || recorded_everywhere, shard_store_, disk_slots);
    groups_made_from_recording_ += made.recorded_now;
    groups_received_from_rank0_ += made.received_now;
    // Units start freed under rank-0 loading (their guards gather them), and when their values were computed
    // as they were made, where units are to open guards (by class, as rank-0 loading needs; DeepSpeed's leaf
    // modules, whose forward must then open one); the root stays whole until its guard runs.
    const auto policy = options_.auto_wrap_policy;
    const bool guarded = units_open_guards(policy) ||
                         (policy == AutoWrapPolicy::GUARDED_MODULES && plan.module && is_leaf_module(*plan.module));
    const bool starts_sharded = !root && plan.module && (from_rank0 || (made.recorded_now > 0 && guarded));
    units_.push_back(std::make_unique<ShardingUnit>(std::move(plan.label), plan.module, root, plan.named_by_user,
                                                    std::move(made.groups), context_, policy_.shards_parameters,
                                                    starts_sharded));
    for (auto& group : units_.back()->groups()) {
      const size_t g = groups_.size();
      groups_.push_back(&group);
      unit_of_group_.push_back(units_.size() - 1);
      for (size_t i = 0; i < group.params.size(); ++i) {
        slots_[group.params[i].unsafeGetTensorImpl()] = {g, i, /*is_leaf=*/false};
        slots_[group.shard_params[i].unsafeGetTensorImpl()] = {g, i, /*is_leaf=*/true};
      }
    }
  }
  give_values_kept_whole(*module_, kept_whole, comm_, recorded_everywhere);
  // Gradients become ready in reverse: buckets are already in that order; units (root last) reverse.
  for (size_t g = 0; g < groups_.size(); ++g)
    if (!group(g).frozen) launch_order_.push_back(g);
  if (policy_.shards_parameters) {
    std::reverse(launch_order_.begin(), launch_order_.end());
    // The persistent parameters (small ones of every layer) complete late: just before the root's, which
    // go last (its embeddings finish last).
    std::stable_partition(launch_order_.begin(), launch_order_.end(),
                          [&](size_t g) { return unit_of(g).module() != nullptr; });
    std::stable_partition(launch_order_.begin(), launch_order_.end(), [&](size_t g) { return !unit_of(g).is_root(); });
  }
  grad_shards_.resize(groups_.size());
  works_.resize(groups_.size());
  context_.peak_gathered_bytes = context_.step_peak_gathered_bytes = context_.gathered_bytes;
  reset_backward_state();
}

ShardedModel::~ShardedModel() {
  std::lock_guard<std::mutex> lock(mutex_);
  detached_ = true;
  try {
    settle_prefetches();  // the communicator must not write into memory freed after this
  } catch (const std::exception&) {
  }
  for (const auto& unit : units_)
    if (unit->module()) unregister_unit(*unit->module());
}

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
