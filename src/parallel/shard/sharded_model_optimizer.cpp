// ShardedModel's optimizer side: what the optimizer updates (this rank's shards), the step and the whole
// copies catching up after it, the global gradient norm, which tensors are the sharded model's, and its figures.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "compat/torch_compat.hpp"
#include "parallel/grad_norm.hpp"
#include "os/memory.hpp"
#include "parallel/shard/gradients_on_disk.hpp"
#include "parallel/shard/optimizer_swap.hpp"
#include "parallel/shard/shard_store.hpp"
#include "parallel/shard/sharded_model.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::shard {

namespace {

// The norms of order p of gradients waiting on disk, asked per leaf, taken (or read) once per group.
class NormsOnDisk {
 public:
  explicit NormsOnDisk(double p) : p_(p) {}
  // Leaf shard_params[index]'s in `group` of `gradients`; undefined when it has no elements here or was set to none.
  at::Tensor of(GradientsOnDisk& gradients, size_t group, size_t index) {
    auto [cached, fresh] = norms_.try_emplace(std::pair{&gradients, group});
    if (fresh) cached->second = gradients.norms(group, p_);
    const auto j = gradients.part_of(group, index);
    return j ? cached->second[*j] : at::Tensor();
  }

 private:
  double p_;
  std::map<std::pair<const GradientsOnDisk*, size_t>, std::vector<at::Tensor>> norms_;
};

}  // namespace

// ------------------------------------------------------------------------------------------ optimizer

std::vector<at::Tensor> ShardedModel::optimizer_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto* g : groups_) out.insert(out.end(), g->shard_params.begin(), g->shard_params.end());
  return out;
}

void ShardedModel::bind_optimizer(torch::optim::Optimizer& optimizer) {
  std::set<size_t> bound;  // the groups whose leaves the optimizer updates
  for (auto& param_group : optimizer.param_groups())
    for (auto& p : param_group.params()) {
      auto it = slots_.find(p.unsafeGetTensorImpl());
      if (it == slots_.end()) continue;
      if (!group(it->second.group).frozen) bound.insert(it->second.group);
      if (it->second.is_leaf) continue;
      if (optimizer.state().count(compat::optimizer_state_key(p)))
        throw Error(fmt::format("prepare(): the optimizer already holds state for parameter {}; prepare the "
                                "optimizer before its first step so that it can work on this rank's shards",
                                group(it->second.group).names[it->second.index]));
      p = group(it->second.group).shard_params[it->second.index];
    }
  if (!options_.optimizer_on_disk.enabled() || bound.empty()) return;
  // The swaps of optimizers freed since (a training phase's, replaced by another's) go, with their files and buffers.
  std::erase_if(swaps_, [](const auto& entry) { return entry.second->orphaned(); });
  // An optimizer bound again keeps its swap; one made where a freed one lived gets its own (the old file goes).
  if (const auto it = swaps_.find(&optimizer); it != swaps_.end()) {
    if (it->second->serves(optimizer)) return;
    swaps_.erase(it);
  }
  // Gradients on disk are handed to the one swap that holds their group: a second live optimizer of it would get none.
  for (const auto& [other, swap] : swaps_)
    for (size_t g : bound)
      if (options_.optimizer_on_disk.gradients && swap->group_of(&group(g)))
        throw ConfigError(fmt::format("XLR8_GRADIENTS_ON_DISK=1: parameters of sharding group {} are given to a second "
                                      "optimizer while another optimizer of that group is alive (prepared); the "
                                      "gradients on disk go to one optimizer per group: put these parameters in one "
                                      "optimizer (its param groups may differ), call free_memory() and prepare again "
                                      "for a new optimizer, or unset XLR8_GRADIENTS_ON_DISK",
                                      group(g).label));
  std::vector<FlatGroup*> groups;
  for (size_t g : bound) groups.push_back(&group(g));
  swaps_[&optimizer] = std::make_unique<OptimizerSwap>(options_.optimizer_on_disk, optimizer, groups);
}

void ShardedModel::optimizer_state_in_memory(torch::optim::Optimizer& optimizer, bool in_memory) {
  // The state alone: a checkpoint reads and writes the parameters' pieces one group at a time (hold_in_memory).
  const auto it = swaps_.find(&optimizer);
  if (it == swaps_.end()) return;
  if (in_memory) it->second->bring_in(optimizer);
  else it->second->put_away(optimizer);
}

void ShardedModel::optimizer_step(torch::optim::Optimizer& optimizer) {
  // Which parameters train is fixed when the model is prepared (they decide the groups and hooks).
  for (const auto& [name, p] : frozen_at_prepare_)
    if (p.requires_grad())
      throw Error(fmt::format("parameter {} was frozen (requires_grad false) when the model was prepared and is "
                              "trainable now; sharding fixes which parameters train at prepare(): set requires_grad "
                              "before prepare, or call free_memory() and prepare the model again",
                              name));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_prefetches();  // one the order mispredicted: it reads the shards the step is about to change
  }
  // An optimizer whose swap went (its state was replaced outside the swap, then another optimizer was bound) gets one
  // again: its state goes back to disk after this step.
  if (options_.optimizer_on_disk.enabled() && !swaps_.count(&optimizer)) bind_optimizer(optimizer);
  if (const auto swap = swaps_.find(&optimizer); swap != swaps_.end()) swap->second->step(optimizer);
  else optimizer.step();
  std::lock_guard<std::mutex> lock(mutex_);
  // Stages 1-2: every rank updated its chunk of the whole parameters; gather the others' in place.
  // Stage 3: the shards are the parameters; only groups held whole (no guard, or gathered now) refresh.
  refresh_whole_copies(/*frozen_too=*/false);
  // Parameters on disk: the step put the trained shards back; a frozen one that a sharded state dict brought in
  // goes back too (its views, like the trained ones', end with the step).
  all_shards_in_memory(false);
  // Offload's disk tier: a step's allocations below the mmap threshold land in the heap that held the model before it
  // went to disk, and their freed pages stay resident there (a 0.5 B-parameter GPT: 1.3 of its 2.7 GB between steps).
  if (keeps_state_on_disk()) {
    const auto start = std::chrono::steady_clock::now();
    os::return_free_memory_to_system();
    heap_trim_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}

void ShardedModel::refresh_whole_copies(bool frozen_too) {
  std::vector<Work> works;
  for (auto* flat : groups_)
    if (frozen_too || !flat->frozen) works.push_back(flat->refresh_async(comm_));
  for (auto& w : works) w.wait();
}

bool ShardedModel::owns(const at::Tensor& tensor) const {
  if (slot_of(tensor)) return true;
  // Stages 1-2 keep frozen parameters whole, outside every group.
  return std::any_of(frozen_at_prepare_.begin(), frozen_at_prepare_.end(),
                     [&](const auto& item) { return item.second.is_same(tensor); });
}

const ShardedModel::Slot* ShardedModel::slot_of(const at::Tensor& tensor) const {
  auto it = slots_.find(tensor.unsafeGetTensorImpl());
  return it == slots_.end() ? nullptr : &it->second;
}

GradNorm ShardedModel::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  // Each rank holds the averaged gradients of its own chunks: partial norms, reduced over the group.
  // Tensor-parallel slices are partial over the tp group as well; replicated parameters are not.
  const auto sliced = tp::sliced_parameters(*module_);
  std::vector<at::Tensor> grads, sliced_grads;
  // Gradients on disk: the norms taken when they were written (in the parameters' order among the gradients in
  // memory), and which leaves to scale when the step reads them.
  std::vector<at::Tensor> disk_norms, sliced_disk_norms;
  std::vector<bool> from_disk, sliced_from_disk;
  std::vector<std::pair<OnDisk, size_t>> scaled_on_disk;
  NormsOnDisk norms_on_disk(norm_type);
  std::map<std::pair<size_t, size_t>, bool> seen;
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    if (!slot && !p.requires_grad()) continue;  // frozen and whole (stages 1-2): no gradient to clip
    if (!slot)
      throw Error("clip_grad_norm(): a parameter is not one this sharded model trains (pass model->parameters())");
    if (!seen.emplace(std::pair{slot->group, slot->index}, true).second) continue;
    const auto& grad = group(slot->group).shard_params[slot->index].grad();
    if (grad.defined() && grad.numel() > 0) {
      (sliced.contains(p) ? sliced_grads : grads).push_back(grad);
      (sliced.contains(p) ? sliced_from_disk : from_disk).push_back(false);
    }
    if (grad.defined()) continue;
    const auto where = gradient_on_disk(slot->group);
    if (!where) continue;
    const auto norm = norms_on_disk.of(*where->gradients, where->group, slot->index);
    if (!norm.defined()) continue;  // no elements here, or set to none
    (sliced.contains(p) ? sliced_disk_norms : disk_norms).push_back(norm);
    (sliced.contains(p) ? sliced_from_disk : from_disk).push_back(true);
    scaled_on_disk.emplace_back(*where, slot->index);
  }
  // One all-reduce for all the partial norms, [replicated, tp-sliced]; nothing is read back. On the device of the first
  // gradient in the parameters' order (a norm taken on disk is on its chunk's).
  const auto first_device = [](const std::vector<bool>& from_disk, const std::vector<at::Tensor>& in_memory,
                               const std::vector<at::Tensor>& on_disk) {
    return from_disk.front() ? on_disk.front().device() : in_memory.front().device();
  };
  const auto device = !from_disk.empty()          ? first_device(from_disk, grads, disk_norms)
                      : !sliced_from_disk.empty() ? first_device(sliced_from_disk, sliced_grads, sliced_disk_norms)
                                                  : at::Device(at::kCPU);
  auto totals = at::cat({parallel::partial_norm_interleaved(grads, disk_norms, from_disk, norm_type, device),
                          parallel::partial_norm_interleaved(sliced_grads, sliced_disk_norms, sliced_from_disk, norm_type,
                                                             device)});
  const auto op = std::isinf(norm_type) ? ReduceOp::MAX : ReduceOp::SUM;
  comm_.all_reduce(totals, op);
  if (sliced.group) {
    auto part = totals.narrow(0, 1, 1).contiguous();
    Communicator tp_group = *sliced.group;
    tp_group.all_reduce(part, op);
    totals.narrow(0, 1, 1).copy_(part);
  }
  at::Tensor coefficient;
  auto norm = parallel::scale_to_norm(totals, {&grads, &sliced_grads}, max_norm, norm_type, &coefficient);
  if (coefficient.defined() && !scaled_on_disk.empty()) {
    const auto on_host = coefficient.to(at::kCPU, at::kFloat);  // as scale_to_norm gives host gradients
    for (const auto& [where, index] : scaled_on_disk)
      where.gradients->queue(where.group, index, [on_host](at::Tensor& g) { g.mul_(on_host); });
  }
  return GradNorm(norm);
}

std::optional<ShardedModel::OnDisk> ShardedModel::gradient_on_disk(size_t g) {
  if (!options_.optimizer_on_disk.gradients) return std::nullopt;
  for (auto& [optimizer, swap] : swaps_) {
    auto* gradients = swap->gradients();
    const auto k = gradients ? swap->group_of(&group(g)) : std::nullopt;
    if (k && gradients->on_disk(*k)) return OnDisk{gradients, *k};
  }
  return std::nullopt;
}

bool ShardedModel::gradient_to_disk(size_t g, const at::Tensor& reduced) {
  if (!options_.optimizer_on_disk.gradients) return false;
  auto& flat = group(g);
  for (auto& [optimizer, swap] : swaps_)
    if (swap->gradients() && swap->group_of(&flat) && !swap->orphaned())
      return swap->write_gradient(&flat, reduced.to(flat.master.device(), flat.master.scalar_type()));
  return false;
}

bool ShardedModel::queue_on_disk_gradients(const std::vector<at::Tensor>& parameters,
                                           const std::function<void(at::Tensor&)>& op) {
  if (!options_.optimizer_on_disk.gradients) return false;  // every zero_grad asks: no work without the feature
  bool any = false;
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    const auto where = slot ? gradient_on_disk(slot->group) : std::nullopt;
    if (!where) continue;
    where->gradients->queue(where->group, slot->index, op);
    any = true;
  }
  return any;
}

bool ShardedModel::non_finite_gradients_on_disk(const std::vector<at::Tensor>& parameters) {
  NormsOnDisk largest(std::numeric_limits<double>::infinity());  // max |g|: inf or NaN exactly when some element is
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    const auto where = slot ? gradient_on_disk(slot->group) : std::nullopt;
    if (!where) continue;
    const auto norm = largest.of(*where->gradients, where->group, slot->index);
    if (norm.defined() && !std::isfinite(norm.item<double>())) return true;
  }
  return false;
}

std::vector<at::Tensor> ShardedModel::gradient_holders(const std::vector<at::Tensor>& parameters) const {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    out.push_back(slot ? group(slot->group).shard_params[slot->index] : p);
  }
  return out;
}

nlohmann::json ShardedModel::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json listed = nlohmann::json::array();
  int64_t shard_elements = 0, elements = 0, internal = 0;
  int64_t offloaded_masters = 0, offloaded_shards = 0, host_bytes = 0;
  bool pinned = false;
  for (const auto& unit : units_)
    for (const auto& g : unit->groups()) {
      listed.push_back({{"name", g.label},
                        {"frozen", g.frozen},
                        {"parameters", g.numel},
                        {"bytes", g.full_bytes()},
                        {"sharded_between_steps", unit->managed()},
                        {"master_in_host_memory", g.host.master},
                        {"shard_in_host_memory", g.host.shard},
                        {"shard_on_disk", g.disk && g.shard_on_disk}});
      // Offload: the master shards and the parameter shards kept in host memory (the optimizer's state
      // and the gradients handed to it are there too, counted by whoever reads the optimizer).
      offloaded_masters += g.host.master;
      offloaded_shards += g.host.shard;
      // A shard on disk (and the master that is it) holds no host memory.
      const bool master_on_disk = g.shard_on_disk && !g.mixed();
      if (g.host.master && !master_on_disk) host_bytes += static_cast<int64_t>(g.master.nbytes());
      if (g.host.shard && g.mixed() && !g.shard_on_disk) host_bytes += static_cast<int64_t>(g.shard.nbytes());
      pinned = pinned || (g.host.master && g.master.is_pinned());
      shard_elements += g.shard_numel;
      elements += g.numel;
      // Held by the sharded model and reachable from neither the parameters nor the optimizer: the low-precision
      // copy of a stage-3 shard, and stage 1's whole low-precision gradient buffer under mixed precision.
      if (g.mixed() && g.owns_shard) internal += static_cast<int64_t>(g.shard.nbytes());
      if (g.mixed() && !policy_.shards_gradients && g.grad_full.defined())
        internal += static_cast<int64_t>(g.grad_full.nbytes());
    }
  const auto& c = context_;
  std::vector<nlohmann::json> swap_stats;  // each live optimizer's
  for (const auto& [optimizer, swap] : swaps_) swap_stats.push_back(swap->stats());
  return {{"stage", policy_.stage},
          {"ranks", comm_.size()},
          {"replicas", replicate_.valid() ? replicate_.size() : 1},
          {"groups", listed},
          {"parameters", elements},
          {"shard_elements", shard_elements},
          {"internal_state_bytes", internal},
          {"offloaded_optimizer_groups", offloaded_masters},
          {"offloaded_parameter_groups", offloaded_shards},
          {"offload_host_bytes", host_bytes},
          {"offload_pinned", pinned},
          {"gathers", c.gathers},
          {"prefetches", c.forward_prefetches + c.backward_prefetches},
          {"forward_prefetches", c.forward_prefetches},
          {"backward_prefetches", c.backward_prefetches},
          {"frozen_released_in_backward", c.frozen_released_in_backward},
          {"values_from_rank0", policy_.shards_parameters && options_.values_from_rank0},
          {"groups_computed_when_made", groups_made_from_recording_ - groups_received_from_rank0_},
          {"groups_received_when_made", groups_received_from_rank0_},
          {"releases", c.releases},
          {"launches", launches_},
          {"overlapped_launches", overlapped_},
          {"gathered_bytes", c.gathered_bytes},
          {"peak_gathered_bytes", c.peak_gathered_bytes},
          {"step_peak_gathered_bytes", c.step_peak_gathered_bytes},
          {"heap_trim_seconds", heap_trim_seconds_},
          {"optimizer_on_disk", swaps_.empty() ? nlohmann::json(nullptr) : OptimizerSwap::combined(swap_stats)},
          {"parameters_on_disk", shard_store_ ? shard_store_->stats() : nlohmann::json(nullptr)}};
}

}  // namespace xlr8::shard
