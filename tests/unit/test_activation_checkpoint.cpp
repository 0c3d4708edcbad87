// Activation checkpointing (issue 24 §3): xlr8::checkpoint gives the plain run's gradients bit for bit
// (dropout included) while its graph keeps none of the region's activations; fsdp_activation_checkpointing's
// units recompute under FULL_SHARD with no extra gather, and DDP/ZeRO see one backward. Ranks are threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <set>

#include "parallel/recompute/recompute.hpp"
#include "strategy_steps.hpp"
#include "thread_ranks.hpp"
#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/error.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/unshard.hpp"

using namespace xlr8;
using xlr8::testing::generator_lock;
using xlr8::testing::expect_same;
using xlr8::testing::run_ranks;

namespace {

// Every node's name reachable from `output` backwards.
std::multiset<std::string> graph_nodes(const torch::Tensor& output) {
  std::multiset<std::string> names;
  std::vector<torch::autograd::Node*> stack;
  std::set<torch::autograd::Node*> seen;
  if (output.grad_fn()) stack.push_back(output.grad_fn().get());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    names.insert(node->name());
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return names;
}

size_t count_containing(const std::multiset<std::string>& names, const std::string& part) {
  return std::count_if(names.begin(), names.end(), [&](const std::string& n) { return n.find(part) != std::string::npos; });
}

struct RegionImpl : torch::nn::Module {
  RegionImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 32));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    out = register_module("out", torch::nn::Linear(32, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(drop(torch::gelu(fc(x)))); }
  torch::nn::Linear fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Region);

struct Gradients {
  std::vector<torch::Tensor> params;
  torch::Tensor input, loss, next_random;
};

Gradients run_region(bool checkpointed, bool input_requires_grad) {
  torch::manual_seed(11);
  Region region;
  auto x = torch::randn({5, 8}).requires_grad_(input_requires_grad);
  torch::manual_seed(12);  // the dropout masks
  auto y = checkpointed ? xlr8::checkpoint([r = region.ptr()](const torch::Tensor& in) { return r->forward(in); }, x)
                        : region->forward(x);
  // Checkpointed, the graph holds the region as one node: none of its activations are kept.
  const auto nodes = graph_nodes(y);
  EXPECT_EQ(count_containing(nodes, "Addmm"), checkpointed ? 0u : 2u);
  EXPECT_EQ(count_containing(nodes, "CheckpointFunction"), checkpointed ? 1u : 0u);
  auto loss = y.pow(2).sum();
  loss.backward();
  Gradients g;
  for (const auto& p : region->parameters()) g.params.push_back(p.grad().clone());
  if (input_requires_grad) g.input = x.grad().clone();
  g.loss = loss.detach();
  g.next_random = torch::rand({4});  // backward left the generator where the plain run leaves it
  return g;
}

void expect_identical(const Gradients& got, const Gradients& expected) {
  EXPECT_TRUE(torch::equal(got.loss, expected.loss));
  ASSERT_EQ(got.params.size(), expected.params.size());
  for (size_t k = 0; k < got.params.size(); ++k) EXPECT_TRUE(torch::equal(got.params[k], expected.params[k])) << k;
  EXPECT_EQ(got.input.defined(), expected.input.defined());
  if (got.input.defined()) {
    EXPECT_TRUE(torch::equal(got.input, expected.input));
  }
  EXPECT_TRUE(torch::equal(got.next_random, expected.next_random));
}

}  // namespace

TEST(ActivationCheckpoint, GradientsEqualThePlainRunBitForBitWithDropoutAndTheGraphKeepsNoActivations) {
  std::lock_guard<std::mutex> lock(generator_lock());
  for (bool input_requires_grad : {true, false}) {
    SCOPED_TRACE(input_requires_grad ? "input requires gradients" : "input without gradients");
    expect_identical(run_region(true, input_requires_grad), run_region(false, input_requires_grad));
  }
}

TEST(ActivationCheckpoint, TokenIdsTuplesPlainValuesNestingAndAutocastComeThrough) {
  std::lock_guard<std::mutex> lock(generator_lock());
  for (bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "CPU autocast bf16" : "fp32");
    auto run = [&](bool checkpointed) {
      torch::manual_seed(3);
      torch::nn::Embedding embed(20, 8);
      torch::nn::Linear fc(8, 8);
      auto ids = torch::randint(0, 20, {4, 6});
      AutocastScope scope = autocast ? AutocastScope(c10::DeviceType::CPU, at::kBFloat16) : AutocastScope();
      // A region of token ids (no input requires gradients) returning a tuple with a plain value, and a
      // region nested inside it.
      auto region = [e = embed.ptr(), f = fc.ptr(), checkpointed](const torch::Tensor& tokens, double scale) {
        auto h = e->forward(tokens) * scale;
        auto inner = [f](const torch::Tensor& t) { return torch::tanh(f->forward(t)); };
        auto g = checkpointed ? xlr8::checkpoint(inner, h) : inner(h);
        return std::tuple<torch::Tensor, int64_t, torch::Tensor>{g, tokens.size(1), h.sum(-1)};
      };
      auto [g, length, side] = checkpointed ? xlr8::checkpoint(region, ids, 0.5) : region(ids, 0.5);
      EXPECT_EQ(length, 6);
      (g.to(at::kFloat).pow(2).sum() + side.to(at::kFloat).sum()).backward();
      return std::vector<torch::Tensor>{embed->weight.grad().clone(), fc->weight.grad().clone(), fc->bias.grad().clone()};
    };
    auto plain = run(false), checkpointed = run(true);
    for (size_t k = 0; k < plain.size(); ++k) {
      ASSERT_TRUE(checkpointed[k].defined()) << k;
      EXPECT_TRUE(torch::equal(checkpointed[k], plain[k])) << k;
    }
  }
}

TEST(ActivationCheckpoint, WithoutGradientRecordingItIsThePlainCall) {
  torch::nn::Linear fc(3, 3);
  auto x = torch::randn({2, 3});
  torch::NoGradGuard no_grad;
  auto y = xlr8::checkpoint([f = fc.ptr()](const torch::Tensor& in) { return f->forward(in); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, fc(x)));
}

namespace {

constexpr int64_t kWidth = 6;

// A unit written in the form activation checkpointing can recompute.
struct UnitBlockImpl : torch::nn::Module {
  UnitBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kWidth, 2 * kWidth + 1));
    out = register_module("out", torch::nn::Linear(2 * kWidth + 1, kWidth));
  }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [this](torch::Tensor x) { return x + out(torch::tanh(fc(x))); }, x);
  }
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(UnitBlock);

// A unit whose guard takes no inputs: it cannot be recomputed.
struct ClosureBlockImpl : torch::nn::Module {
  ClosureBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] { return x + fc(x); });
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ClosureBlock);

// `head_checkpointed`: the head (the last layer, whose gradients come first) runs in a region of its
// own, so DDP's and ZeRO's first gradient hook fires inside the recomputation's nested backward.
struct NetImpl : torch::nn::Module {
  NetImpl(bool closure_block, bool head_checkpointed) : head_checkpointed(head_checkpointed) {
    in = register_module("in", torch::nn::Linear(4, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(UnitBlock());
    if (closure_block) closure = register_module("closure", ClosureBlock());
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    return xlr8::sharded(*this, [&] {
      x = in(x);
      for (const auto& block : *blocks) x = block->as<UnitBlockImpl>()->forward(x);
      if (closure) x = closure->forward(x);
      return head_checkpointed ? xlr8::checkpoint([this](const torch::Tensor& h) { return head(h); }, x) : head(x);
    });
  }
  bool head_checkpointed;
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  ClosureBlock closure{nullptr};
};
TORCH_MODULE(Net);

std::shared_ptr<NetImpl> make_net(bool closure_block = false, bool head_checkpointed = false) {
  std::lock_guard<std::mutex> lock(generator_lock());
  torch::manual_seed(5);
  return Net(closure_block, head_checkpointed).ptr();
}

void mark_blocks(NetImpl& net) {
  for (size_t b = 0; b < net.blocks->size(); ++b)
    xlr8::recompute::mark_recomputed_unit(*net.blocks[b], fmt::format("blocks.{}", b), net);
  if (net.closure) xlr8::recompute::mark_recomputed_unit(*net.closure, "closure", net);
}

StateDict train(ParallelStrategy& strategy, int rank, int ranks, int steps) {
  return xlr8::testing::train_steps<NetImpl>(strategy, rank, ranks, steps, 40);
}

ParallelOptions full_shard(std::vector<std::string> classes = {"UnitBlock"}) {
  ParallelOptions o;
  o.zero.stage = 3;
  o.zero.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
  o.zero.layer_classes = std::move(classes);
  return o;
}

StateDict single_run(int steps) {
  auto single = make_parallel_strategy(make_net(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  return train(*single, 0, 1, steps);
}

}  // namespace

TEST(ActivationCheckpoint, FullShardUnitsRecomputeWithoutAnExtraGatherAndMatchOneRank) {
  const auto expected = single_run(3);
  for (int ranks : {2, 3, 4}) {
    std::vector<int64_t> gathers(2 * static_cast<size_t>(ranks));
    for (bool checkpointed : {false, true})
      run_ranks(ranks, [&](Communicator& comm) {
        auto net = make_net();
        if (checkpointed) mark_blocks(*net);
        auto strategy = make_parallel_strategy(net, comm, full_shard());
        auto got = train(*strategy, comm.rank(), ranks, 3);
        expect_same(got, expected, fmt::format("{} ranks, rank {}, checkpointed {}", ranks, comm.rank(), checkpointed));
        const auto stats = strategy->stats();
        gathers[static_cast<size_t>(checkpointed) * ranks + comm.rank()] = stats["gathers"].get<int64_t>();
        EXPECT_EQ(stats["gathered_bytes"], 0) << stats.dump();  // everything freed after the step
        if (checkpointed) {
          EXPECT_TRUE(xlr8::recompute::recomputed_units_never_run(*net).empty());
        }
      });
    // Forward (under no-grad) gathers each block once and the recomputation once more, for its backward
    // too: as many gathers as without checkpointing.
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(gathers[ranks + r], gathers[r]) << ranks << " ranks, rank " << r;
  }
}

TEST(ActivationCheckpoint, DdpAndZero2HandGradientsOverOnlyWhenTheOuterBackwardEnds) {
  const auto expected = single_run(3);
  for (int stage : {0, 2})
    run_ranks(3, [&](Communicator& comm) {
      auto net = make_net(false, /*head_checkpointed=*/true);
      mark_blocks(*net);  // under DDP and ZeRO-2 the guards gather nothing: the blocks are recomputed only
      ParallelOptions options;
      options.zero.stage = stage;
      auto strategy = make_parallel_strategy(net, comm, options);
      expect_same(train(*strategy, comm.rank(), 3, 3), expected, fmt::format("stage {}, rank {}", stage, comm.rank()));
    });
}

TEST(ActivationCheckpoint, AUnitWhoseGuardCannotRecomputeIsRefusedByName) {
  auto net = make_net(/*closure_block=*/true);
  mark_blocks(*net);
  try {
    net->forward(torch::randn({2, 4}));
    ADD_FAILURE() << "a unit whose forward cannot be recomputed ran unchecked";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("fsdp_activation_checkpointing: unit closure"), std::string::npos) << what;
    EXPECT_NE(what.find("xlr8::sharded(*this, [this](torch::Tensor x)"), std::string::npos) << what;
  }
}

TEST(ActivationCheckpoint, AMarkedUnitThatNeverCameThroughItsGuardIsNamedOnce) {
  auto net = make_net();
  xlr8::recompute::mark_recomputed_unit(*net->in, "in", *net);  // a LibTorch Linear: its forward opens no guard
  mark_blocks(*net);
  net->forward(torch::randn({2, 4})).sum().backward();
  auto other = make_net();  // another model's units are its own
  xlr8::recompute::mark_recomputed_unit(*other->in, "in", *other);
  EXPECT_EQ(xlr8::recompute::recomputed_units_never_run(*net), std::vector<std::string>{"in"});
  EXPECT_TRUE(xlr8::recompute::recomputed_units_never_run(*net).empty());  // reported once
  EXPECT_EQ(xlr8::recompute::recomputed_units_never_run(*other), std::vector<std::string>{"in"});
}

namespace {
// One Linear read outside a checkpointed region and inside it: its gradient arrives twice in one backward.
struct TiedImpl : torch::nn::Module {
  TiedImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return xlr8::checkpoint([this](const torch::Tensor& h) { return lin(torch::tanh(h)); }, lin(x));
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Tied);
}  // namespace

TEST(ActivationCheckpoint, AParameterUsedInsideAndOutsideARegionIsRefusedByDdpAndZeroNotSilentlyHalved) {
  for (int stage : {0, 2})
    run_ranks(2, [&](Communicator& comm) {
      std::shared_ptr<TiedImpl> net;
      {
        std::lock_guard<std::mutex> lock(generator_lock());
        torch::manual_seed(1);
        net = Tied().ptr();
      }
      ParallelOptions options;
      options.zero.stage = stage;
      auto strategy = make_parallel_strategy(net, comm, options);
      strategy->begin_step(false);
      try {
        net->forward(torch::randn({3, 4})).sum().backward();
        ADD_FAILURE() << "stage " << stage << ": a gradient arriving twice was taken";
      } catch (const std::exception& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("parameter lin."), std::string::npos) << what;
        EXPECT_NE(what.find("received its gradient twice in one backward pass"), std::string::npos) << what;
      }
    });
}
