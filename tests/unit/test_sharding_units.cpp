// Stage-3 units as a model author meets them: a forward that returns several tensors (xlr8::sharded), a
// unit whose guard never opens, and ranks that run units in different orders. Ranks are threads.
#include "sharding_unit_models.hpp"

using namespace xlr8::testing::units;

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

TEST(ShardingUnits, TransformerBasedWrapWithoutLayerClassesTakesTheBlocksTheModelDeclares) {
  // Accelerate's fallback when fsdp_transformer_layer_cls_to_wrap is absent: the model's _no_split_modules.
  const auto expected = single_run(false, 3);
  run_ranks(2, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_declaring_net({"PairBlock"}), comm, full_shard({}));
    expect_same(train(*strategy, comm.rank(), 2, 3), expected, fmt::format("rank {}", comm.rank()));
    const auto stats = strategy->stats();
    ASSERT_EQ(stats["groups"].size(), 4u) << stats.dump();  // three blocks and the root
    EXPECT_EQ(stats["groups"][0]["name"], "blocks.0") << stats.dump();
  });
  // The key, when set, wins over the declaration.
  EXPECT_EQ(xlr8::shard::plan_units(*make_declaring_net({"Absent"}), full_shard().zero).size(), 4u);
}

TEST(ShardingUnits, TransformerBasedWrapWithoutLayerClassesOrADeclarationSaysWhatToAdd) {
  auto refusal = [](const std::shared_ptr<NetImpl>& net) {
    try {
      xlr8::shard::plan_units(*net, full_shard({}).zero);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const auto none = refusal(make_net(false));
  for (auto piece : {"TRANSFORMER_BASED_WRAP", "set fsdp_transformer_layer_cls_to_wrap", "PairBlockImpl",
                     "NetImpl also from xlr8::NoSplitModules", "no_split_modules()", "e.g. {\"Block\"}"})
    EXPECT_NE(none.find(piece), std::string::npos) << piece << " in: " << none;
  EXPECT_EQ(none.find('\n'), std::string::npos) << none;
  EXPECT_NE(refusal(make_declaring_net({})).find("NoSplitModules"), std::string::npos);  // an empty declaration
  // A declared class the model lacks is named as the key's would be.
  const auto unknown = refusal(make_declaring_net({"Blok"}));
  EXPECT_NE(unknown.find("the model's no_split_modules(): the model has no module of class \"Blok\""),
            std::string::npos)
      << unknown;
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
  EXPECT_NE(err.find("plain (xlr8::testing::units::PlainBlockImpl, 168 B)"), std::string::npos) << err;
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
      xlr8::shard::mark_leaf_module(*net->blocks[1]);  // its `inner` is no unit: blocks.1 holds it whole
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


// A weight tied between two blocks (units): it belongs to their common unit, the root, which stays gathered while
// either uses it. Under the first block's unit it was freed before the second block's forward ("setStorage ... out
// of bounds", a raw c10::Error).
TEST(ShardingUnits, AWeightTiedAcrossTwoUnitsLivesInTheirCommonUnitAndTrainsAsOneRank) {
  auto tied = [] {
    auto net = make_net(false);
    auto& first = *net->blocks[0]->as<PairBlockImpl>();
    auto& second = *net->blocks[1]->as<PairBlockImpl>();
    second.side = second.replace_module("side", xlr8::testing::tied_linear(first.side->weight));  // block 0's weight
    return net;
  };
  const auto plan = xlr8::shard::plan_units(*tied(), full_shard().zero);
  ASSERT_EQ(plan.back().label, "(root)");
  const auto& root_names = plan.back().groups.front().names;
  EXPECT_NE(std::find(root_names.begin(), root_names.end(), "blocks.0.side.weight"), root_names.end());
  auto single = make_parallel_strategy(tied(), Communicator::in_process(xlr8::testing::unique_key(), 0, 1), {});
  const auto expected = train(*single, 0, 1, 3);
  for (int ranks : {2, 3})
    run_ranks(ranks, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(tied(), comm, full_shard());
      expect_same(train(*strategy, comm.rank(), ranks, 3), expected, fmt::format("{} ranks, rank {}", ranks, comm.rank()));
    });
}
