// The optimizer's state on disk between steps, stepped group by group (optimizer_swap.hpp).
#include "parallel/shard/optimizer_swap.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <unordered_set>

#include "checkpoint/optimizer_state.hpp"
#include "os/swap_directory.hpp"
#include "parallel/shard/flat_group.hpp"
#include "parallel/shard/gradients_on_disk.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {

namespace {

std::vector<int64_t> dense_strides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i > 1; --i) strides[i - 2] = strides[i - 1] * std::max<int64_t>(sizes[i - 1], 1);
  return strides;
}

// Each group's parameter lists put back however the step ends.
struct RestoreParameterLists {
  torch::optim::Optimizer& optimizer;
  const std::vector<std::vector<at::Tensor>>& lists;
  ~RestoreParameterLists() {
    for (size_t j = 0; j < lists.size(); ++j) optimizer.param_groups()[j].params() = lists[j];
  }
};

}  // namespace

OptimizerSwap::OptimizerSwap(const ZeroOptions::Disk& disk, const torch::optim::Optimizer& optimizer,
                             const std::vector<FlatGroup*>& groups)
    : disk_(disk) {
  if (!checkpoints::portable_optimizer_kind(optimizer))
    throw ConfigError("offload_optimizer device nvme: the disk tier swaps the optimizer's state by name, which it knows "
                      "for LibTorch's Adam, AdamW, SGD, RMSprop and Adagrad (and xlr8's fused Adam and AdamW); use one "
                      "of them, or offload to cpu");
  names_ = checkpoints::kept_state_names(optimizer);
  std::vector<TensorSwapper::Slot> slots;
  for (auto* flat : groups) {
    shards_on_disk_ = shards_on_disk_ || flat->disk != nullptr;
    Group g{.flat = flat, .members = {}, .numel = flat->shard_numel, .dtype = flat->master.scalar_type()};
    for (size_t i = 0; i < flat->shard_params.size(); ++i)
      if (const auto part = flat->owned_part(i); part.count > 0)
        g.members.push_back({flat->shard_params[i], part.in_shard, i});
    if (g.members.empty()) continue;
    if (!flat->master.device().is_cpu())
      throw ConfigError(fmt::format("offload_optimizer nvme: group {}'s optimizer state would live on {}; the disk tier "
                                    "swaps it through host memory: offload the optimizer to the host too (ratio 1)",
                                    flat->label, flat->master.device().str()));
    for (const auto& name : names_)
      slots.push_back({slot(groups_.size(), name), g.dtype, {g.numel}});
    if (disk_.gradients) slots.push_back({GradientsOnDisk::slot(groups_.size()), g.dtype, {g.numel}});
    groups_.push_back(std::move(g));
  }
  if (slots.empty()) return;  // no state kept (SGD without momentum) nor gradients, or nothing of it on this rank
  os::SwapDirectoryClaim claim(disk_.path);
  stale_removed_ = claim.removed().size();
  // A group's state (and gradient) lent out while it steps, and as much again for its write (and the next group's
  // read ahead): fewer buffers would leave a swap nothing to move through.
  const int per_group = static_cast<int>(names_.size()) + (disk_.gradients ? 1 : 0);
  SwapOptions options{.file = claim.new_file("optimizer"),
                      .buffer_size = 0,  // the largest group's
                      .buffer_count = std::max(disk_.buffer_count, per_group * (disk_.read_ahead ? 3 : 2)),
                      .aio = {.block_size = disk_.aio_block_size, .intra_op_parallelism = disk_.aio_threads}};
  swapper_ = std::make_unique<TensorSwapper>(std::move(options), slots);
  if (!disk_.gradients) return;
  std::vector<std::vector<GradientsOnDisk::Part>> parts;
  for (const auto& g : groups_) {
    auto& each = parts.emplace_back();
    for (const auto& m : g.members) each.push_back({.index = m.index, .offset = m.offset, .count = m.leaf.numel()});
  }
  gradients_ = std::make_unique<GradientsOnDisk>(*swapper_, std::move(parts));
}

OptimizerSwap::~OptimizerSwap() = default;

bool OptimizerSwap::serves(const torch::optim::Optimizer& optimizer) const {
  if (!checkpoints::portable_optimizer_kind(optimizer) || checkpoints::kept_state_names(optimizer) != names_) return false;
  if (emptied_.empty()) return true;
  for (const auto& g : groups_)
    for (const auto& m : g.members)
      if (const auto state = checkpoints::read_parameter_state(optimizer, m.leaf))
        for (const auto& [name, t] : state->tensors)
          if (emptied_.count(t.unsafeGetTensorImpl())) return true;
  return false;
}

bool OptimizerSwap::orphaned() const {
  return !emptied_.empty() &&
         std::all_of(emptied_.begin(), emptied_.end(), [](const auto& e) { return e.second.use_count() == 1; });
}

std::string OptimizerSwap::slot(size_t group, const std::string& name) const { return fmt::format("{}/{}", group, name); }

void OptimizerSwap::step(torch::optim::Optimizer& optimizer) {
  if (!swapper_ && !shards_on_disk_) {
    optimizer.step();
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<at::Tensor>> lists;
  for (const auto& g : optimizer.param_groups()) lists.push_back(g.params());
  RestoreParameterLists restore{optimizer, lists};
  std::unordered_set<const c10::TensorImpl*> stepped;
  for (size_t k = 0; k < groups_.size(); ++k) {
    if (swapper_ && disk_.read_ahead && k + 1 < groups_.size()) {
      if (groups_[k + 1].on_disk)
        for (const auto& name : names_) swapper_->prefetch(slot(k + 1, name));
      if (gradients_) gradients_->prefetch(k + 1);
    }
    auto lent = swap_in(k, optimizer);
    const auto gradient = lend_gradient(k);
    auto* flat = groups_[k].flat;
    if (!flat->mixed()) flat->load_shard();  // the leaves view the shard (parameters on disk)
    // The next group's shard read while this one steps (a mixed group's follows its master: nothing to read).
    if (k + 1 < groups_.size() && !groups_[k + 1].flat->mixed()) groups_[k + 1].flat->read_ahead();
    std::vector<const c10::TensorImpl*> leaves;
    for (const auto& m : groups_[k].members) leaves.push_back(m.leaf.unsafeGetTensorImpl());
    stepped.insert(leaves.begin(), leaves.end());
    try {
      step_only(optimizer, lists, leaves);
    } catch (...) {
      for (auto& m : groups_[k].members) m.leaf.mutable_grad() = at::Tensor();  // its buffer back; it stays on disk
      throw;
    }
    if (gradient.defined()) return_gradient(k);
    flat->store_shard();  // the stepped values to disk (a no-op for parameters in memory)
    swap_out(k, optimizer, std::move(lent));
  }
  std::vector<const c10::TensorImpl*> rest;  // the optimizer's other parameters (another model's, a frozen whole one)
  for (const auto& list : lists)
    for (const auto& p : list)
      if (!stepped.count(p.unsafeGetTensorImpl())) rest.push_back(p.unsafeGetTensorImpl());
  if (!rest.empty()) step_only(optimizer, lists, rest);
  steps_ += 1;
  step_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void OptimizerSwap::step_only(torch::optim::Optimizer& optimizer, const std::vector<std::vector<at::Tensor>>& all,
                              const std::vector<const c10::TensorImpl*>& leaves) {
  const std::unordered_set<const c10::TensorImpl*> wanted(leaves.begin(), leaves.end());
  auto& groups = optimizer.param_groups();
  for (size_t j = 0; j < all.size(); ++j) {
    std::vector<at::Tensor> kept;
    for (const auto& p : all[j])
      if (wanted.count(p.unsafeGetTensorImpl())) kept.push_back(p);
    groups[j].params() = std::move(kept);
  }
  optimizer.step();
}

at::Tensor OptimizerSwap::lend_gradient(size_t k) {
  if (!gradients_ || !gradients_->on_disk(k)) return {};
  std::vector<bool> has;
  auto chunk = gradients_->read(k, has);
  const auto& parts = gradients_->parts(k);
  for (size_t j = 0; j < parts.size(); ++j) {
    auto& leaf = groups_[k].members[j].leaf;
    leaf.mutable_grad() = has[j] ? chunk.narrow(0, parts[j].offset, parts[j].count) : at::Tensor();
  }
  return chunk;
}

void OptimizerSwap::return_gradient(size_t k) {
  // The buffer goes back to the pool with the last view: the step used the gradients, as zero_grad would drop them.
  for (auto& m : groups_[k].members) m.leaf.mutable_grad() = at::Tensor();
  gradients_->consumed(k);
}

bool OptimizerSwap::write_gradient(const FlatGroup* flat, const at::Tensor& chunk) {
  const auto k = gradients_ ? group_of(flat) : std::nullopt;
  if (!k) return false;
  gradients_->write(*k, chunk);
  for (auto& m : groups_[*k].members) m.leaf.mutable_grad() = at::Tensor();  // a last step's, not zeroed
  return true;
}

std::map<std::string, at::Tensor> OptimizerSwap::swap_in(size_t k, torch::optim::Optimizer& optimizer) {
  auto& g = groups_[k];
  std::map<std::string, at::Tensor> lent;
  if (!swapper_ || !g.on_disk) return lent;
  for (const auto& name : names_) lent[name] = swapper_->swap_in(slot(k, name));
  at::NoGradGuard no_grad;
  for (const auto& m : g.members) {
    auto state = checkpoints::read_parameter_state(optimizer, m.leaf);
    if (!state) continue;
    for (auto& [name, t] : state->tensors) {
      const auto it = emptied_.find(t.unsafeGetTensorImpl());
      if (it == emptied_.end() || !lent.count(name)) continue;
      t.set_(lent[name].storage(), m.offset, m.leaf.sizes(), dense_strides(m.leaf.sizes()));
      emptied_.erase(it);
    }
  }
  g.on_disk = false;
  return lent;
}

void OptimizerSwap::swap_out(size_t k, torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> lent) {
  if (!swapper_) return;
  auto& g = groups_[k];
  std::vector<std::optional<checkpoints::ParameterState>> states;
  for (const auto& m : g.members) states.push_back(checkpoints::read_parameter_state(optimizer, m.leaf));
  std::vector<at::Tensor> written;
  at::NoGradGuard no_grad;
  for (const auto& name : names_) {
    at::Tensor staging = lent.count(name) ? lent[name] : at::Tensor();
    bool any = false;
    for (size_t i = 0; i < g.members.size(); ++i) {
      if (!states[i]) continue;  // no step reached this leaf yet
      const auto it = states[i]->tensors.find(name);
      if (it == states[i]->tensors.end()) continue;
      const auto& t = it->second;
      const auto& leaf = g.members[i].leaf;
      if (t.scalar_type() != g.dtype || t.numel() != leaf.numel() || !t.device().is_cpu())
        throw Error(fmt::format("offload to disk: the optimizer's {} of a parameter in group {} is a {} tensor of {} "
                                "elements on {}; the swap file holds {} of {} on the CPU",
                                name, k, c10::toString(t.scalar_type()), t.numel(), t.device().str(),
                                c10::toString(g.dtype), leaf.numel()));
      if (!staging.defined()) staging = at::zeros({g.numel}, at::TensorOptions().dtype(g.dtype));
      auto into = staging.narrow(0, g.members[i].offset, t.numel());
      if (t.data_ptr() != into.data_ptr()) into.copy_(t.reshape({-1}));
      written.push_back(t);
      any = true;
    }
    if (any) swapper_->swap_out(slot(k, name), staging);
  }
  // Without write-behind the state leaves memory only once it is on disk: a failed write throws here, with the state
  // still in memory.
  if (!disk_.write_behind) swapper_->flush();
  for (auto& t : written) {
    t.set_();  // empty: its values are on disk, and the buffer it viewed goes back to the pool
    emptied_.emplace(t.unsafeGetTensorImpl(), t);
  }
  g.on_disk = !written.empty();
}

std::optional<size_t> OptimizerSwap::group_of(const FlatGroup* flat) const {
  for (size_t k = 0; k < groups_.size(); ++k)
    if (groups_[k].flat == flat) return k;
  return std::nullopt;
}

std::map<std::string, at::Tensor> OptimizerSwap::hold_group(size_t k, torch::optim::Optimizer& optimizer) {
  auto lent = swap_in(k, optimizer);
  groups_held_most_ = std::max(groups_held_most_, ++groups_held_);
  groups_read_for_checkpoints_ += !lent.empty();
  return lent;
}

void OptimizerSwap::release_group(size_t k, torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> lent,
                                  bool write) {
  --groups_held_;
  if (write) return swap_out(k, optimizer, std::move(lent));
  if (lent.empty()) return;  // it was in memory before: it stays
  for (const auto& m : groups_[k].members)
    if (auto state = checkpoints::read_parameter_state(optimizer, m.leaf))
      for (auto& [name, t] : state->tensors)
        if (lent.count(name) && t.is_alias_of(lent[name])) {
          t.set_();  // its values are unchanged on disk
          emptied_.emplace(t.unsafeGetTensorImpl(), t);
        }
  groups_[k].on_disk = true;
}

void OptimizerSwap::bring_in(torch::optim::Optimizer& optimizer) {
  if (!swapper_) return;
  groups_held_most_ = std::max<int64_t>(groups_held_most_, static_cast<int64_t>(groups_.size()));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < groups_.size(); ++k) {
    auto lent = swap_in(k, optimizer);
    if (lent.empty()) continue;
    for (const auto& m : groups_[k].members)
      if (auto state = checkpoints::read_parameter_state(optimizer, m.leaf))
        for (auto& [name, t] : state->tensors)
          if (lent.count(name) && t.is_alias_of(lent[name])) t.set_(t.clone());
  }
}

void OptimizerSwap::put_away(torch::optim::Optimizer& optimizer) {
  if (!swapper_) return;
  for (size_t k = 0; k < groups_.size(); ++k)
    if (!groups_[k].on_disk) swap_out(k, optimizer, {});
  swapper_->flush();
}

nlohmann::json OptimizerSwap::stats() const {
  if (!swapper_) return {{"optimizer_state_on_disk", false}};
  const double moved = static_cast<double>(swapper_->bytes_read() + swapper_->bytes_written());
  auto out = swapper_->stats();
  if (gradients_) out.update(gradients_->stats());
  out.update({{"optimizer_state_on_disk", true},
              {"swapped_steps", steps_},
              {"swapped_step_seconds", step_seconds_},
              {"swapped_step_gb_per_s", step_seconds_ > 0 ? moved / step_seconds_ / 1e9 : 0.0},
              {"swapped_groups", groups_.size()},
              {"checkpoint_groups_in_memory_most", groups_held_most_},
              {"checkpoint_group_reads", groups_read_for_checkpoints_},
              {"stale_swap_files_removed", stale_removed_}});
  return out;
}

nlohmann::json OptimizerSwap::combined(const std::vector<nlohmann::json>& each) {
  nlohmann::json out = each.empty() ? nlohmann::json::object() : each.front();
  out["swap_files"] = nlohmann::json::array();
  for (size_t i = 0; i < each.size(); ++i) {
    if (each[i].contains("swap_file")) out["swap_files"].push_back(each[i]["swap_file"]);
    for (const auto& [key, value] : each[i].items()) {
      if (i == 0 || !value.is_number()) continue;
      if (key.ends_with("_most")) out[key] = std::max(out.value(key, int64_t{0}), value.get<int64_t>());
      else if (value.is_number_integer()) out[key] = out.value(key, int64_t{0}) + value.get<int64_t>();
      else out[key] = out.value(key, 0.0) + value.get<double>();
    }
    if (i > 0 && each[i].value("optimizer_state_on_disk", false)) out["optimizer_state_on_disk"] = true;
  }
  const double seconds = out.value("swapped_step_seconds", 0.0);
  const double moved = static_cast<double>(out.value("swap_bytes_read", int64_t{0}) + out.value("swap_bytes_written", int64_t{0}));
  if (out.contains("swapped_step_gb_per_s")) out["swapped_step_gb_per_s"] = seconds > 0 ? moved / seconds / 1e9 : 0.0;
  out["optimizers"] = each.size();
  return out;
}

}  // namespace xlr8::shard
