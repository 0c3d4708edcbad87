// ShardedModel's state for checkpoints: whole and sharded state dicts, the pieces each rank holds, the
// streamed visit of the whole model, catching whole copies up after a load, and the shards' swap file.
#include <fmt/format.h>

#include <exception>
#include <map>

#include "parallel/state_dict_check.hpp"
#include "parallel/shard/sharded_model.hpp"
#include "parallel/shard/shard_store.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::shard {

StateDict ShardedModel::state_dict(StateDictKind kind) {
  StateDict out;
  if (kind == StateDictKind::SHARDED) {
    all_shards_in_memory(true);  // the leaves returned view the shards
    for (const auto& item : module_->named_parameters()) {
      const auto* slot = slot_of(item.value());
      out.emplace_back(item.key(), slot ? group(slot->group).shard_params[slot->index].detach() : item.value());
    }
    for (const auto& item : module_->named_buffers()) out.emplace_back(item.key(), item.value());
    return out;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_prefetches();
  }
  // FULL: stages 1-2 hold whole parameters; stage 3 gathers one group at a time and copies it out.
  // FULL_ON_MAIN: only the group's first rank (the first replica's, under hybrid sharding) copies.
  if (kind == StateDictKind::FULL_ON_MAIN && (comm_.rank() != 0 || (replicate_.valid() && replicate_.rank() != 0))) {
    for (auto& unit : units_)  // the collectives still need every rank
      for (size_t k = 0; k < unit->groups().size(); ++k) {
        auto& flat = unit->groups()[k];
        if (flat.mixed()) flat.gather_master(comm_);
        else if (policy_.shards_parameters && !flat.gathered()) {
          std::lock_guard<std::mutex> lock(mutex_);
          unit->gather(k);
          unit->release(k);
        }
      }
    return full_state_layout(StateDictKind::FULL);
  }
  std::map<const c10::TensorImpl*, at::Tensor> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& unit : units_)
      for (size_t k = 0; k < unit->groups().size(); ++k) {
        auto& flat = unit->groups()[k];
        if (flat.mixed()) {  // the fp32 master values, not their low-precision copies
          auto whole = flat.gather_master(comm_);
          for (size_t i = 0; i < flat.params.size(); ++i)
            copies[flat.params[i].unsafeGetTensorImpl()] =
                whole.narrow(0, flat.offsets[i], flat.params[i].numel()).view(flat.params[i].sizes()).clone();
          continue;
        }
        if (!policy_.shards_parameters) continue;
        const bool was = flat.gathered();
        unit->gather(k);
        for (const auto& p : flat.params) copies[p.unsafeGetTensorImpl()] = p.detach().clone();
        if (!was) unit->release(k);  // only a guarded group is ever freed: it goes back to freed
      }
  }
  for (const auto& item : module_->named_parameters()) {
    auto it = copies.find(item.value().unsafeGetTensorImpl());
    out.emplace_back(item.key(), it != copies.end() ? it->second : item.value());
  }
  for (const auto& item : module_->named_buffers()) out.emplace_back(item.key(), item.value());
  return out;
}

void ShardedModel::load_state_dict(const StateDict& state, StateDictKind kind) {
  parallel::check_state_dict(full_state_layout(kind), state);
  std::map<std::string, at::Tensor> own;
  for (const auto& item : module_->named_parameters()) own[item.key()] = item.value();
  for (const auto& item : module_->named_buffers()) own[item.key()] = item.value();
  std::lock_guard<std::mutex> lock(mutex_);
  drop_prefetches();
  all_shards_in_memory(true);  // written below; the refresh at the end stores them again
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : state) {
    const auto& target = own.at(name);
    const auto* slot = slot_of(target);
    if (!slot) {
      target.detach().copy_(tensor);
      continue;
    }
    auto& flat = group(slot->group);
    if (kind == StateDictKind::SHARDED) {
      flat.shard_params[slot->index].detach().copy_(tensor);
    } else {
      auto part = flat.owned_part(slot->index);
      flat.master.narrow(0, part.in_shard, part.count).copy_(tensor.reshape(-1).narrow(0, part.in_param, part.count));
    }
  }
  // Whole copies that are alive (stages 1-2 always; stage 3 groups held whole) follow their shards.
  refresh_whole_copies(/*frozen_too=*/true);
}

std::vector<ParameterPiece> ShardedModel::parameter_pieces(bool bring_in) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_prefetches();  // a mispredicted one would all-gather the shards while a load writes them
    if (bring_in) all_shards_in_memory(true);  // the pieces view them (parameter_pieces_loaded stores them again)
  }
  // Under hybrid sharding every replica holds the same shards: the first one writes them.
  const bool writer = !replicate_.valid() || replicate_.rank() == 0;
  auto placements = tp::parameter_placements(*module_);  // a tensor-parallel slice is what the chunks divide
  std::vector<ParameterPiece> out;
  for (const auto& item : module_->named_parameters()) {
    const auto& p = item.value();
    auto& placement = placements.at(item.key());
    const auto* slot = slot_of(p);
    if (!slot) {  // not sharded (frozen): whole everywhere
      out.push_back({item.key(), std::move(placement), p, comm_.rank() == 0 && writer});
      continue;
    }
    const auto& flat = group(slot->group);
    const auto& leaf = flat.shard_params[slot->index];
    out.push_back({item.key(), placement.chunk(flat.owned_part(slot->index).in_param, leaf.numel()), leaf, writer});
  }
  return out;
}

void ShardedModel::visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_prefetches();
  const bool receiver = comm_.rank() == 0 && (!replicate_.valid() || replicate_.rank() == 0);
  // A group is gathered when its first parameter comes up (in the master dtype) and dropped after its
  // last: units are subtrees, so only the root's group stays open across others.
  std::vector<size_t> left(groups_.size(), 0);
  for (const auto& item : module_->named_parameters())
    if (const auto* slot = slot_of(item.value())) ++left[slot->group];
  std::vector<at::Tensor> whole(groups_.size());
  size_t index = 0;
  for (const auto& item : module_->named_parameters()) {
    const auto* slot = slot_of(item.value());
    if (!slot) {
      if (receiver) fn(index, item.value().detach());
      ++index;
      continue;
    }
    auto& flat = group(slot->group);
    if (!whole[slot->group].defined()) whole[slot->group] = flat.gather_master(comm_);
    if (receiver)
      fn(index, whole[slot->group].narrow(0, flat.offsets[slot->index], flat.params[slot->index].numel())
                    .view(flat.params[slot->index].sizes()));
    ++index;
    if (--left[slot->group] == 0) whole[slot->group] = at::Tensor();
  }
  for (const auto& item : module_->named_buffers()) {
    if (receiver) fn(index, item.value().detach());
    ++index;
  }
}

void ShardedModel::parameter_pieces_loaded(bool whole_parameters_written) {
  std::lock_guard<std::mutex> lock(mutex_);
  drop_prefetches();
  at::NoGradGuard no_grad;
  std::exception_ptr failed;  // a group's I/O error (parameters on disk), thrown once every group's collective ran
  for (auto* flat : groups_) {
    try {
      if (whole_parameters_written) {
        if (flat->disk) flat->store_shard();  // copies the master when it is another tensor
        else if (flat->mixed()) flat->shard.copy_(flat->master);
        continue;
      }
      // One group at a time (unlike after a step, where they overlap): the transient stays one group's.
      flat->refresh_async(comm_).wait();
    } catch (const std::exception&) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

StateDict ShardedModel::full_state_layout(StateDictKind kind) const {
  // Names, dtypes and shapes only: stage 3's freed parameters keep their shapes.
  StateDict out;
  for (const auto& item : module_->named_parameters()) {
    const auto* slot = slot_of(item.value());
    const at::Tensor& t = kind == StateDictKind::SHARDED && slot ? group(slot->group).shard_params[slot->index]
                                                                  : item.value();
    auto options = t.options().device(at::kMeta);
    if (slot) options = options.dtype(group(slot->group).master.scalar_type());  // fp32 under mixed precision
    out.emplace_back(item.key(), at::empty(t.sizes(), options));
  }
  for (const auto& item : module_->named_buffers())
    out.emplace_back(item.key(), at::empty(item.value().sizes(), item.value().options().device(at::kMeta)));
  return out;
}

std::shared_ptr<ShardStore> ShardedModel::make_shard_store(const std::vector<UnitPlan>& plans) const {
  if (!options_.params_on_disk.enabled()) return nullptr;
  if (!policy_.shards_parameters || !options_.optimizer_on_disk.enabled())
    throw ConfigError(fmt::format("parameters on disk (offload_param nvme) need ZeRO stage 3 (stage is {}) with the "
                                  "optimizer's state on disk too (offload_optimizer nvme)",
                                  policy_.stage));
  // One slot a group, in the order the groups are made (make_flat_group's shard size and dtype).
  std::vector<ShardStore::Shard> shards;
  const int64_t ranks = comm_.size();
  for (const auto& plan : plans)
    for (const auto& g : plan.groups) {
      int64_t numel = 0;
      for (const auto& p : g.params) numel += p.numel();
      shards.push_back({std::to_string(shards.size()), options_.param_dtype.value_or(g.params.front().scalar_type()),
                        (numel + ranks - 1) / ranks});
    }
  return std::make_shared<ShardStore>(options_.params_on_disk, shards);
}

void ShardedModel::all_shards_in_memory(bool in_memory) {
  if (!shard_store_) return;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto* flat = groups_[g];
    if (in_memory) {
      flat->load_shard();
    } else if (!flat->shard_on_disk) {  // on disk already: its values are there (a mixed group's store would copy)
      const auto held = held_.find({g, nullptr});
      if (held == held_.end() || held->second.expired()) flat->store_shard();  // a holder's stays until released
    }
  }
}

}  // namespace xlr8::shard
