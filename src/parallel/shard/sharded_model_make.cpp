// ShardedModel's making: its units and flat groups from the wrap plan (offloaded, on disk, or with the values of
// a recorded build computed group by group), and its end.
#include "parallel/shard/sharded_model.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <unordered_set>

#include "os/memory.hpp"
#include "parallel/shard/optimizer_swap.hpp"
#include "parallel/shard/shard_store.hpp"
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
  if (comm.size() == 1) return false;
  auto tensors = module.parameters();
  for (const auto& b : module.buffers()) tensors.push_back(b);
  const bool here = std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return is_deferred(t); });
  std::string written;
  try {
    if (here) check_deferred_unchanged(tensors);
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
  // A recorded build's groups are computed one at a time: each group's freed originals go back at once.
  std::optional<os::PromptlyFreedMemory> prompt;
  if (has_deferred(*module_)) prompt.emplace();
  // fsdp_sync_module_states: every rank starts from rank 0's weights (and the same model is checked).
  // Built for rank-0 loading, the other ranks hold no values: each unit's come from rank 0 below, one
  // unit at a time, so no rank ever holds the whole model.
  for (const auto& item : module_->named_parameters())
    if (!item.value().requires_grad()) frozen_at_prepare_.emplace_back(item.key(), item.value());
  const bool from_rank0 = policy_.shards_parameters && options_.values_from_rank0;
  const bool recorded_everywhere = recorded_on_every_rank(comm_, *module_, from_rank0);
  materialize(module_->buffers());  // small, and compared and sent whole below
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

}  // namespace xlr8::shard
