// Environment protocol: torchrun / Accelerate / Slurm / OpenMPI / PMI variables in, the same variables out.
#include <gtest/gtest.h>

#include "xlr8/error.hpp"
#include "xlr8/settings.hpp"

using namespace xlr8;

TEST(Topology, NoVariablesMeansOneProcess) {
  Topology t = topology_from_env(Env());
  EXPECT_EQ(t.world_size, 1);
  EXPECT_EQ(t.rank, 0);
  EXPECT_FALSE(t.distributed());
  EXPECT_EQ(t.source, "none");
}

TEST(Topology, TorchrunVariables) {
  Topology t = topology_from_env(Env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                      {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(t.source, "torchrun");
  EXPECT_EQ(t.rank, 5);
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.local_world_size, 4);
  EXPECT_EQ(t.node_rank, 1);
  EXPECT_EQ(t.num_nodes, 2);
  EXPECT_EQ(t.master_addr, "10.0.0.1");
  EXPECT_EQ(t.master_port, 1234);
}

TEST(Topology, NodeRankDerivedWhenAbsent) {
  Topology t = topology_from_env(Env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}));
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.node_rank, 1);
  EXPECT_EQ(t.num_nodes, 2);
}

TEST(Topology, SlurmFallback) {
  Topology t = topology_from_env(Env({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                      {"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},
                                      {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "node0"}}));
  EXPECT_EQ(t.source, "slurm");
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.local_world_size, 2);
  EXPECT_EQ(t.node_rank, 1);
  EXPECT_EQ(t.num_nodes, 2);
}

TEST(Topology, OpenMpiAndPmiFallbacks) {
  Topology o = topology_from_env(Env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(o.source, "openmpi");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.local_world_size, 2);
  EXPECT_EQ(o.master_addr, "127.0.0.1");  // one node: loopback default
  Topology p = topology_from_env(Env({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}}));
  EXPECT_EQ(p.source, "pmi");
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.world_size, 3);
}

TEST(Topology, TorchrunWinsOverSlurm) {
  Topology t = topology_from_env(Env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(t.source, "torchrun");
  EXPECT_EQ(t.world_size, 2);
}

TEST(Topology, BadValuesNameTheVariable) {
  try {
    topology_from_env(Env({{"RANK", "x"}, {"WORLD_SIZE", "2"}}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=\"x\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(topology_from_env(Env({{"RANK", "2"}, {"WORLD_SIZE", "2"}})), ConfigError);
  EXPECT_THROW(topology_from_env(Env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})), ConfigError);
  try {  // several nodes need to know where rank 0 is
    topology_from_env(Env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos);
  }
}

TEST(Settings, RoundTripThroughEnvironment) {
  Settings s;
  s.mixed_precision = MixedPrecision::BF16;
  s.gradient_accumulation_steps = 4;
  FsdpSettings f;
  f.sharding_strategy = ShardingStrategy::SHARD_GRAD_OP;
  f.auto_wrap_policy = "TRANSFORMER_BASED_WRAP";
  f.transformer_layer_cls_to_wrap = {"Block", "Embedding"};
  f.offload_params = true;
  f.backward_prefetch = "BACKWARD_PRE";
  s.fsdp = f;
  s.parallelism = ParallelismSettings{.dp_replicate = 2, .dp_shard = 2};
  auto vars = settings_to_env(s);
  EXPECT_EQ(vars.at("ACCELERATE_USE_FSDP"), "true");
  EXPECT_EQ(vars.at("FSDP_SHARDING_STRATEGY"), "SHARD_GRAD_OP");
  EXPECT_EQ(vars.at("FSDP_TRANSFORMER_CLS_TO_WRAP"), "Block,Embedding");
  EXPECT_EQ(vars.at("ACCELERATE_MIXED_PRECISION"), "bf16");
  EXPECT_EQ(settings_from_env(Env(vars)), s);
}

TEST(Settings, DeepSpeedRoundTrip) {
  Settings s;
  DeepSpeedSettings d;
  d.zero_stage = 3;
  d.offload_optimizer_device = "cpu";
  d.gradient_clipping = 1.0;
  d.zero3_save_16bit_model = true;
  s.deepspeed = d;
  s.gradient_accumulation_steps = 2;
  auto vars = settings_to_env(s);
  EXPECT_EQ(vars.at("ACCELERATE_USE_DEEPSPEED"), "true");
  EXPECT_EQ(vars.at("ACCELERATE_DEEPSPEED_ZERO_STAGE"), "3");
  EXPECT_EQ(settings_from_env(Env(vars)), s);
}

TEST(Settings, TheLaunchsAccumulationWinsAndAnExplicitOneIsAChoiceToo) {
  auto unset = settings_from_env(Env({}));
  EXPECT_FALSE(unset.gradient_accumulation_steps);
  EXPECT_FALSE(settings_to_env(unset).contains("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"));
  EXPECT_EQ(gradient_accumulation_steps_for(unset, 3, false), 3);
  EXPECT_EQ(gradient_accumulation_steps_for(unset, std::nullopt, false), 1);
  auto one = settings_from_env(Env({{"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1"}}));
  EXPECT_EQ(settings_to_env(one).at("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), "1");
  EXPECT_EQ(gradient_accumulation_steps_for(one, 4, false), 1);
  EXPECT_THROW(gradient_accumulation_steps_for(unset, 0, false), ConfigError);
}

TEST(Settings, AccelerateSpellings) {
  // Accelerate writes the sharding strategy as a name or as the enum's integer.
  auto s = settings_from_env(Env({{"ACCELERATE_USE_FSDP", "true"}, {"FSDP_SHARDING_STRATEGY", "2"}}));
  ASSERT_TRUE(s.fsdp);
  EXPECT_EQ(s.fsdp->sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  EXPECT_EQ(s.distributed_type_name(), "fsdp");
  auto v1 = settings_from_env(Env({{"ACCELERATE_USE_FSDP", "1"}, {"FSDP_RESHARD_AFTER_FORWARD", "NO_SHARD"}}));
  EXPECT_EQ(v1.fsdp->sharding_strategy, ShardingStrategy::NO_SHARD);
}

// What `accelerate launch` (1.16) exports (checked with the real launcher), read as its Accelerator reads it except
// for an FSDP1 file's strategy, which Accelerate 1.16 loses (it trains the FULL_SHARD it exports by default).
TEST(Settings, WhatAccelerateLaunchExportsIsReadAsItsAcceleratorReadsIt) {
  auto fsdp = [](std::map<std::string, std::string> vars) {
    vars["ACCELERATE_USE_FSDP"] = "true";
    return *settings_from_env(Env(vars)).fsdp;
  };
  // It always exports FSDP_SHARDING_STRATEGY (FULL_SHARD unless given); an FSDP1 file's strategy comes as
  // FSDP_RESHARD_AFTER_FORWARD. A strategy given on the command line wins.
  EXPECT_EQ(fsdp({{"FSDP_SHARDING_STRATEGY", "FULL_SHARD"}, {"FSDP_RESHARD_AFTER_FORWARD", "SHARD_GRAD_OP"}}).sharding_strategy,
            ShardingStrategy::SHARD_GRAD_OP);
  EXPECT_EQ(fsdp({{"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"}, {"FSDP_RESHARD_AFTER_FORWARD", "FULL_SHARD"}}).sharding_strategy,
            ShardingStrategy::SHARD_GRAD_OP);
  EXPECT_EQ(fsdp({{"FSDP_SHARDING_STRATEGY", "NO_SHARD"}, {"FSDP_RESHARD_AFTER_FORWARD", "SHARD_GRAD_OP"}}).sharding_strategy,
            ShardingStrategy::NO_SHARD);
  EXPECT_EQ(fsdp({{"FSDP_VERSION", "2"}}).state_dict_type, "SHARDED_STATE_DICT");  // its FSDP2 default
  EXPECT_EQ(fsdp({{"FSDP_VERSION", "1"}}).state_dict_type, "FULL_STATE_DICT");
  EXPECT_EQ(fsdp({{"FSDP_STATE_DICT_TYPE", "3"}}).state_dict_type, "SHARDED_STATE_DICT");  // torch's enum value
  EXPECT_EQ(fsdp({{"FSDP_STATE_DICT_TYPE", "sharded_state_dict"}}).state_dict_type, "SHARDED_STATE_DICT");
  EXPECT_THROW(fsdp({{"FSDP_STATE_DICT_TYPE", "4"}}), ConfigError);
  // An unset sequence length is Python's None.
  auto sp = settings_from_env(Env({{"PARALLELISM_CONFIG_SP_SIZE", "2"}, {"PARALLELISM_CONFIG_SP_SEQ_LENGTH", "None"},
                                   {"PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "True"}}));
  ASSERT_TRUE(sp.parallelism);
  EXPECT_FALSE(sp.parallelism->sp_seq_length);
  // What xlr8 launch refuses is refused here too, not dropped in silence.
  auto refusal = [](const std::map<std::string, std::string>& vars) {
    try {
      settings_from_env(Env(vars));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("read");
  };
  EXPECT_NE(refusal({{"ACCELERATE_USE_FSDP", "true"}, {"FSDP_IGNORED_MODULES", "lm_head"}}).find("xlr8 shards every module"),
            std::string::npos);
  EXPECT_NE(refusal({{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MoE"}})
                .find("mixture-of-experts"),
            std::string::npos);
  EXPECT_NE(refusal({{"ACCELERATE_USE_MEGATRON_LM", "true"}}).find("no Megatron-LM engine"), std::string::npos);
  EXPECT_EQ(refusal({{"ACCELERATE_USE_MEGATRON_LM", "false"}, {"ACCELERATE_DYNAMO_BACKEND", "NO"}}), "read");
}

TEST(Settings, BadValuesNameVariableValueAndChoices) {
  try {
    settings_from_env(Env({{"ACCELERATE_MIXED_PRECISION", "bf61"}}));
    FAIL();
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("ACCELERATE_MIXED_PRECISION"), std::string::npos) << m;
    EXPECT_NE(m.find("bf61"), std::string::npos) << m;
    EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  }
  EXPECT_THROW(settings_from_env(Env({{"ACCELERATE_USE_FSDP", "maybe"}})), ConfigError);
  EXPECT_THROW(settings_from_env(Env({{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_DEEPSPEED_ZERO_STAGE", "4"}})),
               ConfigError);
  EXPECT_THROW(settings_from_env(Env({{"ACCELERATE_USE_FSDP", "true"}, {"ACCELERATE_USE_DEEPSPEED", "true"}})), ConfigError);
}

TEST(Settings, TopologyToEnvHasTorchrunNames) {
  Topology t;
  t.rank = 3;
  t.world_size = 4;
  t.local_rank = 1;
  t.local_world_size = 2;
  t.node_rank = 1;
  t.num_nodes = 2;
  t.master_addr = "h0";
  t.master_port = 2222;
  auto vars = topology_to_env(t);
  for (auto name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
    EXPECT_TRUE(vars.count(name)) << name;
  Topology back = topology_from_env(Env(vars));
  back.source = t.source;
  EXPECT_EQ(back, t);
}
