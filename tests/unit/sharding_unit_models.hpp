#pragma once
// The models the sharding-unit tests train (test_sharding_units*.cpp): blocks with and without a guard, a model
// that declares its blocks, GUARDED_MODULES' riders and a tied xlr8 embedding head. Ranks are threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "parallel/shard/unit_registry.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "parallel/shard/zero_strategy.hpp"
#include "strategy_steps.hpp"
#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/unshard.hpp"

using namespace xlr8;
using xlr8::testing::expect_same;
using xlr8::testing::run_ranks;
using xlr8::testing::train_steps;

namespace xlr8::testing::units {


constexpr int64_t kWidth = 6;

// Returns two tensors on independent branches: `side` is computed last, so its backward runs first and
// would read freed parameters unless its own output gathers the unit.
struct PairBlockImpl : torch::nn::Module {
  PairBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kWidth, 2 * kWidth + 1));
    out = register_module("out", torch::nn::Linear(2 * kWidth + 1, kWidth));
    side = register_module("side", torch::nn::Linear(kWidth, kWidth));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] { return std::tuple{x + out(torch::tanh(fc(x))), side(x)}; });
  }
  torch::nn::Linear fc{nullptr}, out{nullptr}, side{nullptr};
};
TORCH_MODULE(PairBlock);

// A model author's block that forgot its guard.
struct PlainBlockImpl : torch::nn::Module {
  PlainBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(PlainBlock);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool with_plain) {
    in = register_module("in", torch::nn::Linear(4, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(PairBlock());
    if (with_plain) plain = register_module("plain", PlainBlock());
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] {
      x = in(x);
      for (size_t k = 0; k < blocks->size(); ++k) {
        const size_t b = reversed ? blocks->size() - 1 - k : k;
        auto [y, side] = blocks[b]->as<PairBlockImpl>()->forward(x);
        // The last block's first output unused: only its second one can gather it for backward.
        x = k + 1 == blocks->size() ? torch::tanh(side) : y + 0.5 * torch::tanh(side);
      }
      if (plain) x = plain->forward(x);
      return head(x);
    });
  }
  bool reversed = false;
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  PlainBlock plain{nullptr};
};
TORCH_MODULE(Net);

inline std::shared_ptr<NetImpl> make_net(bool with_plain) {
  static std::mutex mutex;  // ranks are threads sharing LibTorch's default generator
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(5);
  return Net(with_plain).ptr();
}

// The same net declaring its blocks, as a Hugging Face model's _no_split_modules.
struct DeclaringNetImpl : NetImpl, xlr8::NoSplitModules {
  explicit DeclaringNetImpl(std::vector<std::string> classes) : NetImpl(false), classes(std::move(classes)) {}
  std::vector<std::string> no_split_modules() const override { return classes; }
  std::vector<std::string> classes;
};

inline std::shared_ptr<NetImpl> make_declaring_net(std::vector<std::string> classes) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(5);  // make_net's weights
  return std::make_shared<DeclaringNetImpl>(std::move(classes));
}

inline ParallelOptions full_shard(std::vector<std::string> classes = {"PairBlock"}) {
  ParallelOptions o;
  o.ddp.find_unused_parameters = true;  // the last block's `fc` and `out`
  o.zero.stage = 3;
  o.zero.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
  o.zero.layer_classes = std::move(classes);
  return o;
}

inline StateDict train(ParallelStrategy& strategy, int rank, int ranks, int steps) {
  return train_steps<NetImpl>(strategy, rank, ranks, steps, 40);
}

inline StateDict single_run(bool with_plain, int steps) {
  auto single = make_parallel_strategy(make_net(with_plain), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  return train(*single, 0, 1, steps);
}




// GUARDED_MODULES (DeepSpeed ZeRO-3's granularity): a guarded block whose parameters all live in a child
// of the model's own class that has no guard (with a frozen parameter too), and an unguarded module
// directly under the guarded root.
struct InnerImpl : torch::nn::Module {
  InnerImpl() {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    shift = register_parameter("shift", torch::linspace(-0.3, 0.3, kWidth), /*requires_grad=*/false);
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) + shift; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(Inner);

struct GuardedBlockImpl : torch::nn::Module {
  GuardedBlockImpl() { inner = register_module("inner", Inner()); }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] { return x + torch::tanh(inner(x)); });
  }
  Inner inner{nullptr};
};
TORCH_MODULE(GuardedBlock);

struct RiderNetImpl : torch::nn::Module {
  RiderNetImpl() {
    in = register_module("in", torch::nn::Linear(4, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(GuardedBlock());
    plain = register_module("plain", PlainBlock());
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] {
      x = in(x);
      for (const auto& block : *blocks) x = block->as<GuardedBlockImpl>()->forward(x);
      return head(plain(x));
    });
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  PlainBlock plain{nullptr};
};
TORCH_MODULE(RiderNet);

inline std::shared_ptr<RiderNetImpl> make_rider_net() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(6);
  return RiderNet().ptr();
}

inline StateDict train_rider_net(ParallelStrategy& strategy, int rank, int ranks, int steps) {
  return train_steps<RiderNetImpl>(strategy, rank, ranks, steps, 70);
}



// Issue 41: xlr8's embedding, a head tied to it (one tensor, two names), blocks of the model's own classes and
// no parameter of the root's own. xlr8's layers were units, with no root to ride with: "never opened" them.
struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl() {
    auto head = xlr8::nn::Linear(torch::nn::LinearOptions(kWidth, 8).bias(false));
    embed = register_module("embed", xlr8::nn::Embedding(torch::nn::EmbeddingOptions(8, kWidth)._weight(head->weight)));
    blocks = register_module("blocks", torch::nn::ModuleList(GuardedBlock(), GuardedBlock()));
    plain = register_module("plain", PlainBlock());
    lm_head = register_module("lm_head", head);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto unit = xlr8::unshard(*this);
    auto h = embed(((x * 2).floor().clamp(-4, 3) + 4).to(at::kLong));  // each feature as one of 8 tokens
    for (const auto& block : *blocks) h = block->as<GuardedBlockImpl>()->forward(h);
    return unit.done(lm_head(plain(h)).mean(1).narrow(1, 0, 3));  // three classes
  }
  xlr8::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  PlainBlock plain{nullptr};  // the final norm's place: a module of its own class without a guard
  xlr8::nn::Linear lm_head{nullptr};
};

inline std::shared_ptr<TiedLmImpl> make_tied_lm() {
  static std::mutex mutex;  // ranks are threads sharing LibTorch's default generator
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(7);
  return std::make_shared<TiedLmImpl>();
}


}  // namespace xlr8::testing::units
