// ZeroEngine, stage 3: the units' gathers and releases, prefetching, the guards' calls around a unit's
// forward and backward, when a unit's frozen parameters can go, and summon_full_params.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.hpp"
#include "parallel/sharded_unit.hpp"
#include "parallel/zero_engine.hpp"

namespace xlr8::detail {

// ------------------------------------------------------------------------------------------ gathers (stage 3)

void ZeroEngine::gather(size_t g) {
  if (await_prefetch(g)) return;  // issued early: now it is there
  auto& group = groups_[g];
  if (group.gathered()) return;
  group.gather(comm_);
  ++gathers_;
  gathered_bytes_ += group.full_bytes();
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
  step_peak_gathered_bytes_ = std::max(step_peak_gathered_bytes_, gathered_bytes_);
}

bool ZeroEngine::release(size_t g) {
  await_prefetch(g);  // never free memory a gather writes into
  auto& group = groups_[g];
  if (!managed_[g] || summoned_ > 0 || !group.gathered()) return false;
  group.release();
  ++releases_;
  gathered_bytes_ -= group.full_bytes();
  return true;
}

bool ZeroEngine::await_prefetch(size_t g) {
  auto it = prefetching_.find(g);
  if (it == prefetching_.end()) return false;
  it->second.wait();  // before forgetting it: a failed wait leaves it recorded
  prefetching_.erase(it);
  return true;
}

void ZeroEngine::prefetch(size_t u, bool in_backward) {
  // gathered(): also while a prefetch runs.
  auto wanted = [&](size_t g) { return managed_[g] && !groups_[g].gathered(); };
  const auto& mine = units_[u].groups;
  if (std::none_of(mine.begin(), mine.end(), wanted)) return;
  // FSDP's limit: besides the root, at most two units gathered (the running one and the next). The count
  // is the same on every rank, so the decision is too.
  int gathered_units = 0;
  for (size_t other = 0; other < units_.size(); ++other) {
    const auto& groups = units_[other].groups;
    if (!is_root(other) && std::any_of(groups.begin(), groups.end(),
                                       [&](size_t g) { return managed_[g] && groups_[g].gathered(); }))
      ++gathered_units;
  }
  if (gathered_units >= 2) return;
  for (size_t g : mine) {
    if (!wanted(g)) continue;
    prefetching_.emplace(g, groups_[g].gather_async(comm_));
    ++gathers_;
    gathered_bytes_ += groups_[g].full_bytes();
  }
  ++(in_backward ? backward_prefetches_ : forward_prefetches_);
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
  step_peak_gathered_bytes_ = std::max(step_peak_gathered_bytes_, gathered_bytes_);
}

// The order is what every rank's model did in its last pass, so every rank prefetches the same unit
// at the same moment and the collective sequences stay identical.
void ZeroEngine::prefetch_after(const UnitOrder& order, size_t u, bool in_backward) {
  auto it = std::find(order.last.begin(), order.last.end(), u);
  if (it == order.last.end() || it + 1 == order.last.end()) return;
  // Not a unit that already ran in this pass (the root's gradients complete last, after every block's).
  if (std::find(order.current.begin(), order.current.end(), *(it + 1)) != order.current.end()) return;
  prefetch(*(it + 1), in_backward);
}

void ZeroEngine::UnitOrder::record(size_t u) {
  if (std::find(current.begin(), current.end(), u) != current.end()) last = std::exchange(current, {});
  current.push_back(u);
}

void ZeroEngine::settle_prefetches() {
  for (auto& [g, work] : prefetching_) work.wait();
  prefetching_.clear();
}

void ZeroEngine::drop_prefetches() {
  std::vector<size_t> issued;
  for (const auto& [g, work] : prefetching_) issued.push_back(g);
  for (size_t g : issued) release(g);  // waits for the gather, then frees the unit again
}

void ZeroEngine::unit_forward_begins(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t g : units_[u].groups) {
    managed_[g] = true;
    gather(g);
  }
  forward_start_[u] = autograd_position();
  guarded_[u] = true;
  in_forward_[u] = true;
  forward_order_.record(u);
  if (options_.forward_prefetch) prefetch_after(forward_order_, u, /*in_backward=*/false);
}

at::Tensor ZeroEngine::unit_forward_ends(size_t u, const at::Tensor& output) {
  const bool backward_follows = at::GradMode::is_enabled() && output.defined() && output.requires_grad();
  at::Tensor out = output;
  if (backward_follows) {
    std::weak_ptr<ZeroEngine> self = shared_from_this();
    // Frozen parameters have no gradient to say when backward is done with them: the unit's own
    // autograd nodes do (the root's stay gathered through the whole backward anyway).
    if (has_frozen(u) && !is_root(u)) {
      uint64_t generation = 0;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        generation = backward_generation_;
        ++awaiting_backward_[u];
      }
      auto done = [self, u, generation] {
        if (auto e = self.lock()) e->unit_backward_done(u, generation);
      };
      auto dropped = [self, u, generation] {
        if (auto e = self.lock()) e->unit_graph_dropped(u, generation);
      };
      if (after_backward_of(output, forward_start_[u], done, dropped) == 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        --awaiting_backward_[u];  // backward reads nothing of the unit's
      }
    }
    out = with_backward_prehook(output, [self, u] {
      if (auto e = self.lock()) e->unit_backward_begins(u);
    });
  }
  std::lock_guard<std::mutex> lock(mutex_);
  in_forward_[u] = false;
  // The root's backward comes first, right after its forward ends: it stays gathered until then.
  if (!backward_follows || !is_root(u))
    for (size_t g : units_[u].groups) release(g);
  return out;
}

void ZeroEngine::unit_forward_abandoned(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_forward_[u] = false;
  for (size_t g : units_[u].groups) release(g);
  // The model's forward failed. Units that start freed and were never gathered are the likely cause:
  // reading them fails inside LibTorch with a message about "lazy allocation".
  if (!is_root(u) || !options_.values_from_rank0 || warned_unguarded_) return;
  std::vector<std::string> never;
  for (size_t other = 0; other < units_.size(); ++other)
    if (!guarded_[other] && !is_root(other)) never.push_back(groups_[units_[other].groups.front()].label);
  if (never.empty()) return;
  warned_unguarded_ = true;
  log::warning("xlr8: the model's forward failed before unit(s) {} ever opened xlr8::unshard(*this). Built by "
               "build_model for rank-0 loading (fsdp_cpu_ram_efficient_loading), units hold no parameters until "
               "their guard gathers them: add the guard to their forward, or set fsdp_cpu_ram_efficient_loading: "
               "false",
               fmt::join(never, ", "));
}

void ZeroEngine::unit_backward_begins(size_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return;
  arm_end_of_backward();
  for (size_t g : units_[u].groups) gather(g);
  backward_order_.record(u);
  if (options_.backward_prefetch == "BACKWARD_PRE") prefetch_after(backward_order_, u, /*in_backward=*/true);
}

void ZeroEngine::unit_backward_done(size_t u, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mutex_);
  no_longer_awaited(u, generation);
}

void ZeroEngine::unit_graph_dropped(size_t u, uint64_t generation) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (lock.owns_lock()) no_longer_awaited(u, generation);  // else they stay until the end of backward
}

void ZeroEngine::no_longer_awaited(size_t u, uint64_t generation) {
  // A forward recorded for an earlier backward (its graph was dropped, or this is a second run of a
  // retained graph) says nothing about this one.
  if (detached_ || generation != backward_generation_ || awaiting_backward_[u] == 0) return;
  // Not while the unit's own forward runs (a graph of an earlier forward freed inside it).
  if (--awaiting_backward_[u] > 0 || in_forward_[u]) return;
  bool trainable = false;
  for (size_t g : units_[u].groups) {
    if (!groups_[g].frozen) {
      trainable = true;
      continue;
    }
    if (release(g)) ++frozen_released_in_backward_;
  }
  // A unit without gradients never completes a group: its backward ending is the BACKWARD_POST moment.
  if (!trainable && options_.backward_prefetch == "BACKWARD_POST")
    prefetch_after(backward_order_, u, /*in_backward=*/true);
}

void ZeroEngine::gather_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_prefetches();
  ++summoned_;
  for (size_t g = 0; g < groups_.size(); ++g) gather(g);
}

void ZeroEngine::release_all(bool writeback) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (summoned_ > 0) --summoned_;
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& group = groups_[g];
    if (writeback && group.gathered()) {
      auto own = group.full.narrow(0, static_cast<int64_t>(group.rank) * group.shard_numel, group.shard_numel);
      if (group.owns_shard) group.shard.copy_(own);
      if (group.mixed()) group.master.copy_(own);
    }
    release(g);
  }
}

}  // namespace xlr8::detail
