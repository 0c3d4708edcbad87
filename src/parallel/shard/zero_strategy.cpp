#include "parallel/shard/zero_strategy.hpp"

#include <fmt/format.h>

#include <tuple>

#include "parallel/replicate/replica_sync.hpp"
#include "parallel/shard/sharded_model.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"

namespace xlr8::shard {
namespace {

class ShardedDataParallel final : public ParallelStrategy {
 public:
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ShardedModel> sharded)
      : ParallelStrategy(std::move(module)), sharded_(std::move(sharded)) {}
  std::string name() const override { return fmt::format("zero{}", sharded_->stage()); }
  void begin_step(bool suspend_sync) override { sharded_->begin_step(suspend_sync); }
  void end_step() override { sharded_->end_step(); }
  void reduce_accumulated_gradients() override { sharded_->reduce_accumulated_now(); }
  std::vector<at::Tensor> optimizer_parameters() const override { return sharded_->optimizer_parameters(); }
  bool owns(const at::Tensor& tensor) const override { return sharded_->owns(tensor); }
  void bind_optimizer(torch::optim::Optimizer& optimizer) const override { sharded_->bind_optimizer(optimizer); }
  void optimizer_step(torch::optim::Optimizer& optimizer) override { sharded_->optimizer_step(optimizer); }
  void optimizer_state_in_memory(torch::optim::Optimizer& optimizer, bool in_memory) override {
    sharded_->optimizer_state_in_memory(optimizer, in_memory);
  }
  std::shared_ptr<HeldInMemory> hold_in_memory(const at::Tensor& leaf, torch::optim::Optimizer* optimizer,
                                               HoldFor purpose) override {
    return sharded_->hold_in_memory(leaf, optimizer, purpose);
  }
  GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) override {
    return sharded_->clip_grad_norm(parameters, max_norm, norm_type);
  }
  bool queue_on_disk_gradients(const std::vector<at::Tensor>& parameters,
                               const std::function<void(at::Tensor&)>& op) override {
    return sharded_->queue_on_disk_gradients(parameters, op);
  }
  bool non_finite_gradients_on_disk(const std::vector<at::Tensor>& parameters) override {
    return sharded_->non_finite_gradients_on_disk(parameters);
  }
  bool replicated() const override { return false; }
  std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& parameters) const override {
    return sharded_->gradient_holders(parameters);
  }
  StateDict state_dict(StateDictKind kind) const override { return sharded_->state_dict(kind); }
  void load_state_dict(const StateDict& state, StateDictKind kind) override { sharded_->load_state_dict(state, kind); }
  std::vector<ParameterPiece> parameter_pieces() const override { return sharded_->parameter_pieces(true); }
  bool keeps_state_on_disk() const override { return sharded_->keeps_state_on_disk(); }
  std::vector<ParameterPiece> parameter_pieces_where_they_are() const override {
    return sharded_->parameter_pieces(false);
  }
  StateDict full_state_layout() const override { return sharded_->full_state_layout(StateDictKind::FULL); }
  void visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn) const override {
    sharded_->visit_full_state(fn);
  }
  void parameter_pieces_loaded(bool whole_parameters_written) override {
    sharded_->parameter_pieces_loaded(whole_parameters_written);
  }
  void gather_full_parameters() override { sharded_->gather_full_parameters(); }
  void release_full_parameters(bool writeback) override { sharded_->release_full_parameters(writeback); }
  nlohmann::json stats() const override {
    auto out = sharded_->stats();
    out["strategy"] = name();
    return out;
  }

 private:
  std::shared_ptr<ShardedModel> sharded_;
};

// HSDP: consecutive blocks of `shard_size` data-parallel ranks shard; ranks at the same place in every
// block are replicas. Every rank makes its two groups (collective among their members).
std::pair<Communicator, Communicator> hybrid_groups(Communicator& dp, int shard_size) {
  if (shard_size < 1 || dp.size() % shard_size != 0)
    throw ConfigError(fmt::format("hybrid sharding: {} data-parallel ranks do not split into shard groups of {} (set "
                                  "parallelism_config_dp_shard_size to a divisor of the number of processes, or run the "
                                  "same number of processes on every machine)",
                                  dp.size(), shard_size));
  const int block = dp.rank() / shard_size, place = dp.rank() % shard_size;
  std::vector<int> shard_ranks, replica_ranks;
  for (int i = 0; i < shard_size; ++i) shard_ranks.push_back(block * shard_size + i);
  for (int b = 0; b < dp.size() / shard_size; ++b) replica_ranks.push_back(b * shard_size + place);
  auto shard = dp.new_group(shard_ranks, fmt::format("{}/hsdp_shard{}", dp.name(), block));
  auto replicate = dp.new_group(replica_ranks, fmt::format("{}/hsdp_replicate{}", dp.name(), place));
  return {shard, replicate};
}

}  // namespace

std::unique_ptr<ParallelStrategy> make_zero_strategy(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                     const ParallelOptions& options,
                                                     std::shared_ptr<const GradientState> gradient_state) {
  Communicator shard = std::move(comm), replicate;
  if (options.zero.hybrid_shard_size > 0 && options.zero.hybrid_shard_size != shard.size()) {
    if (options.zero.stage < 2)
      throw ConfigError(fmt::format("hybrid sharding needs ZeRO stage 2 or 3 (HYBRID_SHARD_ZERO2 or HYBRID_SHARD); "
                                    "stage {} was asked for",
                                    options.zero.stage));
    materialize_module(*module);  // a recorded build (DeferredInitScope) whole: replicas compare and send it so
    replicate::make_replicas_equal(shard, *module);  // every replica starts from rank 0's weights
    std::tie(shard, replicate) = hybrid_groups(shard, options.zero.hybrid_shard_size);
  }
  auto sharded = std::make_shared<ShardedModel>(module, std::move(shard), std::move(replicate), options.zero.stage,
                                             options.zero, options.ddp.find_unused_parameters, std::move(gradient_state));
  sharded->attach();
  return std::make_unique<ShardedDataParallel>(std::move(module), std::move(sharded));
}

}  // namespace xlr8::shard
