// Deferred init (DeepSpeed's zero.Init for LibTorch): a build recorded on the meta device, each tensor's
// values computed later and alone, bitwise those of the whole build, the generator left where the whole
// build leaves it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <malloc.h>

#include <fstream>
#include <functional>
#include <mutex>
#include <optional>

#include "os/memory.hpp"
#include "thread_ranks.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "zero_fixture.hpp"

using namespace xlr8;
using namespace xlr8::testing::zero;

namespace {

// What LibTorch's modules and a model's own init do: initialisers redone whole (Linear's kaiming, then
// normal_), a row written after the whole (Embedding's padding row), a value made apart and copied in,
// one drawn with a generator of its own, a buffer, and a parameter written in parts.
struct ZooImpl : torch::nn::Module {
  ZooImpl() {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 16).padding_idx(3)));
    fc = register_module("fc", torch::nn::Linear(16, 33));
    out = register_module("out", xlr8::nn::Linear(torch::nn::LinearOptions(33, 50).bias(false)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    mixed = register_parameter("mixed", torch::empty({7, 5}));
    mask = register_buffer("mask", torch::ones({8, 8}).tril());
    shift = register_buffer("shift", torch::zeros({16}, norm->weight.options()) + 0.5);  // options name meta
    literal = register_parameter("literal", torch::tensor({1.0f, 2.0f, 3.0f}));  // real values copied in
    torch::NoGradGuard no_grad;
    literal.mul_(2);
    fc->weight.normal_(0.0, 0.02);  // the model's own init over Linear's
    mixed.narrow(0, 0, 3).fill_(2.0);
    mixed.narrow(0, 3, 4).copy_(torch::randn({4, 5}) * 3 + 1);
    auto own = at::detail::createCPUGenerator(7);
    fc->bias.uniform_(-1.0, 1.0, own);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
  xlr8::nn::Linear out{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::Tensor mixed, mask, shift, literal;
};
TORCH_MODULE(Zoo);

std::vector<at::Tensor> values_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> v;
  for (const auto& p : m.parameters()) v.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) v.push_back(b.detach().clone());
  return v;
}

}  // namespace

TEST(DeferredInit, EachTensorMaterialisedAloneEqualsTheWholeBuildBitwise) {
  torch::manual_seed(5);
  auto whole = Zoo();
  const auto expected = values_of(*whole);
  const auto after_whole = torch::rand({6});

  torch::manual_seed(5);
  Zoo deferred{nullptr};
  {
    DeferredInitScope scope;
    deferred = Zoo();
    scope.finish(*deferred);
  }
  EXPECT_TRUE(at::equal(torch::rand({6}), after_whole)) << "the generator ends where the whole build leaves it";
  EXPECT_TRUE(has_deferred(*deferred));
  auto* identity = deferred->fc->weight.unsafeGetTensorImpl();
  // One at a time, last first: each computes only what it depends on, and draws as the whole build drew.
  auto params = deferred->parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    EXPECT_TRUE(is_deferred(*it));
    torch::manual_seed(99);  // the caller's generator is the caller's
    const auto state = at::detail::getDefaultCPUGenerator().get_state();
    materialize({*it});
    EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), state));
    EXPECT_FALSE(is_deferred(*it));
  }
  materialize_module(*deferred);
  EXPECT_FALSE(has_deferred(*deferred));
  EXPECT_EQ(deferred->fc->weight.unsafeGetTensorImpl(), identity);
  EXPECT_TRUE(deferred->fc->weight.requires_grad());
  const auto got = values_of(*deferred);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], expected[i])) << "tensor " << i;
  // It trains like the whole build.
  auto loss = deferred->fc(deferred->emb(torch::tensor({{1, 3, 4}}))).sum();
  loss.backward();
  EXPECT_TRUE(deferred->fc->weight.grad().defined());
}

TEST(DeferredInit, WhatCannotBeReplayedIsRefusedInOneLine) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Written after the build, before its values exist: the write would be lost.
  DeferredInitScope scope;
  auto lin = torch::nn::Linear(4, 4);
  scope.finish(*lin);
  {
    torch::NoGradGuard no_grad;
    lin->weight.mul_(2);
  }
  EXPECT_NE(message([&] { materialize({lin->weight}); }).find("written or replaced after the build"), std::string::npos);
  materialize({lin->bias});  // untouched: fine
  EXPECT_FALSE(lin->bias.is_meta());
  // Replaced (a dtype change through set_data): the recorded fp32 value would come back silently.
  DeferredInitScope again;
  auto other = torch::nn::Linear(4, 4);
  again.finish(*other);
  other->weight.set_data(other->weight.to(at::kBFloat16));
  EXPECT_NE(message([&] { materialize({other->weight}); }).find("written or replaced"), std::string::npos);
  // Seeding inside the build acts when recorded, not when replayed.
  EXPECT_NE(message([] {
              DeferredInitScope inner;
              torch::manual_seed(3);
              auto l = torch::nn::Linear(2, 2);
              inner.finish(*l);
            }).find("manual_seed"),
            std::string::npos);
  // Also when the build sets it back afterwards (as DeepSpeed's PipelineModule seeds each layer and restores the
  // program's state): the layer drew from the seed, the replay would draw from the state before it.
  const auto restored = message([] {
    DeferredInitScope inner;
    auto cpu = at::detail::getDefaultCPUGenerator();
    const auto before = cpu.get_state();
    torch::manual_seed(4);  // not the 3 the case above left it at
    auto l = torch::nn::Linear(2, 2);
    cpu.set_state(before);
    inner.finish(*l);
  });
  EXPECT_NE(restored.find("even if it set it back"), std::string::npos) << restored;
  // A meta tensor no recorded operator made has no values to replay.
  at::Tensor outside;
  {
    EmptyInitScope empty;
    outside = torch::ones({3});
  }
  EXPECT_NE(message([&] {
              DeferredInitScope inner;
              auto t = outside * 2;
            }).find("made outside this DeferredInitScope"),
            std::string::npos);
  // A build that cannot run on the CPU fails at finish(), leaving the generator where it was.
  torch::manual_seed(4);
  const auto start = at::detail::getDefaultCPUGenerator().get_state();
  EXPECT_THROW(
      {
        DeferredInitScope inner;
        auto l = torch::nn::Linear(3, 3);
        auto on_gpu = torch::empty({2}, at::kCUDA);
        inner.finish(*l);
      },
      Error);
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), start));
  EXPECT_TRUE(at::equal(torch::ones({3}) + 1, torch::full({3}, 2.0f)));  // every scope closed
}

TEST(DeferredInit, ADiscardedScopeLeavesTheThreadComputing) {
  {
    DeferredInitScope scope;
    auto lin = torch::nn::Linear(4, 4);
    EXPECT_TRUE(lin->weight.is_meta());
  }
  EXPECT_TRUE(at::equal(torch::ones({3}) + 1, torch::full({3}, 2.0f)));
  DeferredInitScope scope;
  auto lin = torch::nn::Linear(4, 4);
  scope.finish(*lin);
  EXPECT_THROW(scope.finish(*lin), Error);
  materialize_module(*lin);
  EXPECT_FALSE(lin->weight.is_meta());
}

// A ZeRO-3 model whose main process recorded its build and whose other ranks built it empty: each group
// computes its values when it is made, and training equals one process's whole build.
TEST(DeferredInit, RankZerosRecordedBuildShardsAndTrainsAsOneProcess) {
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  for (int ranks : {1, 2, 3})
    xlr8::testing::run_ranks(ranks, [&](Communicator& comm) {
      std::shared_ptr<TinyNetImpl> net;
      {
        static std::mutex mutex;  // the threads share LibTorch's default generator
        std::lock_guard<std::mutex> lock(mutex);
        torch::manual_seed(11);
        if (comm.rank() == 0) {
          DeferredInitScope scope;
          net = TinyNet(true).ptr();
          scope.finish(*net);
        } else {
          {
            EmptyInitScope empty;
            net = TinyNet(true).ptr();
          }
          to_empty(*net, at::kCPU);
        }
      }
      auto options = stage_options(3);
      options.zero.values_from_rank0 = ranks > 1;
      options.zero.offload_optimizer = ranks == 1;  // one process shards only when it offloads (nothing moves on the CPU)
      auto strategy = make_parallel_strategy(net, comm, options);
      EXPECT_FALSE(has_deferred(*net));
      EXPECT_EQ(strategy->stats()["groups_computed_when_made"].get<int64_t>() > 0, comm.rank() == 0);
      EXPECT_EQ(net->blocks[1]->as<TinyBlockImpl>()->fc->weight.storage().nbytes(), 0u);  // freed from the start
      auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
      expect_same_run(got, expected, 2e-6, fmt::format("{} ranks, rank {}", ranks, comm.rank()));
    });
}

namespace {

// TinyNet recorded (or built whole) on this thread-rank from `seed` (the threads share LibTorch's default
// generator).
std::shared_ptr<TinyNetImpl> recorded_tiny_net(uint64_t seed, bool frozen = false, bool record = true) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  std::optional<DeferredInitScope> scope;
  if (record) scope.emplace();
  auto net = TinyNet(true).ptr();
  if (scope) scope->finish(*net);
  if (frozen) freeze_front(*net);
  return net;
}

}  // namespace

// DeepSpeed's zero.Init on every rank: each recorded its build (from a seed of its own here), rank 0 computes
// each group's values as it is made and sends them, the others only make room. Training equals one process
// building rank 0's model whole, with persistent parameters, DeepSpeed's guarded units, and the frozen
// parameters stage 2 keeps whole.
TEST(DeferredInit, EveryRanksRecordedBuildTakesRankZerosValuesAndTrainsAsOneProcess) {
  struct Layout {
    std::string name;
    int stage;
    std::string policy;
    int64_t persistence;
    bool frozen;
  };
  const std::vector<Layout> layouts = {{"stage 3 by class", 3, "TRANSFORMER_BASED_WRAP", 0, false},
                                       {"stage 3 by class, persistence 25", 3, "TRANSFORMER_BASED_WRAP", 25, false},
                                       {"stage 3 guarded units, persistence 25", 3, "GUARDED_MODULES", 25, false},
                                       {"stage 2, front frozen", 2, "TRANSFORMER_BASED_WRAP", 0, true}};
  for (const auto& layout : layouts) {
    const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05, false, layout.frozen);
    for (int ranks : {2, 3})
      xlr8::testing::run_ranks(ranks, [&](Communicator& comm) {
        auto net = recorded_tiny_net(11 + 7 * comm.rank(), layout.frozen);
        auto options = stage_options(layout.stage, layout.policy);
        options.zero.param_persistence_threshold = layout.persistence;
        auto strategy = make_parallel_strategy(net, comm, options);
        const auto what = fmt::format("{}, {} ranks, rank {}", layout.name, ranks, comm.rank());
        EXPECT_FALSE(has_deferred(*net)) << what;
        // Rank 0 computes every group's values, the others none: they receive them.
        const auto stats = strategy->stats();
        EXPECT_EQ(stats["groups_computed_when_made"].get<int64_t>() > 0, comm.rank() == 0) << what;
        EXPECT_EQ(stats["groups_received_when_made"].get<int64_t>() > 0, comm.rank() != 0) << what;
        const bool starts_freed = layout.stage == 3 && layout.policy == "TRANSFORMER_BASED_WRAP";
        EXPECT_EQ(net->blocks[1]->as<TinyBlockImpl>()->fc->weight.storage().nbytes() == 0, starts_freed) << what;
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
        expect_same_run(got, expected, 2e-6, what);
      });
  }
}

// Rank 0 recorded and rank 1 built whole, without rank-0 loading; or rank 1 wrote a recorded parameter before
// sharding (which would be lost): refused on both ranks, before any collective could disagree.
TEST(DeferredInit, RanksRecordingAndBuildingWholeOrWritingARecordedValueAreRefusedOnEveryRank) {
  auto refused = [](const std::function<std::shared_ptr<TinyNetImpl>(int rank)>& build,
                    const std::function<std::string(int rank)>& said) {
    xlr8::testing::run_ranks(2, [&](Communicator& comm) {
      auto net = build(comm.rank());
      try {
        make_parallel_strategy(net, comm, stage_options(3));
        ADD_FAILURE() << "rank " << comm.rank() << " accepted it";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(said(comm.rank())), std::string::npos) << e.what();
      }
    });
  };
  refused([](int rank) { return recorded_tiny_net(11, /*frozen=*/false, /*record=*/rank == 0); },
          [](int) { return "1 of 2 ranks recorded the model's build"; });
  refused(
      [](int rank) {
        auto net = recorded_tiny_net(11);
        torch::NoGradGuard no_grad;
        if (rank == 1) net->head->weight.mul_(2);
        return net;
      },
      [](int rank) { return rank == 1 ? "written or replaced after the build" : "rank(s) 1 refused their recorded model"; });
}

// Recording and computing values return freed memory to the system at once (glibc's mmap threshold 1 MB), but
// only while they run: once a strategy has made the model, a 16 MB temporary of a training step comes from the
// warm heap again, not from a fresh mmap (which every step would page-fault anew).
TEST(DeferredInit, TrainingStepsGetWarmMemoryOnceTheModelIsMade) {
  if (os::detail::malloc_thresholds().prompt_for_good) GTEST_SKIP() << "the disk tier ran in this process";
  auto mmapped_while_alive = [] {
    const auto before = mallinfo2().hblkhd;
    auto temporary = at::ones({4 << 20});  // 16 MB
    return mallinfo2().hblkhd - before >= (16u << 20);
  };
  auto net = recorded_tiny_net(11);
  {
    os::PromptlyFreedMemory prompt;  // as while the values are computed
    EXPECT_TRUE(mmapped_while_alive());
  }
  auto options = stage_options(3);
  options.zero.offload_optimizer = true;  // one process shards only when it offloads
  auto strategy = make_parallel_strategy(net, Communicator::in_process(xlr8::testing::unique_key(), 0, 1), options);
  EXPECT_GT(strategy->stats()["groups_computed_when_made"].get<int64_t>(), 0);
  EXPECT_FALSE(mmapped_while_alive());
}

namespace {

double peak_resident_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024;
  return 0;
}
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }

// 12 layers of 8 MB, each initialised twice (Linear's kaiming, then the model's normal_).
struct TallImpl : torch::nn::Module {
  TallImpl() {
    for (int i = 0; i < 12; ++i) layers.push_back(register_module(fmt::format("l{}", i), torch::nn::Linear(1024, 2048)));
    torch::NoGradGuard no_grad;
    for (auto& layer : layers) layer->weight.normal_(0.0, 0.02);
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Tall);

}  // namespace

TEST(DeferredInit, ALayersValuesCostThatLayerOnly) {
  Tall tall{nullptr};
  reset_peak_resident();
  double base = peak_resident_mb();
  {
    DeferredInitScope scope;
    tall = Tall();
    scope.finish(*tall);  // runs the whole build once, keeping nothing
  }
  EXPECT_LT(peak_resident_mb() - base, 40) << "the first run held more than a layer or two";
  torch::manual_seed(3);
  const auto third = Tall()->layers[3]->weight.detach().clone();  // the whole build's (96 MB, then freed)
  torch::manual_seed(3);
  {
    DeferredInitScope scope;
    tall = Tall();
    scope.finish(*tall);
  }
  reset_peak_resident();
  base = peak_resident_mb();
  for (auto& layer : tall->layers) {
    materialize({layer->weight, layer->bias});
    for (auto* p : {&layer->weight, &layer->bias}) EXPECT_FALSE(p->is_meta());
    if (&layer == &tall->layers[3]) {
      EXPECT_TRUE(at::equal(layer->weight, third));
    }
    layer->weight.set_data(at::empty({0}));  // as a sharded model keeps only its shard
  }
  EXPECT_LT(peak_resident_mb() - base, 40) << "materialising one layer held others";
}
