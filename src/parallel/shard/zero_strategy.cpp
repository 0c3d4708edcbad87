#include "parallel/shard/zero_strategy.hpp"

#include <fmt/format.h>

#include <tuple>

#include "parallel/replicate/replica_sync.hpp"
#include "parallel/shard/zero_engine.hpp"
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
  bool owns(const at::Tensor& tensor) const override { return engine_->owns(tensor); }
  void bind_optimizer(torch::optim::Optimizer& optimizer) const override { engine_->bind_optimizer(optimizer); }
  void optimizer_step(torch::optim::Optimizer& optimizer) override { engine_->optimizer_step(optimizer); }
  GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) override {
    return engine_->clip_grad_norm(parameters, max_norm, norm_type);
  }
  bool replicated() const override { return false; }
  std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& parameters) const override {
    return engine_->gradient_holders(parameters);
  }
  StateDict state_dict(StateDictKind kind) const override { return engine_->state_dict(kind); }
  void load_state_dict(const StateDict& state, StateDictKind kind) override { engine_->load_state_dict(state, kind); }
  std::vector<ParameterPiece> parameter_pieces() const override { return engine_->parameter_pieces(); }
  StateDict full_state_layout() const override { return engine_->full_state_layout(StateDictKind::FULL); }
  void visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn) const override {
    engine_->visit_full_state(fn);
  }
  void parameter_pieces_loaded(bool whole_parameters_written) override {
    engine_->parameter_pieces_loaded(whole_parameters_written);
  }
  void gather_full_parameters() override { engine_->gather_full_parameters(); }
  void release_full_parameters(bool writeback) override { engine_->release_full_parameters(writeback); }
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
    case ShardingStrategy::SHARD_GRAD_OP:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return 2;
    case ShardingStrategy::HYBRID_SHARD: return 3;
    case ShardingStrategy::FULL_SHARD: return f.version == 2 && f.reshard_after_forward == false ? 2 : 3;
  }
  return 3;
}

bool hybrid(const FsdpSettings& f, const std::optional<ParallelismSettings>& mesh) {
  if (f.sharding_strategy == ShardingStrategy::HYBRID_SHARD || f.sharding_strategy == ShardingStrategy::HYBRID_SHARD_ZERO2)
    return true;
  // FSDP2 on a mesh of dp_replicate x (dp_shard x cp x sp): Accelerate's fully_shard takes both dimensions
  // (ParallelismConfig.fsdp_dim_names), which is HSDP without fsdp_sharding_strategy saying so.
  return f.version == 2 && f.sharding_strategy != ShardingStrategy::NO_SHARD && mesh && mesh->dp_replicate > 1 &&
         mesh->dp_shard * mesh->cp * mesh->sp > 1;
}

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

ZeroOptions resolve_zero_options(ZeroOptions options, const Settings& settings, int node_size) {
  if (settings.fsdp) {
    const auto& f = *settings.fsdp;
    // Validated when the settings were read: parsed once, here.
    options.auto_wrap_policy = parse_auto_wrap_policy(f.auto_wrap_policy);
    options.layer_classes = f.transformer_layer_cls_to_wrap;
    options.min_num_params = f.min_num_params;
    options.forward_prefetch = f.forward_prefetch;
    options.backward_prefetch = parse_backward_prefetch(f.backward_prefetch);
    if (options.stage < 0) {
      options.stage = stage_of(f);
      if (hybrid(f, settings.parallelism)) {
        const auto& mesh = settings.parallelism;
        // On a mesh, HSDP shards over dp_shard x cp (or sp) and replicates over dp_replicate (the machine's size
        // would cut across tp and cp peers).
        if (mesh && mesh->total() > 1 && mesh->dp_shard * mesh->cp * mesh->sp == 1)
          throw ConfigError(fmt::format(
              "fsdp_sharding_strategy {} shards over parallelism_config_dp_shard_size, which is 1 on this mesh "
              "(dp_replicate {} x dp_shard 1 x cp 1 x sp 1 x tp {}); set parallelism_config_dp_shard_size above 1, or use "
              "FULL_SHARD to shard over every data-parallel rank",
              to_string(f.sharding_strategy), mesh->dp_replicate, mesh->tp));
        options.hybrid_shard_size = mesh && mesh->total() > 1 ? mesh->dp_shard * mesh->cp * mesh->sp : node_size;
      }
    }
  }
  if (settings.fsdp && settings.fsdp->offload_params) {
    // FSDP's CPUOffload: the optimizer steps on host shards; parameters stay there too where they are
    // sharded between uses (FULL_SHARD).
    options.offload_optimizer = true;
    options.offload_params = options.offload_params || options.stage == 3;
  }
  if (settings.deepspeed) {
    const auto& d = *settings.deepspeed;
    for (const auto& [device, key] : {std::pair{&d.offload_optimizer_device, "offload_optimizer_device"},
                                      std::pair{&d.offload_param_device, "offload_param_device"}})
      if (*device == "nvme")
        throw ConfigError(fmt::format("deepspeed_config.{} is nvme (ZeRO-Infinity), which xlr8 does not implement; use "
                                      "cpu (host memory) or none",
                                      key));
    options.offload_optimizer = options.offload_optimizer || d.offload_optimizer_device == "cpu";
    options.offload_params = options.offload_params || d.offload_param_device == "cpu";
    if (options.stage < 0) options.stage = d.zero_stage;
    // DeepSpeed gathers submodule by submodule, never the whole model at once.
    if (options.auto_wrap_policy == AutoWrapPolicy::NO_WRAP) options.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;
  }
  if (options.stage < 0) options.stage = 0;
  return options;
}

std::unique_ptr<ParallelStrategy> make_zero_strategy(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                     const ParallelOptions& options,
                                                     std::shared_ptr<const GradientState> gradient_state) {
  Communicator shard = std::move(comm), replicate;
  if (options.zero.hybrid_shard_size > 0 && options.zero.hybrid_shard_size != shard.size()) {
    if (options.zero.stage < 2)
      throw ConfigError(fmt::format("hybrid sharding needs ZeRO stage 2 or 3 (HYBRID_SHARD_ZERO2 or HYBRID_SHARD); "
                                    "stage {} was asked for",
                                    options.zero.stage));
    make_replicas_equal(shard, *module);  // every replica starts from rank 0's weights
    std::tie(shard, replicate) = hybrid_groups(shard, options.zero.hybrid_shard_size);
  }
  auto engine = std::make_shared<ZeroEngine>(module, std::move(shard), std::move(replicate), options.zero.stage,
                                             options.zero, options.ddp.find_unused_parameters, std::move(gradient_state));
  engine->attach();
  return std::make_unique<ShardedDataParallel>(std::move(module), std::move(engine));
}

}  // namespace xlr8::detail
