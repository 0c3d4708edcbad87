#include "parallel/zero_engine.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>

#include "os/memory.hpp"
#include "parallel/replica_sync.hpp"
#include "parallel/sharded_unit.hpp"
#include "parallel/wrap_policy.hpp"
#include "xlr8/error.hpp"

namespace xlr8::detail {
namespace {

// A post-hook on a parameter's AccumulateGrad node: `.grad` holds this backward's sum.
struct GradientReadyHook : torch::autograd::FunctionPostHook {
  GradientReadyHook(std::weak_ptr<ZeroEngine> engine, size_t group, size_t index)
      : engine_(std::move(engine)), group_(group), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto engine = engine_.lock()) engine->gradient_ready(group_, index_);
    return outputs;
  }
  std::weak_ptr<ZeroEngine> engine_;
  size_t group_, index_;
};

class UnitHandle final : public ShardedUnit {
 public:
  UnitHandle(std::weak_ptr<ZeroEngine> engine, size_t unit) : engine_(std::move(engine)), unit_(unit) {}
  void before_forward() override {
    if (auto e = engine_.lock()) e->unit_forward_begins(unit_);
  }
  at::Tensor after_forward(const at::Tensor& output) override {
    auto e = engine_.lock();
    return e ? e->unit_forward_ends(unit_, output) : output;
  }
  void forward_abandoned() override {
    if (auto e = engine_.lock()) e->unit_forward_abandoned(unit_);
  }

 private:
  std::weak_ptr<ZeroEngine> engine_;
  size_t unit_;
};

}  // namespace

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> module, Communicator comm, Communicator replicate, int stage,
                       ZeroOptions options, bool find_unused_parameters,
                       std::shared_ptr<const GradientState> gradient_state)
    : module_(std::move(module)),
      comm_(std::move(comm)),
      replicate_(std::move(replicate)),
      stage_(stage),
      options_(std::move(options)),
      find_unused_(find_unused_parameters),
      gradient_state_(std::move(gradient_state)) {
  if (stage_ < 1 || stage_ > 3) throw Error(fmt::format("ZeRO stage {} does not exist; use 1, 2 or 3", stage_));
  const auto& prefetch = options_.backward_prefetch;
  if (!prefetch.empty() && prefetch != "NO_PREFETCH" && prefetch != "BACKWARD_PRE" && prefetch != "BACKWARD_POST")
    throw ConfigError(fmt::format("ZeroOptions::backward_prefetch {:?} is not a prefetch mode; use BACKWARD_PRE, "
                                  "BACKWARD_POST, NO_PREFETCH or empty",
                                  prefetch));
  // fsdp_sync_module_states: every rank starts from rank 0's weights (and the same model is checked).
  // Built for rank-0 loading, the other ranks hold no values: each unit's come from rank 0 below, one
  // unit at a time, so no rank ever holds the whole model.
  for (const auto& item : module_->named_parameters())
    if (!item.value().requires_grad()) frozen_at_prepare_.emplace_back(item.key(), item.value());
  const bool from_rank0 = stage_ == 3 && options_.values_from_rank0;
  make_replicas_equal(comm_, *module_, /*parameters=*/!from_rank0);
  auto plans = stage_ == 3 ? plan_units(*module_, options_) : plan_buckets(*module_, options_);
  for (auto& plan : plans) {
    const bool root = plan.unit == module_.get();
    groups_.push_back(make_flat_group(plan.label, plan.unit, std::move(plan.names), std::move(plan.params), comm_,
                                      /*owns_shard=*/stage_ == 3, options_.param_dtype, from_rank0));
    const size_t g = groups_.size() - 1;
    // Units start freed (their guards gather them); the root stays whole until its guard runs, as
    // without rank-0 loading.
    managed_.push_back(from_rank0 && !root);
    if (managed_.back()) groups_[g].release();
    if (stage_ == 3) {
      if (units_.empty() || units_.back().module != plan.unit) units_.push_back({plan.unit, {}});
      units_.back().groups.push_back(g);
      unit_of_group_.push_back(units_.size() - 1);
    }
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      user_slots_[groups_[g].params[i].unsafeGetTensorImpl()] = {g, i};
      shard_slots_[groups_[g].shard_params[i].unsafeGetTensorImpl()] = {g, i};
    }
    if (stage_ == 3 && groups_[g].gathered()) gathered_bytes_ += groups_[g].full_bytes();
    return_free_memory_to_system();  // the group's original parameter storage, now replaced
  }
  // Gradients become ready in reverse: buckets are already in that order; units (root last) reverse.
  for (size_t g = 0; g < groups_.size(); ++g)
    if (!groups_[g].frozen) launch_order_.push_back(g);
  if (stage_ == 3) {
    std::reverse(launch_order_.begin(), launch_order_.end());
    // The root's group (its embeddings finish last) goes last.
    auto root = std::find_if(launch_order_.begin(), launch_order_.end(),
                             [&](size_t g) { return groups_[g].unit == module_.get(); });
    if (root != launch_order_.end()) std::rotate(root, root + 1, launch_order_.end());
  }
  forward_start_.assign(units_.size(), 0);
  guarded_.assign(units_.size(), false);
  in_forward_.assign(units_.size(), false);
  grad_shards_.resize(groups_.size());
  works_.resize(groups_.size());
  peak_gathered_bytes_ = step_peak_gathered_bytes_ = gathered_bytes_;
  reset_backward_state();
}

void ZeroEngine::attach() {
  std::weak_ptr<ZeroEngine> self = shared_from_this();
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].frozen) continue;
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      auto acc = compat::grad_accumulator(groups_[g].params[i]);
      acc->add_post_hook(std::make_unique<GradientReadyHook>(self, g, i));
      accumulators_.push_back(acc);
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    auto handle = std::make_shared<UnitHandle>(self, u);
    register_unit(*units_[u].module, handle);
    unit_handles_.push_back(handle);
  }
}

bool ZeroEngine::has_frozen(size_t u) const {
  for (size_t g : units_[u].groups)
    if (groups_[g].frozen) return true;
  return false;
}

ZeroEngine::~ZeroEngine() {
  std::lock_guard<std::mutex> lock(mutex_);
  detached_ = true;
  try {
    settle_prefetches();  // the communicator must not write into memory freed after this
  } catch (const std::exception&) {
  }
  for (const auto& unit : units_) unregister_unit(*unit.module);
}

// ------------------------------------------------------------------------------------------ gradients

void ZeroEngine::begin_step(bool suspend_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = !suspend_sync && (!gradient_state_ || gradient_state_->sync_gradients);
  step_peak_gathered_bytes_ = gathered_bytes_;
}

void ZeroEngine::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = true;
}

void ZeroEngine::arm_end_of_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  std::weak_ptr<ZeroEngine> weak = shared_from_this();
  const uint64_t generation = backward_generation_;
  // If a node throws, the pass ends without the callback: forget its state, so that the next backward
  // arms its own callback instead of finding this one armed (and never handing gradients over).
  compat::at_end_of_backward(
      [weak] {
        if (auto self = weak.lock()) self->finish_backward();
      },
      [weak, generation] {
        if (auto self = weak.lock()) self->backward_abandoned(generation);
      });
}

void ZeroEngine::backward_abandoned(uint64_t generation) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || detached_ || generation != backward_generation_ || !in_backward_) return;
  drop_backward_state();
}

void ZeroEngine::drop_backward_state() {
  in_flight_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    works_[g] = Work();  // in-flight collectives hold their own references to these buffers
    grad_shards_[g] = at::Tensor();
    if (stage_ > 1) groups_[g].grad_full = at::Tensor();
    if (stage_ == 3) {
      try {
        release(g);
      } catch (const std::exception&) {  // its prefetch failed too: the error already thrown is the one to report
      }
    }
  }
  reset_backward_state();
}

void ZeroEngine::gradient_ready(size_t g, size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return;
  arm_end_of_backward();
  if (ready_[g][i]) return;  // counted already (reentrant backward)
  ready_[g][i] = true;
  if (sync_) stash_gradient(g, i);
  if (--pending_[g] == 0) group_complete(g);
  if (sync_) launch_ready();
}

// The gradient moves into the group's flat buffer and leaves the parameter: a sharded rank keeps
// only its chunk after the reduction. Off the sync boundary it stays in .grad and accumulates there
// (as FSDP's no_sync: whole gradients for the window).
void ZeroEngine::stash_gradient(size_t g, size_t i) {
  auto& group = groups_[g];
  if (!group.grad_full.defined()) {
    auto options = group.full.options().dtype(options_.reduce_dtype.value_or(group.full.scalar_type()));
    group.grad_full = stage_ == 1 ? comm_.symmetric_empty({group.padded()}, options) : at::empty({group.padded()}, options);
    group.grad_full.zero_();
  }
  auto& grad = group.params[i].mutable_grad();
  auto view = group.grad_full.narrow(0, group.offsets[i], group.params[i].numel());
  if (grad.defined()) view.copy_(grad.reshape(-1));
  else view.zero_();
  grad = at::Tensor();
}

void ZeroEngine::group_complete(size_t g) {
  // Every gradient of the group is computed, so nothing in backward reads its parameters any more.
  if (stage_ != 3) return;
  release(g);
  if (options_.backward_prefetch == "BACKWARD_POST")
    prefetch_after(backward_order_, unit_of(g), /*in_backward=*/true);
}

void ZeroEngine::launch_ready() {
  while (next_launch_ < launch_order_.size() && pending_[launch_order_[next_launch_]] == 0)
    launch(launch_order_[next_launch_++]);
}

// Groups launch in one fixed order on every rank, so every rank issues the same collective sequence.
void ZeroEngine::launch(size_t g) {
  auto& group = groups_[g];
  group.grad_full.div_(comm_.size());
  if (stage_ == 1) {
    works_[g] = comm_.all_reduce_async(group.grad_full, ReduceOp::SUM);
  } else {
    grad_shards_[g] = at::empty({group.shard_numel}, group.grad_full.options());
    works_[g] = comm_.reduce_scatter_async(grad_shards_[g], group.grad_full, ReduceOp::SUM);
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
  while (stage_ > 1 && in_flight_.size() > 1) retire_oldest();
}

void ZeroEngine::retire_oldest() {
  const size_t g = in_flight_.front();
  in_flight_.pop_front();
  works_[g].wait();
  works_[g] = Work();
  if (stage_ > 1) groups_[g].grad_full = at::Tensor();
  // Hybrid: this chunk's holders in the other shard groups average it too (same order on every rank).
  if (replicate_.valid() && replicate_.size() > 1) {
    grad_shards_[g].div_(replicate_.size());
    replicate_.all_reduce(grad_shards_[g], ReduceOp::SUM);
  }
}

void ZeroEngine::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    reduce_and_hand_over();
  } catch (...) {
    // A collective timed out or failed (or parameters got no gradient): the next backward must not find
    // this one's half-counted state, and what it gathered or filled is dropped.
    drop_backward_state();
    throw;
  }
  if (stage_ == 3)
    for (size_t g = 0; g < groups_.size(); ++g) release(g);
  reset_backward_state();
}

void ZeroEngine::reduce_and_hand_over() {
  if (sync_) {
    std::vector<std::string> unused;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].params.size(); ++i)
        if (!ready_[g][i]) unused.push_back(groups_[g].names[i]);
    if (!unused.empty() && !find_unused_) throw unused_parameters_error(comm_.rank(), unused, "reduction");
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].params.size(); ++i)
        if (!ready_[g][i]) {
          ready_[g][i] = true;
          stash_gradient(g, i);
          if (--pending_[g] == 0) group_complete(g);
        }
    launch_ready();
    while (!in_flight_.empty()) retire_oldest();
    // The optimizer's leaves get their parts of the averaged chunks.
    for (size_t g = 0; g < groups_.size(); ++g) {
      auto& group = groups_[g];
      if (group.frozen) continue;
      at::Tensor chunk = stage_ == 1 ? group.grad_full.narrow(0, static_cast<int64_t>(group.rank) * group.shard_numel,
                                                              group.shard_numel)
                                     : grad_shards_[g];
      if (chunk.scalar_type() != group.master.scalar_type()) chunk = chunk.to(group.master.scalar_type());
      for (size_t i = 0; i < group.params.size(); ++i) {
        auto part = group.owned_part(i);
        group.shard_params[i].mutable_grad() = chunk.narrow(0, part.in_shard, part.count);
      }
      grad_shards_[g] = at::Tensor();  // owned by the leaves' gradients now: zero_grad(set_to_none) frees it
    }
  }
}

void ZeroEngine::reset_backward_state() {
  ready_.assign(groups_.size(), {});
  pending_.assign(groups_.size(), 0);
  for (size_t g = 0; g < groups_.size(); ++g) {
    // A frozen group has no gradient to wait for: ready from the start, never launched.
    ready_[g].assign(groups_[g].params.size(), groups_[g].frozen);
    pending_[g] = groups_[g].frozen ? 0 : groups_[g].params.size();
  }
  next_launch_ = 0;
  in_backward_ = false;
  ++backward_generation_;
  awaiting_backward_.assign(units_.size(), 0);
}

// ------------------------------------------------------------------------------------------ optimizer

std::vector<at::Tensor> ZeroEngine::optimizer_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& g : groups_) out.insert(out.end(), g.shard_params.begin(), g.shard_params.end());
  return out;
}

void ZeroEngine::bind_optimizer(torch::optim::Optimizer& optimizer) const {
  for (auto& param_group : optimizer.param_groups())
    for (auto& p : param_group.params()) {
      auto it = user_slots_.find(p.unsafeGetTensorImpl());
      if (it == user_slots_.end()) continue;
      if (optimizer.state().count(c10::guts::to_string(p.unsafeGetTensorImpl())))
        throw Error(fmt::format("prepare(): the optimizer already holds state for parameter {}; prepare the "
                                "optimizer before its first step so that it can work on this rank's shards",
                                groups_[it->second.group].names[it->second.index]));
      p = groups_[it->second.group].shard_params[it->second.index];
    }
}

void ZeroEngine::optimizer_step(torch::optim::Optimizer& optimizer) {
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
  optimizer.step();
  std::lock_guard<std::mutex> lock(mutex_);
  // Stages 1-2: every rank updated its chunk of the whole parameters; gather the others' in place.
  // Stage 3: the shards are the parameters; only groups held whole (no guard, or gathered now) refresh.
  refresh_whole_copies(/*frozen_too=*/false);
}

void ZeroEngine::refresh_whole_copies(bool frozen_too) {
  std::vector<Work> works;
  for (auto& group : groups_)
    if (frozen_too || !group.frozen) works.push_back(group.refresh_async(comm_));
  for (auto& w : works) w.wait();
}

const ZeroEngine::Slot* ZeroEngine::slot_of(const at::Tensor& tensor) const {
  auto it = user_slots_.find(tensor.unsafeGetTensorImpl());
  if (it != user_slots_.end()) return &it->second;
  it = shard_slots_.find(tensor.unsafeGetTensorImpl());
  return it == shard_slots_.end() ? nullptr : &it->second;
}

double ZeroEngine::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  // Each rank holds the averaged gradients of its own chunks: partial norms, reduced over the group.
  std::vector<at::Tensor> grads;
  std::map<std::pair<size_t, size_t>, bool> seen;
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    if (!slot && !p.requires_grad()) continue;  // frozen and whole (stages 1-2): no gradient to clip
    if (!slot)
      throw Error("clip_grad_norm(): a parameter is not one this sharded model trains (pass model->parameters())");
    if (!seen.emplace(std::pair{slot->group, slot->index}, true).second) continue;
    const auto& grad = groups_[slot->group].shard_params[slot->index].grad();
    if (grad.defined() && grad.numel() > 0) grads.push_back(grad);
  }
  const bool infinity = std::isinf(norm_type);
  // One read-back for all the partial norms, not one per gradient.
  auto total = at::zeros({1}, at::TensorOptions().dtype(at::kDouble));
  if (!grads.empty()) {
    std::vector<at::Tensor> norms;
    for (const auto& g : grads) norms.push_back(g.norm(norm_type).to(at::kDouble).reshape({1}));
    auto all = at::cat(norms);
    total = infinity ? all.max().reshape({1}) : all.pow(norm_type).sum().reshape({1});
  }
  comm_.all_reduce(total, infinity ? ReduceOp::MAX : ReduceOp::SUM);
  const double norm = infinity ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

// ------------------------------------------------------------------------------------------ state dicts

std::vector<at::Tensor> ZeroEngine::gradient_holders(const std::vector<at::Tensor>& parameters) const {
  std::vector<at::Tensor> out;
  for (const auto& p : parameters) {
    const auto* slot = slot_of(p);
    out.push_back(slot ? groups_[slot->group].shard_params[slot->index] : p);
  }
  return out;
}

nlohmann::json ZeroEngine::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json units = nlohmann::json::array();
  int64_t shard_elements = 0, elements = 0, internal = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    units.push_back({{"name", groups_[g].label},
                     {"frozen", groups_[g].frozen},
                     {"parameters", groups_[g].numel},
                     {"bytes", groups_[g].full_bytes()},
                     {"sharded_between_steps", stage_ == 3 && managed_[g]}});
    shard_elements += groups_[g].shard_numel;
    elements += groups_[g].numel;
    // Held by the engine and reachable from neither the parameters nor the optimizer: the low-precision
    // copy of a stage-3 shard, and stage 1's whole low-precision gradient buffer under mixed precision.
    if (groups_[g].mixed() && groups_[g].owns_shard) internal += static_cast<int64_t>(groups_[g].shard.nbytes());
    if (groups_[g].mixed() && stage_ == 1 && groups_[g].grad_full.defined())
      internal += static_cast<int64_t>(groups_[g].grad_full.nbytes());
  }
  return {{"stage", stage_},
          {"ranks", comm_.size()},
          {"replicas", replicate_.valid() ? replicate_.size() : 1},
          {"groups", units},
          {"parameters", elements},
          {"shard_elements", shard_elements},
          {"internal_state_bytes", internal},
          {"gathers", gathers_},
          {"prefetches", forward_prefetches_ + backward_prefetches_},
          {"forward_prefetches", forward_prefetches_},
          {"backward_prefetches", backward_prefetches_},
          {"frozen_released_in_backward", frozen_released_in_backward_},
          {"values_from_rank0", stage_ == 3 && options_.values_from_rank0},
          {"releases", releases_},
          {"launches", launches_},
          {"overlapped_launches", overlapped_},
          {"gathered_bytes", gathered_bytes_},
          {"peak_gathered_bytes", peak_gathered_bytes_},
          {"step_peak_gathered_bytes", step_peak_gathered_bytes_}};
}

}  // namespace xlr8::detail
