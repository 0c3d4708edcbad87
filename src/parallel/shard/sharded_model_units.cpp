// ShardedModel, stage 3: the guards' calls around a unit's forward and backward, the order units run in
// (prefetching, and the check that every rank runs them alike), when a unit's frozen parameters can go,
// units that never opened their guard, and gather_full_parameters (FSDP's summon_full_params).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.hpp"
#include "core/text.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/replicate/gradient_ready.hpp"
#include "parallel/shard/unit_registry.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "parallel/shard/sharded_model.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {
namespace {

// How a unit's guard reaches its model (the registry holds it while the model lives).
class UnitHandle final : public UnitHooks {
 public:
  UnitHandle(std::weak_ptr<ShardedModel> owner, size_t unit) : owner_(std::move(owner)), unit_(unit) {}
  void before_forward() override {
    if (auto e = owner_.lock()) e->unit_forward_begins(unit_);
  }
  std::vector<at::Tensor> after_forward(const std::vector<at::Tensor>& outputs) override {
    auto e = owner_.lock();
    return e ? e->unit_forward_ends(unit_, outputs) : outputs;
  }
  void forward_abandoned() override {
    if (auto e = owner_.lock()) e->unit_forward_abandoned(unit_);
  }

 private:
  std::weak_ptr<ShardedModel> owner_;
  size_t unit_;
};

}  // namespace

void ShardedModel::attach() {
  std::weak_ptr<ShardedModel> self = shared_from_this();
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (group(g).frozen) continue;
    auto hooked = replicate::on_gradient_ready(group(g).params, [self, g](size_t i) {
      if (auto sharded = self.lock()) sharded->gradient_ready(g, i);
    });
    accumulators_.insert(accumulators_.end(), hooked.begin(), hooked.end());
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!units_[u]->module()) continue;  // a bucket
    auto handle = std::make_shared<UnitHandle>(self, u);
    register_unit(*units_[u]->module(), handle);
    unit_handles_.push_back(handle);
  }
}

// ------------------------------------------------------------------------------------------ prefetching

void ShardedModel::prefetch(size_t u, bool in_backward) {
  auto& unit = *units_[u];
  if (!unit.managed()) return;
  // FSDP's limit: besides the root, at most two units gathered (the running one and the next). The count
  // is the same on every rank, so the decision is too.
  int gathered_units = 0;
  for (const auto& other : units_)
    if (!other->is_root() && !other->rides() && other->managed() && other->any_gathered()) ++gathered_units;
  if (gathered_units >= 2) return;
  unit.prefetch(in_backward);
}

void ShardedModel::read_ahead_after(const UnitOrder& order, size_t u) const {
  // DeepSpeed's stage3_prefetch_bucket_size 0 fetches nothing ahead, from the disk neither.
  if (!shard_store_ || (options_.max_live_elements > 0 && options_.prefetch_bucket_elements == 0)) return;
  auto it = std::find(order.last.begin(), order.last.end(), u);
  if (it == order.last.end()) return;
  // The next gather's: past the units gathered already (by prefetches), whose shards a read would bring in vain.
  for (++it; it != order.last.end(); ++it)
    if (!units_[*it]->any_gathered() && !units_[*it]->prefetching()) return units_[*it]->read_ahead();
}

// The order is what every rank's model did in its last pass (checked alike on every rank), so every
// rank prefetches the same unit at the same moment and the collective sequences stay identical.
void ShardedModel::prefetch_after(const UnitOrder& order, size_t u, bool in_backward) {
  if (!prefetch_allowed()) return;
  auto it = std::find(order.last.begin(), order.last.end(), u);
  if (it == order.last.end() || it + 1 == order.last.end()) return;
  if (options_.max_live_elements > 0) return prefetch_within_bounds(order, it + 1, in_backward);
  // Not a unit that already ran in this pass (the root's gradients complete last, after every block's).
  if (std::find(order.current.begin(), order.current.end(), *(it + 1)) != order.current.end()) return;
  prefetch(*(it + 1), in_backward);
}

// DeepSpeed's partitioned-parameter coordinator: prefetch at most min(bucket, max live - live) elements,
// counted in whole units. Live and issued counts are the same on every rank, so the decisions are too.
void ShardedModel::prefetch_within_bounds(const UnitOrder& order, std::vector<size_t>::const_iterator next,
                                        bool in_backward) {
  int64_t live = 0;
  for (const auto& other : units_)
    if (!other->is_root() && !other->rides() && other->managed() && other->any_gathered()) live += other->full_numel();
  const int64_t budget = std::min(options_.prefetch_bucket_elements, options_.max_live_elements - live);
  int64_t issued = 0;
  for (; next != order.last.end() && issued < budget; ++next) {
    if (std::find(order.current.begin(), order.current.end(), *next) != order.current.end()) return;  // ran already
    auto& unit = *units_[*next];
    if (unit.is_root() || unit.rides() || !unit.managed() || unit.any_gathered() || unit.prefetching()) continue;
    if (unit.prefetch(in_backward)) issued += unit.full_numel();
  }
}

void ShardedModel::UnitOrder::record(size_t u) {
  if (std::find(current.begin(), current.end(), u) != current.end()) last = std::exchange(current, {});
  current.push_back(u);
}

void ShardedModel::settle_prefetches() {
  for (auto& unit : units_) unit->wait_prefetch();
}

void ShardedModel::drop_prefetches() {
  for (auto& unit : units_)
    if (unit->prefetching()) unit->release(ShardingUnit::Which::ALL);  // waits for the gather, then frees it again
}

// Every unit's all-gather pairs up by position with the other ranks': ranks that run units in another
// order would hang or, units of the same size, exchange each other's shards silently. One hash per rank
// settles it; only when they differ are the orders themselves exchanged, to name the first difference.
void ShardedModel::check_order_across_ranks(const std::vector<size_t>& order, const char* pass) {
  if (comm_.size() == 1) return;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the unit indices
  for (size_t u : order) hash = (hash ^ (u + 1)) * 1099511628211ull;
  const int64_t mine = static_cast<int64_t>(hash >> 1);
  auto bounds = at::tensor({mine, -mine, static_cast<int64_t>(order.size())}, at::kLong);
  comm_.all_reduce(bounds, ReduceOp::MAX);
  if (bounds[0].item<int64_t>() == mine && -bounds[1].item<int64_t>() == mine) return;
  const int64_t longest = bounds[2].item<int64_t>();
  auto mine_padded = at::full({longest}, -1, at::kLong);
  for (size_t k = 0; k < order.size(); ++k) mine_padded[static_cast<int64_t>(k)] = static_cast<int64_t>(order[k]);
  auto all = at::empty({longest * comm_.size()}, at::kLong);
  comm_.all_gather(all, mine_padded);
  auto rows = all.view({comm_.size(), longest});
  auto name = [&](int64_t u) { return u < 0 ? std::string("nothing") : units_[static_cast<size_t>(u)]->label(); };
  for (int64_t k = 0; k < longest; ++k)
    for (int r = 1; r < comm_.size(); ++r) {
      const int64_t first = rows[0][k].item<int64_t>(), other = rows[r][k].item<int64_t>();
      if (first == other) continue;
      throw Error(fmt::format(
          "sharded units ran in different orders on different ranks in the {} pass: unit {} of it was {} on rank 0 "
          "and {} on rank {}. Every unit's all-gather pairs up with the other ranks' by position, so each rank must "
          "call the units' forwards in the same order (a rank-dependent branch around a unit, or a unit called only "
          "on some ranks, breaks this)",
          pass, k + 1, name(first), name(other), r));
    }
}

// ------------------------------------------------------------------------------------------ the guards' calls

void ShardedModel::unit_forward_begins(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& unit = *units_[u];
  unit.forward_begins();
  unit.forward_start = autograd_position();
  if (recompute::recomputing()) return;  // activation checkpointing, in backward: not a forward of the step
  forward_order_.record(u);
  if (options_.forward_prefetch) prefetch_after(forward_order_, u, /*in_backward=*/false);
  read_ahead_after(forward_order_, u);  // read while this unit computes
}

std::vector<at::Tensor> ShardedModel::unit_forward_ends(size_t u, const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> needing_backward;
  for (const auto& out : outputs)
    if (out.defined() && out.requires_grad()) needing_backward.push_back(out);
  const bool backward_follows = at::GradMode::is_enabled() && !needing_backward.empty();
  auto& unit = *units_[u];
  std::vector<at::Tensor> handed = outputs;
  if (backward_follows) {
    std::weak_ptr<ShardedModel> self = shared_from_this();
    // The root's frozen groups stay gathered through the whole backward anyway.
    if (unit.carries_frozen() && !unit.is_root()) {
      uint64_t generation = 0;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        generation = backward_generation_;
        ++unit.awaiting;
      }
      auto done = [self, u, generation] {
        if (auto e = self.lock()) e->unit_backward_done(u, generation);
      };
      auto dropped = [self, u, generation] {
        if (auto e = self.lock()) e->unit_graph_dropped(u, generation);
      };
      if (after_backward_of(needing_backward, unit.forward_start, done, dropped) == 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        --unit.awaiting;  // backward reads nothing of the unit's
      }
    }
    // FSDP2 hooks every output: whichever backward reaches first gathers the unit.
    for (auto& out : handed)
      if (out.defined() && out.requires_grad())
        out = with_backward_prehook(out, [self, u] {
          if (auto e = self.lock()) e->unit_backward_begins(u);
        });
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // Recomputed for its backward, which starts right after: gathered once for both.
  unit.forward_ends(backward_follows, /*keep_gathered=*/backward_follows && recompute::recomputing());
  // The model's forward is done: before its backward gathers anything, every rank ran the units alike.
  if (unit.is_root() && backward_follows && !forward_order_checked_) {
    check_order_across_ranks(forward_order_.current, "forward");
    forward_order_checked_ = true;
  }
  return handed;
}

void ShardedModel::unit_forward_abandoned(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  units_[u]->forward_abandoned();
  // The model's forward failed. Units that start freed and were never gathered are the likely cause:
  // reading them fails inside LibTorch with a message about "lazy allocation".
  const bool start_freed = options_.values_from_rank0 || groups_made_from_recording_ > 0;
  if (!units_[u]->is_root() || !start_freed || warned_unguarded_) return;
  std::vector<std::string> never;
  for (const auto& other : units_)
    if (!other->guard_opened() && !other->is_root() && other->module()) never.push_back(other->label());
  if (never.empty()) return;
  warned_unguarded_ = true;
  log::warning("xlr8: the model's forward failed before unit(s) {} ever opened xlr8::unshard(*this). Built by "
               "build_model for rank-0 loading or recorded (fsdp_cpu_ram_efficient_loading, zero3_init_flag), units "
               "hold no parameters until their guard gathers them: add the guard to their forward, or set "
               "fsdp_cpu_ram_efficient_loading / zero3_init_flag to false",
               fmt::join(never, ", "));
}

void ShardedModel::unit_backward_begins(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return;
  arm_end_of_backward();
  if (!units_[u]->backward_begins()) return;  // another of its outputs got there first
  backward_order_.record(u);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE)
    prefetch_after(backward_order_, u, /*in_backward=*/true);
  read_ahead_after(backward_order_, u);
}

void ShardedModel::unit_backward_done(size_t u, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mutex_);
  no_longer_awaited(u, generation);
}

void ShardedModel::unit_graph_dropped(size_t u, uint64_t generation) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (lock.owns_lock()) no_longer_awaited(u, generation);  // else they stay until the end of backward
}

void ShardedModel::no_longer_awaited(size_t u, uint64_t generation) {
  // A forward recorded for an earlier backward (its graph was dropped, or this is a second run of a
  // retained graph) says nothing about this one.
  if (detached_ || generation != backward_generation_) return;
  auto& unit = *units_[u];
  if (unit.awaiting == 0) return;
  unit.forward_no_longer_awaited();
  const bool trainable = std::any_of(unit.groups().begin(), unit.groups().end(), [](const FlatGroup& g) { return !g.frozen; });
  // A unit without gradients never completes a group: its backward ending is the BACKWARD_POST moment.
  if (unit.awaiting == 0 && unit.state() != ShardingUnit::State::FORWARD && !trainable &&
      options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST)
    prefetch_after(backward_order_, u, /*in_backward=*/true);
}

// ------------------------------------------------------------------------------------------ after the first step

void ShardedModel::check_first_backward() {
  if (!policy_.shards_parameters) return;
  // A root without a guard has no end of forward to check at: its forward's order is checked here.
  if (!forward_order_checked_) {
    check_order_across_ranks(forward_order_.current, "forward");
    forward_order_checked_ = true;
  }
  if (!backward_order_checked_) {
    check_order_across_ranks(backward_order_.current, "backward");
    backward_order_checked_ = true;
  }
  assign_riders();
  report_unguarded_units();
}

// GUARDED_MODULES: which modules open a guard is known once the model ran. Every rank ran the same
// units (the order checks above), so every rank assigns the same hosts.
void ShardedModel::assign_riders() {
  if (riders_assigned_ || options_.auto_wrap_policy != AutoWrapPolicy::GUARDED_MODULES) return;
  riders_assigned_ = true;
  auto contains = [](const ShardingUnit& outer, const ShardingUnit& inner) {
    return outer.is_root() || (inner.label().size() > outer.label().size() &&
                               inner.label().compare(0, outer.label().size(), outer.label()) == 0 &&
                               inner.label()[outer.label().size()] == '.');
  };
  for (auto& rider : units_) {
    if (rider->is_root() || !rider->module() || rider->guard_opened() || rider->groups().empty()) continue;
    ShardingUnit* host = nullptr;
    for (auto& candidate : units_)
      if (candidate->module() && candidate->guard_opened() && contains(*candidate, *rider) &&
          (!host || host->is_root() || (!candidate->is_root() && candidate->label().size() > host->label().size())))
        host = candidate.get();
    if (host) host->carry(*rider);
  }
}

void ShardedModel::report_unguarded_units() {
  if (unguarded_checked_ || !policy_.shards_parameters) return;
  unguarded_checked_ = true;
  // A unit whose parameters got gradients from backward ran; if its guard never opened, it ran whole.
  std::vector<std::string> listed;
  const ShardingUnit* named = nullptr;
  int64_t bytes = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& unit = *units_[u];
    if (!unit.module() || unit.guard_opened() || unit.rides() || unit.groups().empty()) continue;
    bool ran = !std::any_of(unit.groups().begin(), unit.groups().end(), [](const FlatGroup& g) { return !g.frozen; });
    for (size_t g = 0; g < groups_.size(); ++g)
      if (unit_of_group_[g] == u && hooked_[g]) ran = true;
    if (!ran) continue;
    if (unit.named_by_user() && !named) named = &unit;
    listed.push_back(fmt::format("{} ({}, {})", unit.label(), unit.module()->name(), text::bytes(unit.full_bytes())));
    bytes += unit.full_bytes();
  }
  if (listed.empty()) return;
  const size_t count = listed.size();
  if (count > 8) {  // a model of many modules: the first ones say enough
    listed.resize(8);
    listed.push_back(fmt::format("and {} more", count - 8));
  }
  const std::string fix =
      "add `auto unit = xlr8::unshard(*this);` as the first line of its forward and return `unit.done(output)` "
      "(or wrap the body: `return xlr8::sharded(*this, [&] { ... });`)";
  // A library's layer (listed by its class) has a forward the user cannot edit: name what to list instead.
  if (named && opens_no_guard(*named->module()))
    throw ConfigError(fmt::format("fsdp_transformer_layer_cls_to_wrap lists {}, the class of unit {}: a layer of "
                                  "LibTorch or xlr8, whose forward opens no guard, so its parameters would stay whole "
                                  "on every rank. List the class of your own module that holds it (your transformer "
                                  "block) instead",
                                  named->module()->name(), named->label()));
  if (named)
    throw ConfigError(fmt::format("{} the class of unit {} ({}), but its forward never opened its guard, so its "
                                  "parameters would stay whole on every rank: {}",
                                  options_.layer_classes.empty() ? "the model's no_split_modules() names"
                                                                 : "fsdp_transformer_layer_cls_to_wrap lists",
                                  named->label(), named->module()->name(), fix));
  log::warning("xlr8: {} sharding unit(s) never opened their guard, so their parameters stay whole on every rank "
               "(each rank holds {} of them instead of {}): {}. To shard a unit, {}",
               count, text::bytes(bytes), text::bytes(bytes / comm_.size()), fmt::join(listed, ", "), fix);
}

void ShardedModel::gather_full_parameters() {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_prefetches();
  ++context_.summoned;
  for (auto& unit : units_) unit->gather_all();
}

void ShardedModel::release_full_parameters(bool writeback) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (context_.summoned > 0) --context_.summoned;
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    for (auto& group : unit->groups())
      if (writeback && group.gathered()) {
        auto own = group.full.narrow(0, static_cast<int64_t>(group.rank) * group.shard_numel, group.shard_numel);
        group.load_shard();
        if (group.owns_shard) group.shard.copy_(own);
        if (group.mixed()) group.master.copy_(own);
        group.store_shard();
      }
    unit->release(ShardingUnit::Which::ALL);
  }
}

}  // namespace xlr8::shard
