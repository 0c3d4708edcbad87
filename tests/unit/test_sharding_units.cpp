// Stage-3 units as a model author meets them: a forward that returns several tensors (xlr8::sharded), a
// unit whose guard never opens, and ranks that run units in different orders. Ranks are threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "parallel/unit_registry.hpp"
#include "parallel/zero_strategy.hpp"
#include "strategy_steps.hpp"
#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/unshard.hpp"

using namespace xlr8;
using xlr8::testing::expect_same;
using xlr8::testing::run_ranks;
using xlr8::testing::train_steps;

namespace {

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

std::shared_ptr<NetImpl> make_net(bool with_plain) {
  static std::mutex mutex;  // ranks are threads sharing LibTorch's default generator
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(5);
  return Net(with_plain).ptr();
}

ParallelOptions full_shard(std::vector<std::string> classes = {"PairBlock"}) {
  ParallelOptions o;
  o.ddp.find_unused_parameters = true;  // the last block's `fc` and `out`
  o.zero.stage = 3;
  o.zero.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;
  o.zero.layer_classes = std::move(classes);
  return o;
}

StateDict train(ParallelStrategy& strategy, int rank, int ranks, int steps) {
  return train_steps<NetImpl>(strategy, rank, ranks, steps, 40);
}

StateDict single_run(bool with_plain, int steps) {
  auto single = make_parallel_strategy(make_net(with_plain), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  return train(*single, 0, 1, steps);
}


}  // namespace

TEST(ShardingUnits, ATupleReturningUnitTrainsUnderFullShardAndMatchesOneRank) {
  const auto expected = single_run(false, 3);
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_net(false), comm, full_shard());
      auto got = train(*strategy, comm.rank(), ranks, 3);
      expect_same(got, expected, fmt::format("{} ranks, rank {}", ranks, comm.rank()));
      auto stats = strategy->stats();
      EXPECT_EQ(stats["groups"].size(), 4u) << stats.dump();  // three blocks and the root
      for (const auto& g : stats["groups"]) EXPECT_TRUE(g["sharded_between_steps"].get<bool>()) << g.dump();
      EXPECT_EQ(stats["gathered_bytes"], 0) << stats.dump();
    });
}

TEST(ShardingUnits, SizeBasedWrapPicksOnlyModulesThatCanOpenAGuardAndAnUnguardedUnitIsNamedWithItsBytes) {
  const auto expected = single_run(true, 2);
  ::testing::internal::CaptureStderr();
  run_ranks(2, [&](Communicator& comm) {
    auto options = full_shard();
    options.zero.auto_wrap_policy = AutoWrapPolicy::SIZE_BASED_WRAP;
    options.zero.min_num_params = 40;  // every block (and LibTorch's Linear inside them) holds more
    auto strategy = make_parallel_strategy(make_net(true), comm, options);
    std::vector<std::string> units;
    const auto stats = strategy->stats();
    for (const auto& g : stats["groups"]) units.push_back(g["name"]);
    EXPECT_EQ(units, (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2", "plain", "(root)"}));
    expect_same(train(*strategy, comm.rank(), 2, 2), expected, fmt::format("rank {}", comm.rank()));
  });
  const auto err = ::testing::internal::GetCapturedStderr();
  // 6x6 weights and 6 biases in fp32: 168 bytes (already even over 2 ranks).
  EXPECT_NE(err.find("plain ((anonymous namespace)::PlainBlockImpl, 168 B)"), std::string::npos) << err;
  EXPECT_NE(err.find("auto unit = xlr8::unshard(*this);"), std::string::npos) << err;
  EXPECT_EQ(err.find("blocks.0 ("), std::string::npos) << err;  // guarded units are not named
}

TEST(ShardingUnits, AnUnguardedUnitTheConfigListsIsRefusedAtTheFirstBackward) {
  run_ranks(2, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_net(true), comm, full_shard({"PairBlock", "PlainBlock"}));
    try {
      train(*strategy, comm.rank(), 2, 1);
      ADD_FAILURE() << "a listed unit without a guard trained whole";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("fsdp_transformer_layer_cls_to_wrap lists the class of unit plain"), std::string::npos) << what;
      EXPECT_NE(what.find("xlr8::sharded(*this"), std::string::npos) << what;
    }
  });
}

TEST(ShardingUnits, AUnitWithoutGuardThatStartsFreedFailsWithAHint) {
  ::testing::internal::CaptureStderr();
  run_ranks(2, [&](Communicator& comm) {
    auto net = make_net(true);
    auto options = full_shard({"PairBlock", "PlainBlock"});
    options.zero.values_from_rank0 = true;
    auto strategy = make_parallel_strategy(net, comm, options);
    EXPECT_THROW(net->forward(at::randn({6, 4})), c10::Error);
  });
  const auto err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("ever opened xlr8::unshard(*this)"), std::string::npos) << err;
  EXPECT_NE(err.find("plain"), std::string::npos) << err;
}

TEST(ShardingUnits, RanksThatRunUnitsInDifferentOrdersGetAnErrorNamingTheUnitNotAHang) {
  for (bool prefetch : {false, true})
    run_ranks(2, [&](Communicator& comm) {
      auto options = full_shard();
      options.zero.forward_prefetch = prefetch;
      options.zero.backward_prefetch = prefetch ? BackwardPrefetch::BACKWARD_PRE : BackwardPrefetch::NONE;
      auto strategy = make_parallel_strategy(make_net(false), comm, options);
      dynamic_cast<NetImpl&>(*strategy->module()).reversed = comm.rank() == 1;
      try {
        train(*strategy, comm.rank(), 2, 2);
        ADD_FAILURE() << "ranks ran the units in different orders and nothing said so";
      } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("different orders on different ranks in the forward pass: unit 2 of it was blocks.0 on "
                            "rank 0 and blocks.2 on rank 1"),
                  std::string::npos)
            << what;
      }
    }, std::chrono::seconds(20));
}

namespace {

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

std::shared_ptr<RiderNetImpl> make_rider_net() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(6);
  return RiderNet().ptr();
}

StateDict train_rider_net(ParallelStrategy& strategy, int rank, int ranks, int steps) {
  return train_steps<RiderNetImpl>(strategy, rank, ranks, steps, 70);
}

}  // namespace

TEST(ShardingUnits, GuardedModulesMakesEveryGuardedModuleAUnitAndUnguardedOnesRideWithTheirHost) {
  auto single = make_parallel_strategy(make_rider_net(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  const auto expected = train_rider_net(*single, 0, 1, 3);
  ::testing::internal::CaptureStderr();
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      ParallelOptions options;
      options.zero.stage = 3;
      options.zero.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;
      auto strategy = make_parallel_strategy(make_rider_net(), comm, options);
      expect_same(train_rider_net(*strategy, comm.rank(), ranks, 3), expected, fmt::format("{} ranks, rank {}", ranks, comm.rank()));
      const auto stats = strategy->stats();
      std::vector<std::string> groups;
      int64_t whole = 0;
      for (const auto& g : stats["groups"]) {
        groups.push_back(g["name"]);
        whole += g["bytes"].get<int64_t>();
        EXPECT_TRUE(g["sharded_between_steps"].get<bool>()) << g.dump();  // riders too
      }
      EXPECT_EQ(groups, (std::vector<std::string>{"blocks.0.inner", "blocks.0.inner (frozen)", "blocks.1.inner",
                                                  "blocks.1.inner (frozen)", "blocks.2.inner", "blocks.2.inner (frozen)",
                                                  "plain", "(root)"}));
      EXPECT_EQ(stats["gathered_bytes"], 0) << stats.dump();
      // The third step gathered the root (with `plain`) and at most two blocks at a time, never the model.
      EXPECT_LT(stats["step_peak_gathered_bytes"].get<int64_t>(), whole) << stats.dump();
      // A rider's frozen parameter goes when its host's backward is done, not at the end of backward.
      EXPECT_GT(stats["frozen_released_in_backward"].get<int64_t>(), 0) << stats.dump();
    });
  const auto err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("never opened their guard"), std::string::npos) << err;
}

TEST(ShardingUnits, UnderDeepSpeedZero3SettingsUnitsDefaultToGuardedModules) {
  Settings settings;
  settings.deepspeed = DeepSpeedSettings{};
  settings.deepspeed->zero_stage = 3;
  EXPECT_EQ(xlr8::detail::resolve_zero_options({}, settings, 1).auto_wrap_policy, AutoWrapPolicy::GUARDED_MODULES);
  ZeroOptions chosen;
  chosen.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;  // a program's own choice stays
  EXPECT_EQ(xlr8::detail::resolve_zero_options(chosen, settings, 1).auto_wrap_policy, AutoWrapPolicy::TRANSFORMER_BASED_WRAP);
  Settings fsdp;
  fsdp.fsdp = FsdpSettings{};  // FSDP's default stays NO_WRAP
  EXPECT_EQ(xlr8::detail::resolve_zero_options({}, fsdp, 1).auto_wrap_policy, AutoWrapPolicy::NO_WRAP);
}

TEST(ShardingUnits, AStateDictThatDiffersIsRefusedNamingOnlyWhatDiffersBriefly) {
  auto strategy = make_parallel_strategy(make_net(false), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  const auto own = strategy->state_dict(StateDictKind::FULL);
  auto refusal = [&](const StateDict& state) {
    try {
      strategy->load_state_dict(state, StateDictKind::FULL);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  // Saved from a wrapper: every name has "module." in front. The message says so and lists ten names.
  StateDict prefixed;
  for (const auto& [name, t] : own) prefixed.emplace_back("module." + name, t);
  auto what = refusal(prefixed);
  EXPECT_NE(what.find("every missing name is there with \"module.\" in front"), std::string::npos) << what;
  EXPECT_NE(what.find(fmt::format("... and {} more;", 2 * own.size() - 10)), std::string::npos) << what;
  // One tensor of another shape: only it is named, with both shapes.
  StateDict reshaped = own;
  reshaped[1].second = at::zeros({3});
  what = refusal(reshaped);
  EXPECT_NE(what.find(fmt::format("does not match the model ({:?} is Float[6] in the model but Float[3] in the state "
                                  "dict); nothing was loaded",
                                  own[1].first)),
            std::string::npos)
      << what;
}

TEST(ShardingUnits, APersistenceThresholdKeepsSmallParametersWholeAndALeafModuleIsOneUnitGatheredWhole) {
  auto single = make_parallel_strategy(make_rider_net(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  const auto expected = train_rider_net(*single, 0, 1, 3);
  for (int ranks : {2, 3})
    run_ranks(ranks, [&](Communicator& comm) {
      ParallelOptions options;
      options.zero.stage = 3;
      options.zero.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;
      options.zero.param_persistence_threshold = 7;  // the biases (6 and 3 elements) and `shift` (6)
      auto net = make_rider_net();
      xlr8::detail::mark_leaf_module(*net->blocks[1]);  // its `inner` is no unit: blocks.1 holds it whole
      auto strategy = make_parallel_strategy(net, comm, options);
      expect_same(train_rider_net(*strategy, comm.rank(), ranks, 3), expected, fmt::format("{} ranks", ranks));
      std::map<std::string, bool> sharded;
      const auto stats = strategy->stats();
      for (const auto& g : stats["groups"]) sharded[g["name"]] = g["sharded_between_steps"];
      EXPECT_EQ(sharded, (std::map<std::string, bool>{{"blocks.0.inner", true},
                                                       {"blocks.1", true},
                                                       {"blocks.2.inner", true},
                                                       {"plain", true},
                                                       {"(persistent)", false},
                                                       {"(persistent) (frozen)", false},
                                                       {"(root)", true}}));
    });
}

// DeepSpeed's stage3_prefetch_bucket_size / stage3_max_live_parameters instead of FSDP's two-unit limit:
// a bucket of three blocks prefetches all of them at the first block's forward (more than FSDP allows); a
// live bound of two blocks keeps the gathered parameters to two blocks besides the root; an empty bucket
// prefetches nothing. Every run equals one rank.
TEST(ShardingUnits, DeepSpeedsPrefetchBucketAndLiveBoundDecideHowManyUnitsAreGatheredAheadAndNeverChangeResults) {
  const auto expected = single_run(false, 3);
  int64_t block = 0;  // elements of one PairBlock
  for (const auto& p : make_net(false)->blocks[0]->parameters()) block += p.numel();
  enum class Expect { MORE_THAN_FSDP, TWO_BLOCKS, NO_PREFETCH };
  struct Case {
    int64_t max_live, bucket;
    Expect expect;
  };
  for (const auto& c : {Case{1'000'000'000, 1'000'000'000, Expect::MORE_THAN_FSDP},
                        Case{2 * block, 1'000'000'000, Expect::TWO_BLOCKS}, Case{1'000'000'000, 0, Expect::NO_PREFETCH}})
    for (int ranks : {2, 3})
      run_ranks(ranks, [&](Communicator& comm) {
        auto options = full_shard();
        options.zero.forward_prefetch = true;
        options.zero.backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
        options.zero.max_live_elements = c.max_live;
        options.zero.prefetch_bucket_elements = c.bucket;
        auto strategy = make_parallel_strategy(make_net(false), comm, options);
        const auto what = fmt::format("max live {}, bucket {}, {} ranks", c.max_live, c.bucket, ranks);
        expect_same(train(*strategy, comm.rank(), ranks, 3), expected, what);
        const auto stats = strategy->stats();
        int64_t root = 0, one_block = 0;
        for (const auto& g : stats["groups"]) {
          if (g["name"] == "(root)") root += g["bytes"].get<int64_t>();
          if (g["name"] == "blocks.0") one_block += g["bytes"].get<int64_t>();
        }
        ASSERT_GT(one_block, 0) << stats.dump();
        const int64_t peak = stats["step_peak_gathered_bytes"].get<int64_t>();
        const int64_t prefetches = stats["forward_prefetches"].get<int64_t>() + stats["backward_prefetches"].get<int64_t>();
        switch (c.expect) {
          case Expect::MORE_THAN_FSDP: EXPECT_GE(peak, root + 3 * one_block) << what << stats.dump(); break;
          case Expect::TWO_BLOCKS:
            EXPECT_GT(prefetches, 0) << what << stats.dump();
            EXPECT_LE(peak, root + 2 * one_block) << what << stats.dump();
            break;
          case Expect::NO_PREFETCH: EXPECT_EQ(prefetches, 0) << what << stats.dump(); break;
        }
      });
}
