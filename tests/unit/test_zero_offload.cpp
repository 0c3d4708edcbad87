// Offload (ZeroOptions::offload_optimizer / offload_params / offload_ratio): the optimizer steps on master
// shards of its own in host memory, and under stage 3 the parameter shards live there too. On this CPU the
// "host" copies are separate CPU tensors: the same copies, hand-overs and gathers as on a GPU (where the
// GPU check measures the device memory), so the oracle checks their arithmetic.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "deepspeed/deepspeed_plugin.hpp"
#include "xlr8/error.hpp"
#include "zero_fixture.hpp"

using namespace xlr8;
using namespace xlr8::testing::zero;
using xlr8::testing::run_ranks;

namespace {

ParallelOptions offloading(int stage, bool params, double ratio = 1.0) {
  auto o = stage_options(stage);
  o.zero.offload_optimizer = true;
  o.zero.offload_params = params;
  o.zero.offload_ratio = ratio;
  return o;
}

// The storages the module's parameters live in (whole copies, or stage 3's gathered units).
std::set<const void*> parameter_storages(const torch::nn::Module& module) {
  std::set<const void*> out;
  for (const auto& p : module.parameters())
    if (p.storage().nbytes() > 0) out.insert(p.storage().data());
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

}  // namespace

TEST(ZeroOffload, EveryStageOnOneToFourRanksMatchesOneRankWithAccumulationAndClipping) {
  const auto expected = single_run(3, /*micro=*/2, /*max_norm=*/0.05);
  struct Case {
    int stage;
    bool params;
  };
  for (auto c : {Case{1, false}, Case{2, false}, Case{3, false}, Case{3, true}})
    for (int ranks : {1, 2, 3, 4})
      run_ranks(ranks, [&](Communicator& comm) {
        const auto what = fmt::format("stage {}{} on {} ranks, rank {}", c.stage, c.params ? " + parameters" : "", ranks,
                                      comm.rank());
        auto strategy = make_parallel_strategy(make_model(), comm, offloading(c.stage, c.params));
        // One process offloads too: the engine over a group of one, not the single-process strategy.
        EXPECT_EQ(strategy->name(), fmt::format("zero{}", c.stage)) << what;
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05);
        expect_same_run(got, expected, 2e-6, what);
        EXPECT_GT(got.norms.front(), 0.05) << what;  // clipping clipped, on the offloaded gradients
        const auto stats = strategy->stats();
        int64_t trainable = 0, groups = 0;
        for (const auto& g : stats["groups"]) {
          ++groups;
          trainable += !g["frozen"].get<bool>();
          EXPECT_TRUE(g["master_in_host_memory"].get<bool>()) << what << " " << g.dump();
          EXPECT_EQ(g["shard_in_host_memory"].get<bool>(), c.params) << what << " " << g.dump();
        }
        EXPECT_EQ(stats["offloaded_optimizer_groups"], trainable) << what;
        EXPECT_EQ(stats["offloaded_parameter_groups"], c.params ? groups : 0) << what;
        EXPECT_EQ(stats["offload_pinned"], false) << what;  // pinned only for parameters on CUDA
        EXPECT_GT(stats["offload_host_bytes"].get<int64_t>(), 0) << what;
        // The optimizer's leaves are copies of their own, in none of the parameters' memory, and their
        // gradients are the host's too.
        strategy->gather_full_parameters();
        const auto storages = parameter_storages(*strategy->module());
        for (const auto& leaf : strategy->optimizer_parameters())
          if (leaf.numel() > 0) {
            EXPECT_FALSE(storages.count(leaf.storage().data())) << what;
          }
        strategy->release_full_parameters(false);
      });
}

TEST(ZeroOffload, ARatioOffloadsTheFirstGroupsAndStillMatchesBf16MastersStayFp32) {
  const auto expected = single_run(3);
  run_ranks(3, [&](Communicator& comm) {
    // With the parameters offloaded the ratio does not apply (DeepSpeed's rule): every group goes.
    auto both = make_parallel_strategy(make_model(), comm, offloading(3, true, 0.5));
    EXPECT_EQ(both->stats()["offloaded_parameter_groups"], both->stats()["groups"].size());
    auto strategy = make_parallel_strategy(make_model(), comm, offloading(3, false, 0.5));
    auto got = train(*strategy, comm.rank(), 3, 3);
    expect_same_run(got, expected, 2e-6, fmt::format("ratio 0.5, rank {}", comm.rank()));
    const auto stats = strategy->stats();
    std::vector<bool> placed;
    for (const auto& g : stats["groups"])
      if (!g["frozen"].get<bool>()) placed.push_back(g["master_in_host_memory"].get<bool>());
    const auto offloaded = std::count(placed.begin(), placed.end(), true);
    EXPECT_GT(offloaded, 0);
    EXPECT_LT(offloaded, static_cast<int64_t>(placed.size()));
    EXPECT_TRUE(std::is_sorted(placed.begin(), placed.end(), std::greater<>())) << "the first groups go";
  });
  // Parameters computing in bf16: the host keeps fp32 masters, the shards in bf16 (both offloaded).
  run_ranks(2, [&](Communicator& comm) {
    auto options = offloading(3, true);
    options.zero.param_dtype = at::kBFloat16;
    auto strategy = make_parallel_strategy(make_model(), comm, options);
    for (const auto& p : strategy->optimizer_parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    auto got = train(*strategy, comm.rank(), 2, 2, 1, 0, /*bf16=*/true);
    for (const auto& [name, t] : got.params) {
      EXPECT_EQ(t.scalar_type(), at::kFloat) << name;  // the masters, not the bf16 copies
      EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name;
    }
  });
}

TEST(ZeroOffload, StateDictsLoadIntoTheHostMastersAndTheParameterShards) {
  run_ranks(3, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, offloading(3, true));
    auto state = strategy->state_dict(StateDictKind::FULL);
    float k = 0;
    for (auto& [name, t] : state) t = t.detach().clone().fill_(k += 0.5f);
    strategy->load_state_dict(state, StateDictKind::FULL);
    auto back = strategy->state_dict(StateDictKind::FULL);
    for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(at::equal(back[i].second, state[i].second)) << back[i].first;
    // The forward computes with what was loaded: its gathers copy the host shards.
    strategy->gather_full_parameters();
    auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
    EXPECT_TRUE(at::equal(net.head->weight, std::find_if(state.begin(), state.end(), [](auto& e) {
                                              return e.first == "head.weight";
                                            })->second));
    strategy->release_full_parameters(false);
  });
}

TEST(ZeroOffload, WhatCannotBeOffloadedIsRefusedNamingTheFix) {
  auto one = [](ParallelOptions options) {
    run_ranks(2, [&](Communicator& comm) { make_parallel_strategy(make_model(), comm, options); });
  };
  auto params_at_stage_2 = offloading(2, true);
  EXPECT_NE(error_of([&] { one(params_at_stage_2); }).find("offloading parameters needs ZeRO stage 3 (FULL_SHARD); stage 2"),
            std::string::npos);
  auto ratio_at_stage_2 = offloading(2, false, 0.5);
  EXPECT_NE(error_of([&] { one(ratio_at_stage_2); }).find("an offload ratio below 1 (0.5) needs ZeRO stage 3"),
            std::string::npos);
  auto zero_ratio = offloading(3, false, 0);
  EXPECT_NE(error_of([&] { one(zero_ratio); }).find("offload ratio 0 must be above 0 and at most 1"), std::string::npos);
  auto ddp = offloading(0, false);
  EXPECT_NE(error_of([&] {
              make_parallel_strategy(make_model(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), ddp);
            }).find("offload (offload_optimizer / offload_param, fsdp_offload_params, nvme) needs ZeRO stage 1, 2 or 3"),
            std::string::npos);
}

TEST(ZeroOffload, DeepSpeedsOffloadSectionsMapOntoTheEngine) {
  deepspeed::ZeroConfig z;
  z.stage = 3;
  z.offload_optimizer.device = "cpu";
  z.offload_optimizer.ratio = 0.3;
  z.offload_param.device = "cpu";
  z.offload_param.pin_memory = false;
  ParallelOptions parallel;
  xlr8::shard::apply_zero_config(z, parallel);
  EXPECT_TRUE(parallel.zero.offload_optimizer);
  EXPECT_TRUE(parallel.zero.offload_params);
  EXPECT_DOUBLE_EQ(parallel.zero.offload_ratio, 0.3);
  EXPECT_FALSE(parallel.zero.offload_pin_memory);
  // Each section's pin_memory counts only when that section offloads; a ratio without offload is not checked.
  z.offload_param.device = "none";
  ParallelOptions optimizer_only;
  xlr8::shard::apply_zero_config(z, optimizer_only);
  EXPECT_TRUE(optimizer_only.zero.offload_pin_memory);
  EXPECT_FALSE(optimizer_only.zero.offload_params);
  auto not_offloaded = stage_options(2);
  not_offloaded.zero.offload_ratio = 0.5;
  run_ranks(2, [&](Communicator& comm) {
    EXPECT_NO_THROW(make_parallel_strategy(make_model(), comm, not_offloaded));
  });
  // Device "nvme" (the disk tier) is test_zero_disk.cpp's.
}
