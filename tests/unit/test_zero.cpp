// ZeRO stages 1-3 in one process: ranks are threads over Communicator::in_process. Every stage must
// reproduce one rank on the global batch (the oracle), hold the bytes it promises, and free what it
// gathers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <mutex>

#include "parallel/shard/zero_strategy.hpp"
#include "thread_ranks.hpp"
#include "zero_fixture.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/unshard.hpp"

using namespace xlr8;
using xlr8::testing::run_ranks;

using namespace xlr8::testing::zero;

TEST(Zero, EveryStageOnTwoThreeAndFourRanksMatchesOneRank) {
  const auto expected = single_run(4);
  for (int stage : {1, 2, 3})
    for (int ranks : {2, 3, 4})
      run_ranks(ranks, [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(), comm, stage_options(stage));
        EXPECT_EQ(strategy->name(), fmt::format("zero{}", stage));
        EXPECT_FALSE(strategy->replicated());
        auto got = train(*strategy, comm.rank(), ranks, 4);
        expect_same_run(got, expected, 2e-6, fmt::format("stage {} on {} ranks, rank {}", stage, ranks, comm.rank()));
      });
}

TEST(Zero, AccumulationAndClippingMatchOneRank) {
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  for (int stage : {1, 2, 3})
    run_ranks(3, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(), comm, stage_options(stage));
      auto got = train(*strategy, comm.rank(), 3, 3, 2, 0.05);
      expect_same_run(got, expected, 2e-6, fmt::format("stage {}, rank {}", stage, comm.rank()));
      EXPECT_GT(got.norms.front(), 0.05);  // the clipping really clipped
    });
}

TEST(Zero, WithoutReductionRanksDrift) {
  // The oracle can fail: a strategy that skipped the reduction leaves each rank on its own rows.
  std::vector<at::Tensor> first(2);
  run_ranks(2, [&](Communicator& comm) {
    auto off = std::make_shared<GradientState>();
    off->sync_gradients = false;
    auto strategy = make_parallel_strategy(make_model(), comm, stage_options(3), off);
    auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
    auto batch = global_batch(0);
    strategy->begin_step(false);
    torch::nll_loss(torch::log_softmax(net.forward(batch.x.narrow(0, comm.rank() * 6, 6)), 1),
                    batch.y.narrow(0, comm.rank() * 6, 6))
        .backward();
    strategy->end_step();
    // Off the boundary the whole gradients stay on the parameters, unreduced.
    first[comm.rank()] = net.head->weight.grad().clone();
  });
  EXPECT_GT((first[0] - first[1]).abs().max().item<double>(), 1e-4);
}

TEST(Zero, StageThreeFreesUnitsBetweenStepsAndGathersAtMostRootPlusOneUnit) {
  run_ranks(2, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, stage_options(3));
    train(*strategy, comm.rank(), 2, 2);
    auto stats = strategy->stats();
    EXPECT_EQ(stats["gathered_bytes"], 0) << stats.dump();  // every unit freed between steps
    int64_t root = 0, largest_unit = 0, total = 0;
    for (const auto& g : stats["groups"]) {
      EXPECT_TRUE(g["sharded_between_steps"].get<bool>()) << g.dump();
      const int64_t bytes = g["bytes"];
      total += bytes;
      if (g["name"] == "(root)") root = bytes;
      else largest_unit = std::max(largest_unit, bytes);
    }
    EXPECT_EQ(stats["groups"].size(), 4u);  // three blocks and the root
    EXPECT_EQ(stats["step_peak_gathered_bytes"].get<int64_t>(), root + largest_unit) << stats.dump();
    EXPECT_LT(stats["step_peak_gathered_bytes"].get<int64_t>(), total);
    // Freed parameters keep their shapes; summon_full_params-style gathering shows current values.
    auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
    auto* block = net.blocks[0]->as<TinyBlockImpl>();
    EXPECT_EQ(block->fc->weight.storage().nbytes(), 0u);
    EXPECT_EQ(block->fc->weight.sizes(), (std::vector<int64_t>{2 * kWidth + 1, kWidth}));
    strategy->gather_full_parameters();
    EXPECT_GT(block->fc->weight.storage().nbytes(), 0u);
    auto full = strategy->state_dict(StateDictKind::FULL);
    EXPECT_TRUE(at::equal(block->fc->weight, std::find_if(full.begin(), full.end(), [](auto& e) {
                                               return e.first == "blocks.0.fc.weight";
                                             })->second));
    strategy->release_full_parameters(false);
    EXPECT_EQ(block->fc->weight.storage().nbytes(), 0u);
    // FULL_ON_MAIN: the values on the group's first rank only; shapes elsewhere, and nothing stays gathered.
    auto on_main = strategy->state_dict(StateDictKind::FULL_ON_MAIN);
    ASSERT_EQ(on_main.size(), full.size());
    for (size_t i = 0; i < full.size(); ++i) {
      EXPECT_EQ(on_main[i].second.sizes(), full[i].second.sizes());
      if (comm.rank() == 0) EXPECT_TRUE(at::equal(on_main[i].second, full[i].second)) << full[i].first;
      else EXPECT_TRUE(on_main[i].second.is_meta()) << full[i].first;
    }
    EXPECT_EQ(strategy->stats()["gathered_bytes"], 0);
  });
}

TEST(Zero, ARootWithoutGuardStaysWholeAndStillMatches) {
  const auto expected = single_run(3);
  run_ranks(2, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(/*guard_root=*/false), comm, stage_options(3));
    auto got = train(*strategy, comm.rank(), 2, 3);
    expect_same_run(got, expected, 2e-6, "unguarded root");
    const auto stats = strategy->stats();  // kept: a range over a temporary's member would dangle
    ASSERT_FALSE(stats["groups"].empty());
    for (const auto& g : stats["groups"])
      EXPECT_EQ(g["sharded_between_steps"].get<bool>(), g["name"] != "(root)") << g.dump();
  });
}

TEST(Zero, FrozenParametersAreShardedByStageThreeAndEveryStageMatchesOneRank) {
  // With accumulation and clipping; the optimizer is given every parameter, frozen ones included.
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05, false, /*frozen=*/true);
  auto initial = make_model(true, true);
  for (const auto& name : {"in.weight", "blocks.0.out.weight", "blocks.2.fc.weight"}) {
    auto it = std::find_if(expected.params.begin(), expected.params.end(), [&](auto& e) { return e.first == name; });
    ASSERT_NE(it, expected.params.end());
    EXPECT_TRUE(at::equal(it->second, initial->named_parameters()[name])) << name << " is frozen";
  }
  for (int stage : {1, 2, 3})
    for (int ranks : {2, 3, 4})
      run_ranks(ranks, [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(true, true), comm, stage_options(stage));
        // A forward whose graph is dropped without backward (an evaluation outside NoGradGuard) must not
        // keep the frozen groups waiting for it.
        dynamic_cast<TinyNetImpl&>(*strategy->module()).forward(global_batch(7).x.narrow(0, 0, 2));
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
        expect_same_run(got, expected, 2e-6, fmt::format("stage {} on {} ranks, rank {}", stage, ranks, comm.rank()));
        if (stage != 3) return;
        // Every unit's frozen parameters are a group of their own, sharded between steps like the rest.
        auto stats = strategy->stats();
        int frozen_groups = 0;
        for (const auto& g : stats["groups"]) {
          frozen_groups += g["frozen"].get<bool>();
          EXPECT_TRUE(g["sharded_between_steps"].get<bool>()) << g.dump();
        }
        EXPECT_EQ(frozen_groups, 4) << stats.dump();  // the root's, block 0 (all of it), blocks 1 and 2
        EXPECT_EQ(stats["gathered_bytes"], 0) << stats.dump();
        auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
        EXPECT_EQ(net.blocks[1]->as<TinyBlockImpl>()->fc->weight.storage().nbytes(), 0u);
        EXPECT_EQ(net.in->weight.storage().nbytes(), 0u);
        // Blocks 1 and 2 free theirs when their own backward is over (3 steps x 2 micro-batches), not
        // at the end of backward; block 0's output needs no backward, so it frees them after forward.
        EXPECT_EQ(stats["frozen_released_in_backward"], 2 * 3 * 2) << stats.dump();
      });
}

TEST(Zero, EmptyInitBuildsOnTheMetaDeviceAndToEmptyGivesUntouchedMemory) {
  auto resident_mb = [] {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024;
    return 0.0;
  };
  const double before = resident_mb();
  std::shared_ptr<torch::nn::LinearImpl> big;
  at::Tensor unregistered;
  {
    EmptyInitScope empty;
    big = torch::nn::Linear(8192, 8192).ptr();  // 256 MB of weights, initialised by kaiming_uniform_
    unregistered = torch::ones({4, 4}).triu();  // 2-D: 2.x's meta kernel refuses 1-D (1.13's did not)
  }
  EXPECT_TRUE(big->weight.is_meta());
  EXPECT_TRUE(unregistered.is_meta());  // fails loudly when used, rather than holding garbage
  auto* identity = big->weight.unsafeGetTensorImpl();
  to_empty(*big, at::kCPU);
  EXPECT_FALSE(big->weight.is_meta());
  EXPECT_EQ(big->weight.unsafeGetTensorImpl(), identity);  // the same tensor: members and autograd see it
  EXPECT_EQ(big->weight.sizes(), (std::vector<int64_t>{8192, 8192}));
  EXPECT_TRUE(big->weight.requires_grad());
  EXPECT_LT(resident_mb() - before, 64) << "the weights' memory was written";
  // It trains like any parameter once it has values.
  {
    torch::NoGradGuard no_grad;
    big->weight.fill_(0.5);
    big->bias.zero_();
  }
  big->forward(torch::ones({2, 8192})).sum().backward();
  EXPECT_EQ(big->weight.grad().sum().item<double>(), 2.0 * 8192 * 8192);
  // The scope is gone: operators compute again (leaving the Meta key's backend bit behind would not).
  EXPECT_TRUE(at::equal(torch::ones({3}) + 1, torch::full({3}, 2.0f)));
  big.reset();
}

TEST(Zero, ModelsBuiltEmptyTakeRankZerosValuesAndTheirUnitsStartFreed) {
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  for (int ranks : {2, 3, 4})
    run_ranks(ranks, [&](Communicator& comm) {
      std::shared_ptr<TinyNetImpl> net;
      if (comm.rank() == 0) {
        net = make_model();
      } else {
        {
          EmptyInitScope empty;
          net = TinyNet(true).ptr();
        }
        to_empty(*net, at::kCPU);  // no values: whatever the memory held
      }
      auto options = stage_options(3);
      options.zero.values_from_rank0 = true;
      auto strategy = make_parallel_strategy(net, comm, options);
      EXPECT_TRUE(strategy->stats()["values_from_rank0"].get<bool>());
      EXPECT_EQ(net->blocks[1]->as<TinyBlockImpl>()->fc->weight.storage().nbytes(), 0u);  // freed from the start
      EXPECT_GT(net->head->weight.storage().nbytes(), 0u);  // the root: whole until its guard runs
      auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
      expect_same_run(got, expected, 2e-6, fmt::format("{} ranks, rank {}", ranks, comm.rank()));
    });
}

// A unit without a guard that starts freed: test_sharding_units.cpp (SIZE_BASED_WRAP no longer picks
// LibTorch's own modules, which this test used to get one).

TEST(Zero, FrozenSetsMustAgreeAcrossRanksAndStayAsPrepared) {
  run_ranks(2, [&](Communicator& comm) {
    auto net = make_model(true, true);
    if (comm.rank() == 1) net->in->weight.set_requires_grad(true);
    try {
      make_parallel_strategy(net, comm, stage_options(3));
      ADD_FAILURE() << "different frozen parameters were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in.weight float32[10, 6] (frozen)"), std::string::npos) << e.what();
    }
  });
  for (int stage : {2, 3})
    run_ranks(2, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(true, true), comm, stage_options(stage));
      auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
      net.blocks[1]->as<TinyBlockImpl>()->fc->weight.set_requires_grad(true);  // unfrozen after prepare
      try {
        train(*strategy, comm.rank(), 2, 1);
        ADD_FAILURE() << "stage " << stage << ": a parameter unfrozen after prepare trained silently";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("blocks.1.fc.weight was frozen"), std::string::npos) << e.what();
      }
    });
}

// An autograd node whose backward fails: PyTorch then ends the backward without its final callbacks.
struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("this node fails");
  }
};

TEST(Zero, ABackwardThatFailsHalfwayLeavesTheNextStepsTraining) {
  // Stage 0 is DDP, which armed its end-of-backward callback the same way.
  const auto expected = single_run(2);
  for (int stage : {0, 2, 3})
    run_ranks(2, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(), comm, stage_options(stage));
      auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
      // Made before forward, the failing node runs after the main graph's gradients began arriving.
      auto failing = FailingBackward::apply(net.in->weight).sum() * 0;
      auto batch = global_batch(9);
      strategy->begin_step(false);
      auto loss = torch::nll_loss(torch::log_softmax(net.forward(batch.x.narrow(0, comm.rank() * 6, 6)), 1),
                                  batch.y.narrow(0, comm.rank() * 6, 6));
      EXPECT_THROW((loss + failing).backward(), std::exception);
      strategy->end_step();
      for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();  // as zero_grad after a failed step
      auto got = train(*strategy, comm.rank(), 2, 2);
      expect_same_run(got, expected, 2e-6, fmt::format("stage {} after a failed backward, rank {}", stage, comm.rank()));
    });
}

TEST(Zero, OptimizerStateExistsOnlyForTheShard) {
  run_ranks(3, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, stage_options(2));
    torch::optim::AdamW opt(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2));
    strategy->bind_optimizer(opt);
    int64_t total = 0, in_optimizer = 0;
    for (auto& p : strategy->module()->parameters()) total += p.numel();
    for (auto& p : opt.param_groups().front().params()) in_optimizer += p.numel();
    // Padding never reaches the optimizer: the shards add up to the model over the ranks.
    auto all = comm.all_gather_object(std::to_string(in_optimizer));
    int64_t sum = 0;
    for (auto& s : all) sum += std::stoll(s);
    EXPECT_EQ(sum, total);
    EXPECT_LE(in_optimizer, total / 3 + 3);
  });
}

TEST(Zero, LoadStateDictReachesEveryShard) {
  run_ranks(3, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, stage_options(3));
    auto state = strategy->state_dict(StateDictKind::FULL);
    float k = 0;
    for (auto& [name, t] : state) t = t.detach().clone().fill_(k += 0.5f);
    strategy->load_state_dict(state, StateDictKind::FULL);
    auto back = strategy->state_dict(StateDictKind::FULL);
    for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(at::equal(back[i].second, state[i].second)) << back[i].first;
    StateDict wrong = state;
    wrong.front().second = at::zeros({2, 2});
    EXPECT_THROW(strategy->load_state_dict(wrong, StateDictKind::FULL), ConfigError);
  });
}

TEST(Zero, UnknownLayerClassNamesTheClassesThatExist) {
  run_ranks(2, [&](Communicator& comm) {
    auto options = stage_options(3);
    options.zero.layer_classes = {"Blok"};
    try {
      make_parallel_strategy(make_model(), comm, options);
      FAIL();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("\"Blok\""), std::string::npos) << what;
      EXPECT_NE(what.find("TinyBlockImpl"), std::string::npos) << what;
    }
  });
}

TEST(Zero, HybridShardingOverTwoGroupsOfTwoMatchesOneRank) {
  // HSDP: ranks {0, 1} and {2, 3} each shard the model; ranks 0 and 2 (1 and 3) hold the same shard and
  // average it. Stage 3 is HYBRID_SHARD, stage 2 HYBRID_SHARD_ZERO2.
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  for (int stage : {2, 3})
    run_ranks(4, [&](Communicator& comm) {
      auto options = stage_options(stage);
      options.zero.hybrid_shard_size = 2;
      auto strategy = make_parallel_strategy(make_model(), comm, options);
      EXPECT_EQ(strategy->stats()["ranks"], 2);
      EXPECT_EQ(strategy->stats()["replicas"], 2);
      auto got = train(*strategy, comm.rank(), 4, 3, 2, 0.05);
      expect_same_run(got, expected, 2e-6, fmt::format("hybrid stage {}, rank {}", stage, comm.rank()));
    });
  run_ranks(4, [&](Communicator& comm) {
    auto options = stage_options(3);
    options.zero.hybrid_shard_size = 3;  // 4 ranks do not split into groups of 3
    EXPECT_THROW(make_parallel_strategy(make_model(), comm, options), ConfigError);
  });
}

TEST(Zero, OnAMeshHybridShardingShardsOverDpShardTimesCpAndWithoutThemIsRefused) {
  Settings settings;
  settings.fsdp = FsdpSettings{};
  settings.fsdp->sharding_strategy = ShardingStrategy::HYBRID_SHARD;
  settings.parallelism = ParallelismSettings{.dp_replicate = 2, .dp_shard = 2, .cp = 2, .tp = 2};
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, settings, /*node_size=*/16).hybrid_shard_size, 4);  // dp_shard x cp
  settings.parallelism->cp = 1;
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, settings, 8).hybrid_shard_size, 2);
  // dp_replicate x tp only: the machine's 4 ranks would cut across the tp peers.
  settings.parallelism->dp_shard = 1;
  try {
    xlr8::shard::resolve_zero_options({}, settings, 4);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "fsdp_sharding_strategy HYBRID_SHARD shards over parallelism_config_dp_shard_size, which is 1 on this mesh "
              "(dp_replicate 2 x dp_shard 1 x cp 1 x sp 1 x tp 2); set parallelism_config_dp_shard_size above 1, or use "
              "FULL_SHARD to shard over every data-parallel rank");
  }
  settings.parallelism.reset();  // no mesh: HSDP within each machine, as before
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, settings, 4).hybrid_shard_size, 4);
}

TEST(Zero, Bf16ParametersWithFp32MasterShardsStayCloseToOneRankUnderAutocast) {
  // FSDP's MixedPrecision: parameters gathered and computed in bf16, the optimizer on fp32 shards,
  // gradients reduced in bf16 (default) or fp32. The reference is the same precision policy on one
  // rank (not an fp32 run: bf16 computes differently); splitting the batch changes the bf16 rounding of the
  // gradients, hence the bf16 tolerance.
  TrainRun expected;
  run_ranks(1, [&](Communicator& comm) {
    auto options = stage_options(3);
    options.zero.param_dtype = at::kBFloat16;
    auto one = xlr8::shard::make_zero_strategy(make_model(), comm, options, nullptr);
    expected = train(*one, 0, 1, 4, 1, 0, /*bf16=*/true);
  });
  for (int stage : {1, 2, 3})
    for (bool fp32_reduce : {false, true})
      run_ranks(3, [&](Communicator& comm) {
        auto options = stage_options(stage);
        options.zero.param_dtype = at::kBFloat16;
        if (fp32_reduce) options.zero.reduce_dtype = at::kFloat;
        auto strategy = make_parallel_strategy(make_model(), comm, options);
        auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
        EXPECT_EQ(net.head->weight.scalar_type(), at::kBFloat16);  // what forward computes with
        for (auto& p : strategy->optimizer_parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
        auto got = train(*strategy, comm.rank(), 3, 4, 1, 0, /*bf16=*/true);
        {  // one more backward: the optimizer's leaves get fp32 gradients
          AutocastScope autocast(c10::DeviceType::CPU, at::kBFloat16);
          auto batch = global_batch(0);
          net.forward(batch.x.narrow(0, comm.rank() * 4, 4)).sum().backward();
        }
        for (auto& p : strategy->optimizer_parameters())
          if (p.numel() > 0) {
            EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
          }
        // The full state dict is the fp32 masters. Adam's normalised steps turn bf16 rounding of small
        // gradients into whole steps of lr, so compare on average: the runs differ by a small fraction
        // of how far training moved the parameters.
        ASSERT_EQ(got.params.size(), expected.params.size());
        auto initial = module_state_dict(*make_model());
        double difference = 0, movement = 0, count = 0;
        for (size_t i = 0; i < got.params.size(); ++i) {
          EXPECT_EQ(got.params[i].second.scalar_type(), at::kFloat) << got.params[i].first;
          difference += (got.params[i].second - expected.params[i].second).abs().sum().item<double>();
          movement += (expected.params[i].second - initial[i].second).abs().sum().item<double>();
          count += static_cast<double>(got.params[i].second.numel());
        }
        EXPECT_LT(difference, 0.1 * movement) << "stage " << stage << ": mean difference " << difference / count
                                              << ", mean movement " << movement / count;
        // Loading a state dict reaches the masters and the bf16 copies alike.
        strategy->load_state_dict(expected.params, StateDictKind::FULL);
        auto back = strategy->state_dict(StateDictKind::FULL);
        for (size_t i = 0; i < back.size(); ++i)
          EXPECT_TRUE(at::equal(back[i].second, expected.params[i].second)) << back[i].first;
        strategy->gather_full_parameters();
        EXPECT_TRUE(at::equal(net.head->weight, std::find_if(expected.params.begin(), expected.params.end(), [](auto& e) {
                                                  return e.first == "head.weight";
                                                })->second.to(at::kBFloat16)));
        strategy->release_full_parameters(false);
      });
}

