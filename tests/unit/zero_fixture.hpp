#pragma once
// The ZeRO tests' model and training loop (ranks as threads over Communicator::in_process): a small
// residual network whose units divide evenly over no rank count, AdamW steps on each rank's rows of a
// global batch, and the comparison with one rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>

#include "thread_ranks.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/unshard.hpp"

namespace xlr8::testing::zero {

constexpr int64_t kWidth = 10;

// A residual block with an odd hidden width, so no unit's size divides evenly over 2, 3 or 4 ranks.
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    fc = register_module("fc", torch::nn::Linear(kWidth, 2 * kWidth + 1));
    out = register_module("out", torch::nn::Linear(2 * kWidth + 1, kWidth));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto unit = xlr8::unshard(*this);
    return unit.done(x + out(torch::tanh(fc(norm(x)))));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(TinyBlock);

// Parameters of its own (input layer, final norm, head) that no unit owns: the root's group.
struct TinyNetImpl : torch::nn::Module {
  explicit TinyNetImpl(bool guard_root) : guard_root(guard_root) {
    in = register_module("in", torch::nn::Linear(6, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(TinyBlock());
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto unit = guard_root ? xlr8::unshard(*this) : xlr8::UnshardScope();
    x = in(x);
    for (const auto& block : *blocks) x = block->as<TinyBlockImpl>()->forward(x);
    return unit.done(head(norm(x)));
  }
  bool guard_root;
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(TinyNet);

// Fine-tuning: the input layer (the root's), the whole first block (so backward never reaches it) and
// the front of the others (norm and fc: backward reaches them after the block's trainable gradients,
// `out`'s, are complete) require no gradients.
inline void freeze_front(TinyNetImpl& net) {
  net.in->weight.set_requires_grad(false);
  net.in->bias.set_requires_grad(false);
  for (size_t b = 0; b < net.blocks->size(); ++b) {
    auto* block = net.blocks[b]->as<TinyBlockImpl>();
    for (auto& p : (b == 0 ? block->parameters() : [&] {
           auto front = block->norm->parameters();
           for (auto& q : block->fc->parameters()) front.push_back(q);
           return front;
         }()))
      p.set_requires_grad(false);
  }
}

inline std::shared_ptr<TinyNetImpl> make_model(bool guard_root = true, bool frozen = false) {
  static std::mutex mutex;  // ranks are threads sharing LibTorch's default generator
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(11);
  auto net = TinyNet(guard_root).ptr();
  if (frozen) freeze_front(*net);
  return net;
}

struct Batch {
  at::Tensor x, y;
};
inline Batch global_batch(int step) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return {at::randn({12, 6}, gen), at::randint(0, 3, {12}, gen)};
}

inline ParallelOptions stage_options(int stage, const std::string& policy = "TRANSFORMER_BASED_WRAP") {
  ParallelOptions o;
  o.zero.stage = stage;
  o.zero.auto_wrap_policy = parse_auto_wrap_policy(policy);
  o.zero.layer_classes = {"TinyBlock"};
  o.zero.first_bucket_mb = o.zero.bucket_cap_mb = 0.001;  // stages 1-2: several buckets
  return o;
}

struct TrainRun {
  std::vector<double> losses;
  StateDict params;
  std::vector<double> norms;
};

// AdamW steps on this rank's rows (accumulating `micro` micro-batches per step); clipping when max_norm > 0.
// `around_step`, when given, is called just before each optimizer step (false) and just after it (true).
inline TrainRun train(ParallelStrategy& strategy, int rank, int ranks, int steps, int micro = 1, double max_norm = 0,
          bool bf16 = false, const std::function<void(bool after)>& around_step = {}) {
  auto gs = std::make_shared<GradientState>();
  torch::optim::AdamW opt(strategy.module()->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  strategy.bind_optimizer(opt);
  auto& net = dynamic_cast<TinyNetImpl&>(*strategy.module());
  TrainRun run;
  for (int s = 0; s < steps; ++s) {
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      auto batch = global_batch(s * micro + m);
      const int64_t rows = 12 / ranks;
      auto x = batch.x.narrow(0, rank * rows, rows), y = batch.y.narrow(0, rank * rows, rows);
      strategy.begin_step(/*suspend_sync=*/m + 1 < micro);
      at::Tensor loss;
      {
        AutocastScope autocast(c10::DeviceType::CPU, at::kBFloat16, bf16);
        loss = torch::nll_loss(torch::log_softmax(net.forward(x), 1), y);
      }
      (loss / micro).backward();
      strategy.end_step();
      loss_sum += loss.item<double>();
    }
    if (max_norm > 0) run.norms.push_back(strategy.clip_grad_norm(strategy.module()->parameters(), max_norm, 2.0));
    if (around_step) around_step(false);
    strategy.optimizer_step(opt);
    if (around_step) around_step(true);
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
    run.losses.push_back(loss_sum / micro);
  }
  for (auto& [name, t] : strategy.state_dict(StateDictKind::FULL)) run.params.emplace_back(name, t.detach().clone());
  return run;
}

inline void expect_same_run(const TrainRun& got, const TrainRun& expected, double tolerance, const std::string& what) {
  // Each rank's loss is over its own rows: only the parameters and norms compare directly.
  ASSERT_EQ(got.params.size(), expected.params.size()) << what;
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, expected.params[i].first) << what;
    EXPECT_LE((got.params[i].second - expected.params[i].second).abs().max().item<double>(), tolerance)
        << what << " " << got.params[i].first;
  }
  ASSERT_EQ(got.norms.size(), expected.norms.size()) << what;
  for (size_t i = 0; i < got.norms.size(); ++i) EXPECT_NEAR(got.norms[i], expected.norms[i], 1e-5) << what;
}

inline TrainRun single_run(int steps, int micro = 1, double max_norm = 0, bool bf16 = false, bool frozen = false) {
  auto single = make_parallel_strategy(make_model(true, frozen), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  return train(*single, 0, 1, steps, micro, max_norm, bf16);
}


}  // namespace xlr8::testing::zero
