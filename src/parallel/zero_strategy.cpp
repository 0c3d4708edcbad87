#include "parallel/zero_strategy.hpp"

#include <fmt/format.h>

#include "parallel/zero_engine.hpp"
#include "xlr8/error.hpp"

namespace xlr8::detail {
namespace {

class ShardedDataParallel final : public ParallelStrategy {
 public:
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ZeroEngine> engine)
      : ParallelStrategy(std::move(module)), engine_(std::move(engine)) {}
  std::string name() const override { return fmt::format("zero{}", engine_->stage()); }
  void begin_step(bool suspend_sync) override { engine_->begin_step(suspend_sync); }
  void end_step() override { engine_->end_step(); }
  std::vector<at::Tensor> optimizer_parameters() const override { return engine_->optimizer_parameters(); }
  void bind_optimizer(torch::optim::Optimizer& optimizer) const override { engine_->bind_optimizer(optimizer); }
  void optimizer_step(torch::optim::Optimizer& optimizer) override { engine_->optimizer_step(optimizer); }
  double clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) override {
    return engine_->clip_grad_norm(parameters, max_norm, norm_type);
  }
  bool replicated() const override { return false; }
  StateDict state_dict(StateDictKind kind) const override { return engine_->state_dict(kind); }
  void load_state_dict(const StateDict& state, StateDictKind kind) override { engine_->load_state_dict(state, kind); }
  void gather_full_parameters() override { engine_->gather_all(); }
  void release_full_parameters(bool writeback) override { engine_->release_all(writeback); }
  nlohmann::json stats() const override {
    auto out = engine_->stats();
    out["strategy"] = name();
    return out;
  }

 private:
  std::shared_ptr<ZeroEngine> engine_;
};

int stage_of(const FsdpSettings& f) {
  switch (f.sharding_strategy) {
    case ShardingStrategy::NO_SHARD: return 0;
    case ShardingStrategy::SHARD_GRAD_OP: return 2;
    case ShardingStrategy::FULL_SHARD: return f.version == 2 && f.reshard_after_forward == false ? 2 : 3;
    case ShardingStrategy::HYBRID_SHARD:
    case ShardingStrategy::HYBRID_SHARD_ZERO2:
      throw ConfigError(fmt::format("fsdp_sharding_strategy {}: hybrid sharding (shard inside a node, replicate "
                                    "across nodes) is not implemented yet; use FULL_SHARD or SHARD_GRAD_OP",
                                    to_string(f.sharding_strategy)));
  }
  return 3;
}

}  // namespace

ZeroOptions resolve_zero_options(ZeroOptions options, const Settings& settings) {
  if (settings.fsdp) {
    const auto& f = *settings.fsdp;
    options.auto_wrap_policy = f.auto_wrap_policy;
    options.layer_classes = f.transformer_layer_cls_to_wrap;
    options.min_num_params = f.min_num_params;
    if (options.stage < 0) options.stage = stage_of(f);
  }
  if (settings.deepspeed && options.stage < 0) {
    options.stage = settings.deepspeed->zero_stage;
  }
  if (options.stage < 0) options.stage = 0;
  return options;
}

std::unique_ptr<ParallelStrategy> make_zero_strategy(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                     const ParallelOptions& options,
                                                     std::shared_ptr<const GradientState> gradient_state) {
  auto engine = std::make_shared<ZeroEngine>(module, std::move(comm), options.zero.stage, options.zero,
                                             options.ddp.find_unused_parameters, std::move(gradient_state));
  engine->attach();
  return std::make_unique<ShardedDataParallel>(std::move(module), std::move(engine));
}

}  // namespace xlr8::detail
