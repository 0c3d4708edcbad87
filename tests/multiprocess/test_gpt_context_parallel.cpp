// Context parallelism on the GPT example through the real launcher (issue 25): every layout, alone and
// composed with FSDP, HSDP, DDP and TP, equals 1 process on the global batch, and moves exactly the
// bytes the strategy's formula says; Accelerate's own ND-parallel configs launch it unchanged.
#include <gtest/gtest.h>

#include "gpt_runs.hpp"

namespace {

using namespace gpt_runs;

const Args kCommon{"--max_steps", "6", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"};

// 2 layers, d_model 32, 4 heads, windows of 48 tokens (divisible by 2 x cp for cp 2, 3 and 4).
Args cp_gpt(int batch, const std::string& dir) {
  return concat({"--n_layer", "2", "--d_model", "32", "--n_head", "4", "--seq_len", "48", "--batch_size",
                 std::to_string(batch), "--lr", "3e-3", "--val_windows", "48", "--output_dir", dir},
                kCommon);
}

// Bytes a cp rank sends per micro-step for attention, as a ring sends them. Per layer its keys and values
// (b windows x T/cp tokens x 2 x c features, fp32): all-gathered forward and reduce-scattered backward,
// (cp-1) shares each way; the ring passes them on cp-1 times forward, then the blocks and their
// gradients cp-1 times backward and the gradients once more home: 3cp-2 shares.
int64_t cp_wire_bytes(int64_t layers, int64_t b, int64_t T, int64_t c, int64_t cp, bool ring) {
  const int64_t kv = b * (T / cp) * 2 * c * 4;
  return layers * kv * (ring ? 3 * cp - 2 : 2 * (cp - 1));
}

struct Layout {
  std::string name;
  int processes, batch;
  Args launcher;
  int cp;
  bool ring;
  int64_t attention_width;  // features of q, k and v on one rank (d_model / tp)
};

}  // namespace

TEST(GptContextParallel, CpOnTwoThreeAndFourRanksAndWithFsdpDdpTpAndHsdpEqualsOneProcess) {
  const auto one_dir = temp_dir("gpt-cp-one");
  const auto one = json_of(launch_gpt(1, {}, cp_gpt(8, one_dir)));
  ASSERT_TRUE(one.contains("last_grad_norm"));
  EXPECT_GT(one["last_grad_norm"].get<double>(), 0.5) << "the bound must act for clipping to be tested";
  const Args ring{"--parallelism_config_cp_comm_strategy", "alltoall"};
  const Args fsdp{"--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
                  "Block"};
  const std::vector<Layout> layouts{
      {"cp 2, allgather", 2, 8, {"--parallelism_config_cp_size", "2"}, 2, false, 32},
      {"cp 3, alltoall", 3, 8, concat({"--parallelism_config_cp_size", "3"}, ring), 3, true, 32},
      {"cp 4, alltoall", 4, 8, concat({"--parallelism_config_cp_size", "4"}, ring), 4, true, 32},
      {"dp_shard 2 x cp 2 (FSDP + CP), alltoall", 4, 4,
       concat(fsdp, concat({"--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "2"}, ring)), 2,
       true, 32},
      {"dp_replicate 2 x cp 2 (DDP + CP)", 4, 4,
       {"--parallelism_config_dp_replicate_size", "2", "--parallelism_config_cp_size", "2"}, 2, false, 32},
      {"cp 2 x tp 2 (TP + CP), alltoall", 4, 8,
       concat({"--parallelism_config_cp_size", "2", "--parallelism_config_tp_size", "2"}, ring), 2, true, 16},
      {"dp_replicate 2 x dp_shard 2 x cp 2 (HSDP + CP)", 8, 2,
       concat(fsdp, {"--fsdp_sharding_strategy", "HYBRID_SHARD", "--parallelism_config_dp_replicate_size", "2",
                     "--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "2"}),
       2, false, 32}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const auto dir = temp_dir("gpt-cp");
    auto got = json_of(launch_gpt(layout.processes, layout.launcher, cp_gpt(layout.batch, dir)));
    ASSERT_TRUE(got.contains("final_train_loss"));
    EXPECT_EQ(got["cp_size"], layout.cp);
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["last_grad_norm"].get<double>(), one["last_grad_norm"].get<double>(),
                1e-4 * one["last_grad_norm"].get<double>());
    EXPECT_EQ(got["cp_wire_bytes_per_micro_step"],
              cp_wire_bytes(2, layout.batch, 48, layout.attention_width, layout.cp, layout.ring));
    // The ring's own clock runs only on the ring.
    EXPECT_EQ(got["cp_ring_compute_s"].get<double>() > 0, layout.ring);
    EXPECT_GE(got["cp_ring_wait_s"].get<double>(), 0);
    // Head-tail balance: every rank computes the same 2cp+1 causal chunk pairs per layer (with contiguous
    // chunks rank r would compute r+1 of cp).
    for (double blocks : got["cp_attention_blocks_per_micro_step_by_rank"].get<std::vector<double>>())
      EXPECT_EQ(blocks, 2 * (2 * layout.cp + 1));
    expect_same_params(dir, one_dir, 5e-4);  // AdamW at lr 3e-3 amplifies float rounding (as for TP)
  }
}

TEST(GptContextParallel, ACheckpointWrittenUnderCpTwoTimesDpShardTwoResumesOnOneProcessAsTheStraightRun) {
  auto gpt = [](int batch, const std::string& dir, const Args& steps) {
    return concat({"--n_layer", "2", "--d_model", "32", "--n_head", "4", "--seq_len", "48", "--batch_size",
                   std::to_string(batch), "--lr", "3e-3", "--val_windows", "48", "--output_dir", dir,
                   "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"},
                  steps);
  };
  const auto straight_dir = temp_dir("gpt-cp-straight"), split_dir = temp_dir("gpt-cp-split");
  const auto straight = json_of(launch_gpt(1, {}, gpt(8, straight_dir, {"--max_steps", "6"})));
  auto first = json_of(launch_gpt(4,
                                  {"--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                   "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_state_dict_type",
                                   "SHARDED_STATE_DICT", "--parallelism_config_dp_shard_size", "2",
                                   "--parallelism_config_cp_size", "2", "--parallelism_config_cp_comm_strategy",
                                   "alltoall"},
                                  gpt(4, split_dir, {"--max_steps", "3", "--checkpoint_every", "3"})));
  EXPECT_EQ(first["global_step"], 3);
  auto resumed = json_of(launch_gpt(1, {}, gpt(8, split_dir, {"--max_steps", "6", "--resume_from", "latest"})));
  ASSERT_TRUE(straight.contains("final_train_loss") && resumed.contains("final_train_loss"));
  EXPECT_GT(resumed["load_state_seconds"].get<double>(), 0);  // it did resume
  EXPECT_EQ(resumed["global_step"], 6);
  EXPECT_NEAR(resumed["final_train_loss"].get<double>(), straight["final_train_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(resumed["val_loss"].get<double>(), straight["val_loss"].get<double>(), 1e-5);
  expect_same_params(split_dir, straight_dir, 5e-4);
}

TEST(GptContextParallel, TheFourDimensionalMeshOnSixteenRanksEqualsOneProcess) {
  // dp_replicate 2 x dp_shard 2 x cp 2 x tp 2 (HSDP over dp_shard x cp, TP inside): the mesh exercised
  // end to end with a tiny model; 2 windows per data-parallel rank, 8 in all.
  const auto one_dir = temp_dir("gpt-4d-one");
  const auto one = json_of(launch_gpt(1, {}, cp_gpt(8, one_dir)));
  const auto dir = temp_dir("gpt-4d");
  auto got = json_of(launch_gpt(
      16,
      {"--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
       "--fsdp_transformer_layer_cls_to_wrap", "Block", "--parallelism_config_dp_replicate_size", "2",
       "--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "2", "--parallelism_config_tp_size",
       "2", "--parallelism_config_cp_comm_strategy", "alltoall"},
      cp_gpt(2, dir)));
  ASSERT_TRUE(got.contains("final_train_loss") && one.contains("final_train_loss"));
  EXPECT_EQ(got["num_processes"], 16);
  EXPECT_EQ(got["cp_size"], 2);
  EXPECT_EQ(got["tp_size"], 2);
  EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
  expect_same_params(dir, one_dir, 5e-4);
}

TEST(GptContextParallel, ASequenceTwiceCpDoesNotDivideIsOneLineBeforeTheFirstStep) {
  auto r = launch_gpt(3, {"--parallelism_config_cp_size", "3"},
                      {"--n_layer", "1", "--d_model", "16", "--n_head", "2", "--seq_len", "32", "--batch_size", "2",
                       "--max_steps", "2", "--output_dir", temp_dir("gpt-cp-bad")},
                      /*expect_success=*/false);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("the sequence length is 32, which 2 x parallelism_config_cp_size = 6 does not divide"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("train "), std::string::npos) << "no step ran";
}

TEST(GptContextParallel, Bf16OnBothStrategiesStaysWithinTheBf16ToleranceOfOneProcess) {
  // Under bf16 autocast the attention's matmuls round to bf16 on every rank; the ring merges blocks in
  // fp32. Stated tolerance 3e-2 on losses and parameters (as for TP), after 6 steps.
  const auto one_dir = temp_dir("gpt-cp-bf16-one");
  const auto one = json_of(launch_gpt(1, {"--mixed_precision", "bf16"}, cp_gpt(8, one_dir)));
  ASSERT_TRUE(one.contains("final_train_loss"));
  for (const std::string strategy : {"allgather", "alltoall"}) {
    SCOPED_TRACE(strategy);
    const auto dir = temp_dir("gpt-cp-bf16");
    auto got = json_of(launch_gpt(2,
                                  {"--mixed_precision", "bf16", "--parallelism_config_cp_size", "2",
                                   "--parallelism_config_cp_comm_strategy", strategy},
                                  cp_gpt(8, dir)));
    ASSERT_TRUE(got.contains("final_train_loss"));
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 3e-2);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 3e-2);
    expect_same_params(dir, one_dir, 3e-2);
  }
}

// Accelerate's own ND-parallel example configs (examples/torch_native_parallelism/configs, copied unchanged
// into tests/data/accelerate_configs): 8 processes, bf16, FSDP2 with TRANSFORMER_BASED_WRAP and no
// fsdp_transformer_layer_cls_to_wrap (the GPT declares Block). The example's model as it is by default (4
// layers, d_model 128, 4 heads, windows of 128: tp 2 divides the heads, 2 x cp 16 the window), 3 steps; each
// trains as one bf16 process on the global batch, to bf16's tolerance.
namespace {

Args default_gpt(int batch, const std::string& dir) {
  return {"--max_steps", "3", "--batch_size", std::to_string(batch), "--val_windows", "16", "--output_dir", dir};
}

ProcessResult launch_with_accelerate_config(const std::string& file, const Args& program) {
  const Args command{kXlr8, "launch", "--config_file",
                     std::string(XLR8_SOURCE_DIR) + "/tests/data/accelerate_configs/" + file, kGpt};
  auto r = run(concat(command, program), 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return r;
}

void expect_like_one_bf16_process(nlohmann::json got, int global_batch) {
  const auto one = json_of(launch_gpt(1, {"--mixed_precision", "bf16"}, default_gpt(global_batch, temp_dir("gpt-nd"))));
  ASSERT_TRUE(got.contains("final_train_loss") && one.contains("final_train_loss"));
  EXPECT_EQ(got["num_processes"], 8);
  EXPECT_EQ(got["global_step"], 3);
  EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 3e-2);
  EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 3e-2);
}

const nlohmann::json kBlocks = {"blocks.0", "blocks.1", "blocks.2", "blocks.3", "(root)"};

}  // namespace

TEST(GptAccelerateConfigs, TpHsdpYamlLaunchesTheGptUnchanged) {
  // dp_replicate 2 x dp_shard 2 x tp 2: HSDP as Accelerate's fully_shard makes it (no fsdp_sharding_strategy).
  auto got =
      json_of(launch_with_accelerate_config("accelerate_nd_parallel_tp_hsdp.yaml", default_gpt(2, temp_dir("gpt-nd"))));
  EXPECT_EQ(got["tp_size"], 2);
  EXPECT_EQ(got["shard_ranks"], 2);     // each block sharded over dp_shard ...
  EXPECT_EQ(got["shard_replicas"], 2);  // ... and replicated over dp_replicate
  EXPECT_EQ(got["sharding_units"], kBlocks) << got.dump();
  expect_like_one_bf16_process(got, 8);  // 2 windows on each of 4 data-parallel ranks
}

TEST(GptAccelerateConfigs, CpYamlLaunchesTheGptUnchanged) {
  // cp 8: FULL_SHARD over the 8 cp ranks, each block recomputed in backward (fsdp_activation_checkpointing).
  const auto r = launch_with_accelerate_config("accelerate_nd_parallel_cp.yaml", default_gpt(2, temp_dir("gpt-nd")));
  auto got = json_of(r);
  EXPECT_EQ(got["cp_size"], 8);
  EXPECT_EQ(got["shard_ranks"], 8);
  EXPECT_EQ(got["shard_replicas"], 1);
  EXPECT_EQ(got["sharding_units"], kBlocks) << got.dump();
  EXPECT_NE(r.err.find("fsdp_activation_checkpointing: 4 unit(s) recompute"), std::string::npos) << r.err;
  expect_like_one_bf16_process(got, 2);  // one data-parallel rank: the cp ranks share its 2 windows
}
