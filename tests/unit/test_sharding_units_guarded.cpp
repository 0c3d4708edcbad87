// GUARDED_MODULES, DeepSpeed ZeRO-3's granularity: guarded modules are units, unguarded ones (the model's own
// classes, xlr8's and LibTorch's layers) ride with their host, the root included. Ranks are threads.
#include "sharding_unit_models.hpp"

using namespace xlr8::testing::units;

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
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, settings, 1).auto_wrap_policy, AutoWrapPolicy::GUARDED_MODULES);
  ZeroOptions chosen;
  chosen.auto_wrap_policy = AutoWrapPolicy::TRANSFORMER_BASED_WRAP;  // a program's own choice stays
  EXPECT_EQ(xlr8::shard::resolve_zero_options(chosen, settings, 1).auto_wrap_policy, AutoWrapPolicy::TRANSFORMER_BASED_WRAP);
  Settings fsdp;
  fsdp.fsdp = FsdpSettings{};  // FSDP's default stays NO_WRAP
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, fsdp, 1).auto_wrap_policy, AutoWrapPolicy::NO_WRAP);
}
TEST(ShardingUnits, UnderDeepSpeedZero3ATiedXlr8EmbeddingHeadIsTheRootsAndNoUnitIsNamedUnguarded) {
  auto single = make_parallel_strategy(make_tied_lm(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  const auto expected = train_steps<TiedLmImpl>(*single, 0, 1, 3, 90);
  Settings settings;  // --use_deepspeed --zero_stage 3
  settings.deepspeed = DeepSpeedSettings{.zero_stage = 3};
  ParallelOptions options;
  options.zero = xlr8::shard::resolve_zero_options({}, settings, 1);
  ::testing::internal::CaptureStderr();
  for (int ranks : {2, 3})
    run_ranks(ranks, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_tied_lm(), comm, options);
      expect_same(train_steps<TiedLmImpl>(*strategy, comm.rank(), ranks, 3, 90), expected, fmt::format("{} ranks", ranks));
      std::vector<std::string> groups;
      const auto stats = strategy->stats();
      for (const auto& g : stats["groups"]) {
        groups.push_back(g["name"]);
        EXPECT_TRUE(g["sharded_between_steps"].get<bool>()) << g.dump();  // `plain`, the root's rider, too
      }
      EXPECT_EQ(groups, (std::vector<std::string>{"blocks.0.inner", "blocks.0.inner (frozen)", "blocks.1.inner",
                                                  "blocks.1.inner (frozen)", "plain", "(root)"}));  // embed: the root's
    });
  const auto err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("never opened"), std::string::npos) << err;
  EXPECT_EQ(err.find("xlr8::nn::"), std::string::npos) << err;
}
