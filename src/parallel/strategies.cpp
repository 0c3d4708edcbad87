// The replica strategies (one process; DDP) and the factory that picks a strategy once per model.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/utils/clip_grad.h>

#include <map>

#include "parallel/state_dict_check.hpp"
#include "parallel/parallelize.hpp"
#include "parallel/shard/zero_strategy.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/parallel_options.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

GradNorm ParallelStrategy::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  // Tensor-parallel slices are parts of one norm over the tp group; replicas' gradients are whole.
  return tp::clip_grad_norm(parameters, tp::sliced_parameters(*module_), max_norm, norm_type);
}

StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers()) out.emplace_back(item.key(), item.value());
  return out;
}

bool ParallelStrategy::owns(const at::Tensor& tensor) const {
  std::call_once(owned_once_, [&] {
    for (const auto& p : module_->parameters()) owned_.insert(p.unsafeGetTensorImpl());
    for (const auto& p : optimizer_parameters()) owned_.insert(p.unsafeGetTensorImpl());
  });
  return owned_.count(tensor.unsafeGetTensorImpl()) > 0;
}

StateDict ParallelStrategy::state_dict(StateDictKind) const { return module_state_dict(*module_); }

void ParallelStrategy::load_state_dict(const StateDict& state, StateDictKind kind) {
  auto list = state_dict(kind);
  parallel::check_state_dict(list, state);
  std::map<std::string, at::Tensor> own(list.begin(), list.end());
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : state) own.at(name).copy_(tensor);
}

StateDict ParallelStrategy::full_state_layout() const {
  StateDict out;
  for (auto& [name, t] : module_state_dict(*module_)) out.emplace_back(name, at::empty(t.sizes(), t.options().device(at::kMeta)));
  return out;
}

void ParallelStrategy::visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn) const {
  auto state = state_dict(StateDictKind::FULL);  // replicas: views, nothing copied
  for (size_t i = 0; i < state.size(); ++i) fn(i, state[i].second);
}

std::vector<ParameterPiece> ParallelStrategy::parameter_pieces() const {
  auto placements = tp::parameter_placements(*module_);
  std::vector<ParameterPiece> out;
  for (const auto& item : module_->named_parameters())
    out.push_back({item.key(), std::move(placements.at(item.key())), item.value(), true});
  return out;
}

namespace {

// One process: nothing to synchronise; every default applies.
class SingleProcess final : public ParallelStrategy {
 public:
  explicit SingleProcess(std::shared_ptr<torch::nn::Module> module) : ParallelStrategy(std::move(module)) {}
  std::string name() const override { return "single"; }
};

// Full replicas kept equal by DistributedDataParallel's bucketed all-reduce.
class DataParallelReplicas final : public ParallelStrategy {
 public:
  DataParallelReplicas(std::shared_ptr<torch::nn::Module> module, Communicator comm, const DDPOptions& options,
                       std::shared_ptr<const GradientState> gradient_state)
      : ParallelStrategy(module), ddp_(std::move(module), std::move(comm), options),
        gradient_state_(std::move(gradient_state)) {}
  std::string name() const override { return "ddp"; }
  void begin_step(bool suspend_sync) override {
    // DDP's switch follows the one decision; it holds no opinion of its own.
    ddp_.set_sync(!suspend_sync && (!gradient_state_ || gradient_state_->sync_gradients));
    ddp_.sync_buffers();  // as PyTorch DDP's broadcast_buffers: rank 0's buffers before each forward
  }
  void end_step() override { ddp_.set_sync(true); }
  void reduce_accumulated_gradients() override { ddp_.reduce_accumulated_now(); }
  nlohmann::json stats() const override {
    return {{"strategy", name()},
            {"buckets", ddp_.bucket_layout().size()},
            {"launches", ddp_.launches()},
            {"overlapped_launches", ddp_.overlapped_launches()},
            {"exposed_comm_seconds", ddp_.exposed_comm_seconds()}};
  }

 private:
  DistributedDataParallel ddp_;
  std::shared_ptr<const GradientState> gradient_state_;
};

}  // namespace

std::unique_ptr<ParallelStrategy> make_parallel_strategy(std::shared_ptr<torch::nn::Module> module,
                                                         Communicator data_parallel, const ParallelOptions& options,
                                                         std::shared_ptr<const GradientState> gradient_state) {
  if (!module) throw Error("prepare(): the model is null");
  const bool offloads =
      options.zero.offload_optimizer || options.zero.offload_params || options.zero.optimizer_on_disk.enabled();
  shard::check_offload_stage(options.zero);
  // One process offloads too (ZeRO-Offload's single-GPU case): the sharded model over a group of one.
  const bool sharded = options.zero.stage > 0 && (data_parallel.size() > 1 || offloads);
  if (!sharded) materialize_module(*module);  // a recorded build's values, whole: nothing takes them a group at a time
  if (data_parallel.size() == 1 && !offloads) return std::make_unique<SingleProcess>(std::move(module));
  if (sharded)
    return shard::make_zero_strategy(std::move(module), std::move(data_parallel), options, std::move(gradient_state));
  return std::make_unique<DataParallelReplicas>(std::move(module), std::move(data_parallel), options.ddp,
                                                std::move(gradient_state));
}

std::unique_ptr<ParallelStrategy> make_parallel_strategy(std::shared_ptr<torch::nn::Module> module,
                                                         const ProcessState& state, const ParallelOptions& options,
                                                         std::shared_ptr<const GradientState> gradient_state) {
  // The same decisions as the Accelerator's plan (resolve_plan), from the same helpers.
  const auto parameters = module ? module->parameters() : std::vector<at::Tensor>{};
  const auto resolved = shard::resolve_parallel_options(options, nullptr, state.settings(), state.local_world_size(),
                                                         !parameters.empty() && parameters.front().device().is_cpu());
  auto& mesh = state.mesh();
  return make_parallel_strategy(std::move(module), mesh.group(parallel::data_parallel_dim(mesh)), resolved,
                                std::move(gradient_state));
}

}  // namespace xlr8
