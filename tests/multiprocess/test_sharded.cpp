// The oracle for the sharded strategies through the real launcher, chosen by the same flags Accelerate
// and DeepSpeed users pass: N ranks on b equal one process on N*b, with accumulation, clipping, a
// scheduler and bf16; a resumed sharded run equals the uninterrupted one; the GPT example holds the
// bytes per rank the ZeRO formulas promise and frees what it gathers.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "gpt_runs.hpp"
#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"
#include "xlr8/launcher.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {


struct Strategy {
  std::string name;  // what parallel_stats reports
  Args flags;        // xlr8 launch flags
};

// train_worker's MLP has no layer classes to wrap: its stage 3 is FULL_SHARD with NO_WRAP (one unit,
// no guard, so the parameters stay whole and gradients and optimizer state are sharded).
const std::vector<Strategy>& worker_strategies() {
  static const std::vector<Strategy> all{
      {"zero1", {"--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0"}},  // DeepSpeed's default clips at 1
      {"zero2", {"--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"}},
      {"zero3", {"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"}},
  };
  return all;
}

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> all{
      {"zero1", {"--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0"}},  // DeepSpeed's default clips at 1
      {"zero2", {"--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"}},
      {"zero3",
       {"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
  };
  return all;
}

Args launch(int processes, const Args& flags, const std::string& program) {
  Args a{kXlr8, "launch", "--num_processes", std::to_string(processes)};
  a.insert(a.end(), flags.begin(), flags.end());
  a.push_back(program);
  return a;
}

Run worker_run(int processes, const Args& flags, int batch, Args extra, const std::map<std::string, std::string>& env = {}) {
  auto dir = temp_dir("sharded");
  auto a = launch(processes, flags, kTrain);
  Args rest{"--batch", std::to_string(batch), "--out", dir};
  a.insert(a.end(), rest.begin(), rest.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return oracle_command(a, dir, 120, env);
}

// A small GPT (2 blocks) for `steps` steps; its parameters are saved under dir/model.
nlohmann::json gpt_run(int processes, const Args& flags, int batch, const std::string& dir,
                       Args extra = {"--max_steps", "8"}, int n_layer = 2) {
  auto a = launch(processes, flags, kGpt);
  Args rest{"--n_layer", std::to_string(n_layer), "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--batch_size",
            std::to_string(batch), "--lr", "3e-3", "--val_windows", "24", "--output_dir", dir};
  a.insert(a.end(), rest.begin(), rest.end());
  a.insert(a.end(), extra.begin(), extra.end());
  auto r = run(a, 180);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
}

}  // namespace

TEST(ShardedOracle, EveryStageOnTwoThreeAndFourRanksWithAccumulationClippingAndScheduler) {
  // train_worker clips to norm 5 every step and halves the learning rate every 5 steps.
  auto one = worker_run(1, {}, 12, {"--steps", "6", "--accum", "2"});
  ASSERT_EQ(one.losses.size(), 6u);
  for (const auto& s : worker_strategies())
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(fmt::format("{} on {} ranks", s.name, n));
      auto got = worker_run(n, s.flags, 12 / n, {"--steps", "6", "--accum", "2"});
      EXPECT_EQ(got.result["strategy"], s.name);
      expect_close(got.losses, one.losses, 1e-5);
      expect_same_params(got.dir, one.dir, 1e-5);
    }
}

TEST(HostReads, NoStrategysTrainingStepReadsAValueBackToTheHost) {
  // DDP and every stage on 2 ranks, bf16, accumulation 2, clipping, FusedAdamW: from the accumulate scope to
  // zero_grad, no operator reads a tensor's value on the host (on a GPU each would wait for the device), counted
  // by the worker's RecordFunction callback over the steps after the first; the largest rank's count.
  std::vector<Strategy> all{{"ddp", {}}};
  all.insert(all.end(), worker_strategies().begin(), worker_strategies().end());
  for (const auto& strategy : all) {
    SCOPED_TRACE(strategy.name);
    auto run = worker_run(2, strategy.flags, 4,
                          {"--steps", "6", "--accum", "2", "--precision", "bf16", "--max_norm", "0.5", "--optimizer",
                           "fused_adamw", "--count_host_reads"});
    ASSERT_EQ(run.losses.size(), 6u);
    EXPECT_EQ(run.result["strategy"], strategy.name);
    EXPECT_EQ(run.result["host_reads"].get<double>(), 0.0);
  }
  // The count sees reads where there are some: fp16's loss scaler reads the world's overflow flag once at each
  // of the 5 optimizer steps counted (DeepSpeed's scaler decides on the host whether the step is skipped).
  auto fp16 = worker_run(2, {}, 4,
                         {"--steps", "6", "--accum", "2", "--precision", "fp16", "--max_norm", "0.5", "--optimizer",
                          "fused_adamw", "--count_host_reads"});
  EXPECT_EQ(fp16.result["host_reads"].get<double>(), 5.0);
}

TEST(ShardedOracle, ClipGradValueClipsTheShardsAsOneProcessClipsTheWholeGradients) {
  auto one = worker_run(1, {}, 12, {"--steps", "4", "--clip_value", "0.002"});
  auto unclipped = worker_run(1, {}, 12, {"--steps", "4"});
  EXPECT_GT(std::abs(one.losses.back() - unclipped.losses.back()), 1e-4);  // the clip bites
  for (const auto& s : worker_strategies()) {
    SCOPED_TRACE(s.name);
    auto got = worker_run(3, s.flags, 4, {"--steps", "4", "--clip_value", "0.002"});
    expect_close(got.losses, one.losses, 1e-5);
    expect_same_params(got.dir, one.dir, 1e-5);
  }
}

// The gradients on disk too (XLR8_GRADIENTS_ON_DISK=1), ZeRO-3 with the optimizer's state on disk on 3 ranks with
// accumulation: the Accelerator's clip_grad_value is queued for each step's read of the gradients and clips as in
// memory, bitwise.
TEST(ShardedOracle, ClipGradValueWithTheGradientsOnDiskClipsAsInMemory) {
  const auto swap = temp_dir("sharded-gradients-swap");
  const Args flags{"--use_deepspeed", "--zero_stage", "3", "--gradient_clipping", "0", "--offload_optimizer_device", "nvme",
                   "--offload_optimizer_nvme_path", swap};  // clip_grad_value alone (no norm clip at the step)
  const Args extra{"--steps", "4", "--accum", "2", "--clip_value", "0.002"};
  auto memory = worker_run(3, flags, 4, extra);
  auto disk = worker_run(3, flags, 4, extra, {{"XLR8_GRADIENTS_ON_DISK", "1"}});
  ASSERT_EQ(disk.losses.size(), 4u);
  EXPECT_EQ(disk.losses, memory.losses);
  expect_same_params(disk.dir, memory.dir, 0.0);
  const auto on_disk = disk.result.value("optimizer_on_disk", nlohmann::json::object());
  EXPECT_TRUE(on_disk.value("gradients_on_disk", false)) << disk.result.dump();
  EXPECT_GT(on_disk.value("gradient_work_queued", 0), 0) << disk.result.dump();  // the clips, queued
  EXPECT_EQ(on_disk.value("gradient_reads", 0), on_disk.value("gradient_writes", -1)) << disk.result.dump();
}

TEST(ShardedOracle, Bf16UnderEveryStageStaysWithinTheBf16Tolerance) {
  // On CPU the parameters stay fp32 under autocast (as DDP); XLR8_SHARDED_PARAM_DTYPE=bf16 makes them bf16
  // with fp32 master shards, as on CUDA.
  auto one = worker_run(1, {}, 8, {"--steps", "8", "--precision", "bf16"});
  for (const auto& s : worker_strategies())
    for (std::string dtype : {"auto", "bf16"}) {
      SCOPED_TRACE(s.name + " " + dtype);
      auto got = worker_run(2, s.flags, 4, {"--steps", "8", "--precision", "bf16"}, {{"XLR8_SHARDED_PARAM_DTYPE", dtype}});
      expect_close(got.losses, one.losses, 3e-2);
      expect_same_params(got.dir, one.dir, 3e-2);
    }
}

TEST(ShardedOracle, ALinearFeedingALayerNormTrainsInBf16UnderDdpAndFullShard) {
  // A bf16 Linear output into fp32 norm weights (LibTorch 1.x's CPU autocast failed it on every strategy,
  // one process included).
  auto one = worker_run(1, {}, 8, {"--steps", "8", "--precision", "bf16", "--norm"});
  auto fp32 = worker_run(1, {}, 8, {"--steps", "8", "--norm"});
  EXPECT_NE(one.losses, fp32.losses);  // bf16 really ran
  const Strategy ddp{"ddp", {}};
  for (const auto& s : {ddp, worker_strategies()[2]}) {
    SCOPED_TRACE(s.name);
    auto got = worker_run(2, s.flags, 4, {"--steps", "8", "--precision", "bf16", "--norm"});
    EXPECT_EQ(got.result["strategy"], s.name);
    expect_close(got.losses, one.losses, 3e-2);
    expect_same_params(got.dir, one.dir, 3e-2);
  }
}

TEST(ShardedOracle, ResumedShardedRunEqualsTheUninterruptedOne) {
  const auto& zero2 = worker_strategies()[1];
  auto straight = worker_run(3, zero2.flags, 4, {"--steps", "10"});
  auto first = worker_run(3, zero2.flags, 4, {"--steps", "4", "--checkpoint_at", "4"});
  ASSERT_TRUE(fs::exists(first.dir + "/checkpoint/shards_rank2.safetensors"));  // each rank's shard of the state
  auto resumed = worker_run(3, zero2.flags, 4, {"--steps", "10", "--resume", first.dir + "/checkpoint"});
  auto tail = std::vector<double>(straight.losses.begin() + 4, straight.losses.end());
  expect_close(resumed.losses, tail, 1e-6);
  expect_same_params(resumed.dir, straight.dir, 1e-6);
}

// A load that fails on one rank past the checks (an injected read error: the n-th tensor rank 1 reads) fails on
// every rank with that rank's message, at once, where the others would have gone on into a collective; a second load
// then resumes the run as the uninterrupted one. With the state and parameters on disk the load streams (the failure
// comes after part of the state was replaced, and says so); FULL_SHARD in memory reads everything first.
TEST(ShardedCheckpoint, ALoadThatFailsOnOneRankFailsOnEveryRankAndLoadingAgainResumes) {
  const auto swap = temp_dir("load-failure-swap");
  const Strategy on_disk{"zero3", {"--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "nvme",
                                   "--offload_optimizer_nvme_path", swap, "--offload_param_device", "nvme",
                                   "--offload_param_nvme_path", swap}};
  for (const auto& [s, streams] : {std::pair{on_disk, true}, std::pair{worker_strategies()[2], false}}) {
    SCOPED_TRACE(s.flags[1]);
    auto straight = worker_run(2, s.flags, 4, {"--steps", "8"});
    auto first = worker_run(2, s.flags, 4, {"--steps", "4", "--checkpoint_at", "4"});
    auto resumed = worker_run(2, s.flags, 4, {"--steps", "8", "--resume", first.dir + "/checkpoint", "--retry_failed_load"},
                              {{"XLR8_TEST_ONLY_FAIL_CHECKPOINT_READ", "1:3"}, {"XLR8_COLLECTIVE_TIMEOUT", "60"}});
    ASSERT_TRUE(resumed.result.is_object());  // else oracle_command reported the failed run
    const auto said = resumed.result.value("load_errors", std::vector<std::string>{});
    ASSERT_EQ(said.size(), 2u) << resumed.result;
    for (const auto& e : said) {
      EXPECT_NE(e.find("rank 1: "), std::string::npos) << e;
      EXPECT_NE(e.find("an injected failure"), std::string::npos) << e;
      EXPECT_NE(e.find(streams ? "partly the checkpoint's" : "nothing was loaded"), std::string::npos) << e;
    }
    expect_close(resumed.losses, std::vector<double>(straight.losses.begin() + 4, straight.losses.end()), 1e-6);
    expect_same_params(resumed.dir, straight.dir, 1e-6);
  }
}

TEST(ShardedCheckpoint, SavedUnderOneStrategyAndProcessCountResumesUnderAnother) {
  // The oracle: N ranks x 12/N for 3 steps (mid-epoch: 4 steps make an epoch), saved; resumed on M ranks
  // x 12/M for 7 more steps; equal to one process on 12 for 10 steps (losses and parameters), optimizer
  // state and data position included.
  const Strategy ddp{"ddp", {}};
  const Strategy sharded_sd{"zero3",
                            {"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_state_dict_type",
                             "SHARDED_STATE_DICT"}};
  const auto& z = worker_strategies();
  struct Case {
    Strategy from;
    int n;
    Strategy to;
    int m;
  };
  const std::vector<Case> cases{
      {z[2], 4, z[0], 3},        // FULL_SHARD (full model file) 4 -> ZeRO-1 3
      {sharded_sd, 4, z[1], 3},  // FULL_SHARD, SHARDED_STATE_DICT 4 -> SHARD_GRAD_OP 3
      {ddp, 2, ddp, 1},          // DDP 2 -> one process
      {z[0], 2, sharded_sd, 4},  // ZeRO-1 2 -> FULL_SHARD 4
      {z[1], 3, ddp, 2},         // SHARD_GRAD_OP 3 -> DDP 2
      {ddp, 1, z[2], 3},         // one process -> FULL_SHARD 3
  };
  auto one = worker_run(1, {}, 12, {"--steps", "10"});
  ASSERT_EQ(one.losses.size(), 10u);
  const auto tail = std::vector<double>(one.losses.begin() + 3, one.losses.end());
  for (const auto& c : cases) {
    SCOPED_TRACE(fmt::format("{} on {} -> {} on {}", c.from.name, c.n, c.to.name, c.m));
    auto first = worker_run(c.n, c.from.flags, 12 / c.n, {"--steps", "3", "--checkpoint_at", "3"});
    auto resumed = worker_run(c.m, c.to.flags, 12 / c.m, {"--steps", "10", "--resume", first.dir + "/checkpoint"});
    EXPECT_EQ(resumed.result["num_processes"], c.m);
    expect_close(resumed.losses, tail, 1e-5);
    expect_same_params(resumed.dir, one.dir, 1e-5);
  }
}

TEST(ShardedCheckpoint, MergeWeightsTurnsShardsIntoTheUnshardedModelBitForBit) {
  // FULL_SHARD with SHARDED_STATE_DICT on 3 ranks saves at step 4 and stops: save_model then writes the
  // same state gathered, which the merged shards must equal bit for bit, read by an independent reader.
  Args sharded_sd{"--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_state_dict_type",
                  "SHARDED_STATE_DICT"};
  auto first = worker_run(3, sharded_sd, 4, {"--steps", "4", "--checkpoint_at", "4"});
  const auto checkpoint = first.dir + "/checkpoint";
  ASSERT_FALSE(fs::exists(checkpoint + "/model.safetensors"));
  auto compare = [&](const std::string& merged, Args extra) {
    Args a{"python3", kCompare, merged, first.dir + "/model"};
    a.insert(a.end(), extra.begin(), extra.end());
    auto r = run(a, 60);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
  };
  auto merged = temp_dir("merged");
  auto r = run({kXlr8, "merge-weights", checkpoint, merged}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("sharded over 3 rank(s)"), std::string::npos) << r.out;
  auto same = compare(merged, {});
  EXPECT_EQ(same["compared"], 4);  // the MLP's two weights and two biases
  EXPECT_EQ(same["differ"], nlohmann::json::array());
  EXPECT_EQ(same["extra"], nlohmann::json::array());
  // bf16, split into files of at most 200 bytes plus the index: each value is fp32 rounded to nearest even.
  auto small = temp_dir("merged-bf16");
  r = run({kXlr8, "merge-weights", checkpoint, small, "--dtype", "bf16", "--max_shard_size", "200"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto rounded = compare(small, {"--bf16"});
  EXPECT_GT(rounded["files"].get<int>(), 1);
  EXPECT_EQ(rounded["differ"], nlohmann::json::array());
  // A checkpoint with a whole model file (DDP) merges to a copy of it.
  auto ddp = worker_run(2, {}, 6, {"--steps", "4", "--checkpoint_at", "4"});
  auto copied = temp_dir("merged-ddp");
  r = run({kXlr8, "merge-weights", ddp.dir + "/checkpoint", copied}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("a whole model file"), std::string::npos) << r.out;
  Args b{"python3", kCompare, copied, ddp.dir + "/model"};
  auto c = run(b, 60);
  EXPECT_EQ(last_json(c.out)["differ"], nlohmann::json::array()) << c.out << c.err;
  // Bad input names what is wrong.
  r = run({kXlr8, "merge-weights", first.dir, temp_dir("merged-bad")}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("merge-weights: " + first.dir + " is not a complete checkpoint"), std::string::npos) << r.err;
  r = run({kXlr8, "merge-weights", first.dir + "/no-such-checkpoint", temp_dir("merged-bad")}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("merge-weights: checkpoint " + first.dir + "/no-such-checkpoint does not exist"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("load_state"), std::string::npos) << r.err;
  r = run({kXlr8, "merge-weights", checkpoint, temp_dir("merged-bad"), "--dtype", "int4"}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--dtype \"int4\""), std::string::npos) << r.err;
}

TEST(ShardedGpt, EveryStageMatchesOneProcessAndHoldsTheFormulaBytes) {
  // fp32 AdamW, Ψ parameters, N ranks (reference/003): DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
  // ZeRO-3 16Ψ/N, plus at most N - 1 padding elements per group.
  auto one_dir = temp_dir("gpt-one");
  auto one = gpt_run(1, {}, 8, one_dir);
  ASSERT_TRUE(one.contains("parameters"));
  const double psi = one["parameters"].get<double>();
  // `xlr8 estimate-memory` for the same shape predicts what each run measures (within 10 %).
  auto estimate = [&](int n) {
    auto r = run({kXlr8, "estimate-memory", "--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32",
                  "--num_processes", std::to_string(n), "--dtypes", "float32", "--json"},
                 30);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    auto out = last_json(r.out);
    EXPECT_EQ(out["parameters"].get<double>(), psi);
    return out["rows"][0]["training_bytes_per_rank"];
  };
  for (int n : {2, 4}) {
    const auto predicted = estimate(n);
    auto ddp = gpt_run(n, {}, 8 / n, temp_dir("gpt-ddp"));
    EXPECT_NEAR(ddp["state_bytes_per_rank"].get<double>(), 16 * psi, 0.05 * 16 * psi);
    EXPECT_NEAR(predicted["ddp"].get<double>(), ddp["state_bytes_per_rank"].get<double>(), 0.1 * predicted["ddp"].get<double>());
    for (const auto& s : strategies()) {
      SCOPED_TRACE(fmt::format("{} on {} ranks", s.name, n));
      auto dir = temp_dir("gpt-sharded");
      auto got = gpt_run(n, s.flags, 8 / n, dir);
      ASSERT_TRUE(got.contains("state_bytes_per_rank"));
      EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
      EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
      expect_same_params(dir, one_dir, 1e-4);
      const double formula = s.name == "zero1"   ? 8 * psi + 8 * psi / n
                             : s.name == "zero2" ? 4 * psi + 12 * psi / n
                                                 : 16 * psi / n;
      EXPECT_NEAR(got["state_bytes_per_rank"].get<double>(), formula, 0.05 * formula);
      const double guess = predicted[s.name].get<double>();
      EXPECT_NEAR(guess, got["state_bytes_per_rank"].get<double>(), 0.1 * guess);
      EXPECT_LT(got["state_bytes_per_rank"].get<double>(), ddp["state_bytes_per_rank"].get<double>());
      EXPECT_EQ(got["rank0_loading"].get<bool>(), s.name == "zero3");  // fsdp_cpu_ram_efficient_loading's default
      if (s.name == "zero3") {
        // Gathered units are freed after use: the transient is the root's parameters plus one block,
        // far from the whole model (4Ψ).
        const double transient = got["peak_state_bytes_per_rank"].get<double>() - got["state_bytes_per_rank"].get<double>();
        EXPECT_GT(transient, 0);
        EXPECT_LT(transient, 0.75 * 4 * psi);
      }
    }
  }
}

TEST(ShardedGpt, PrefetchingIssuesTheNextUnitsGatherEarlyAndChangesNoResult) {
  // FULL_SHARD on 3 ranks (uneven shards) with FSDP's forward and backward prefetching equals 1 process,
  // and each mode issues exactly the early gathers it should. Four blocks, so that the root and two
  // blocks (what prefetching keeps alive at most) are well short of the whole model.
  const Args steps{"--max_steps", "8"};
  auto one_dir = temp_dir("gpt-prefetch-one");
  auto one = gpt_run(1, {}, 6, one_dir, steps, 4);
  const double psi = one["parameters"].get<double>();
  struct Mode {
    std::string forward, backward;
  };
  for (const auto& mode : {Mode{"true", "NO_PREFETCH"}, Mode{"false", "BACKWARD_PRE"}, Mode{"false", "BACKWARD_POST"},
                           Mode{"true", "BACKWARD_PRE"}, Mode{"false", "NO_PREFETCH"}}) {
    SCOPED_TRACE(fmt::format("forward {} backward {}", mode.forward, mode.backward));
    Args flags = strategies()[2].flags;
    flags.insert(flags.end(), {"--fsdp_backward_prefetch", mode.backward, "--fsdp_forward_prefetch", mode.forward});
    auto dir = temp_dir("gpt-prefetch");
    auto got = gpt_run(3, flags, 2, dir, steps, 4);
    ASSERT_TRUE(got.contains("forward_prefetches"));
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
    expect_same_params(dir, one_dir, 1e-4);
    const auto forward = got["forward_prefetches"].get<int64_t>(), backward = got["backward_prefetches"].get<int64_t>();
    // Steps 2-8 know the order of step 1. Forward: root -> block 0 -> ... -> block 3, four early gathers
    // a pass (validation passes add theirs). BACKWARD_PRE: root -> block 3 -> ... -> block 0, four a step.
    // BACKWARD_POST: when a block's gradients are done, the next block, unless its backward began already;
    // never a block that already ran (the root's gradients complete last).
    if (mode.forward == "true") EXPECT_GE(forward, 7 * 4) << got;
    else EXPECT_EQ(forward, 0) << got;
    if (mode.backward == "BACKWARD_PRE") EXPECT_EQ(backward, 7 * 4) << got;
    else if (mode.backward == "BACKWARD_POST") EXPECT_TRUE(backward > 0 && backward <= 7 * 3) << got;
    else EXPECT_EQ(backward, 0) << got;
    // The transient stays the root's parameters plus at most two blocks, never the whole model.
    EXPECT_LT(got["peak_state_bytes_per_rank"].get<double>() - got["state_bytes_per_rank"].get<double>(), 0.75 * 4 * psi);
  }
}

TEST(ShardedGpt, UnderDeepSpeedZero3EachBlockIsGatheredOnItsOwnWithItsAttentionAndMlp) {
  // DeepSpeed ZeRO-3 settings take DeepSpeed's granularity (GUARDED_MODULES), not the whole model at once:
  // each block (its guard) is a unit; its attention and MLP, whose forwards open none, ride with it. On 3
  // ranks (uneven shards), with and without a frozen rider (each block's attention), every run equals one
  // process, holds 16Ψ/N between steps and gathers at most the root and two blocks at a time.
  for (const Args& freeze : {Args{}, Args{"--freeze", "attn"}}) {
    SCOPED_TRACE(freeze.empty() ? "all trainable" : "attention frozen");
    Args extra{"--max_steps", "8"};
    extra.insert(extra.end(), freeze.begin(), freeze.end());
    auto one_dir = temp_dir("gpt-ds3-one");
    auto one = gpt_run(1, {}, 6, one_dir, extra, 4);
    ASSERT_TRUE(one.contains("parameters"));
    const double psi = one["parameters"].get<double>(), trainable = one["trainable_parameters"].get<double>();
    auto dir = temp_dir("gpt-ds3");
    // No clipping, as the one process (DeepSpeed's default, as Accelerate's, clips at 1.0).
    auto got = gpt_run(3, {"--use_deepspeed", "--zero_stage", "3", "--gradient_clipping", "0"}, 2, dir, extra, 4);
    ASSERT_TRUE(got.contains("state_bytes_per_rank"));
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
    expect_same_params(dir, one_dir, 1e-4);
    // fp32 AdamW: 16 bytes per trainable parameter, 4 per frozen one, over 3 ranks (plus padding).
    const double formula = (16 * trainable + 4 * (psi - trainable)) / 3;
    EXPECT_NEAR(got["state_bytes_per_rank"].get<double>(), formula, 0.05 * formula);
    EXPECT_LT(got["peak_state_bytes_per_rank"].get<double>() - got["state_bytes_per_rank"].get<double>(), 0.75 * 4 * psi);
    if (!freeze.empty()) {
      EXPECT_GT(got["frozen_released_in_backward"].get<int64_t>(), 0) << got;
    }
  }
}

TEST(ShardedGpt, FrozenParametersAreShardedByFullShardAndEveryRunEqualsOneProcess) {
  // Fine-tuning: the position embedding (the root's), the whole first block, and each block's first norm
  // and attention stay fixed. FULL_SHARD shards them as it shards the rest (4 bytes each, over N ranks),
  // and frees each block's when the block's own backward is over; SHARD_GRAD_OP keeps them whole.
  const Args extra{"--max_steps", "8", "--freeze", "wpe,blocks.0,ln1,attn"};
  auto one_dir = temp_dir("gpt-frozen-one");
  auto one = gpt_run(1, {}, 12, one_dir, extra, 3);
  ASSERT_TRUE(one.contains("trainable_parameters"));
  const double psi = one["parameters"].get<double>(), trained = one["trainable_parameters"].get<double>(),
               frozen = psi - trained;
  ASSERT_GT(frozen, 0.3 * psi);
  EXPECT_NEAR(one["state_bytes_per_rank"].get<double>(), 16 * trained + 4 * frozen, 0.01 * psi);
  auto expect_like_one = [&](const nlohmann::json& got, const std::string& dir) {
    ASSERT_TRUE(got.contains("final_train_loss"));
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
    expect_same_params(dir, one_dir, 1e-4);
  };
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("FULL_SHARD on {} ranks", n));
    Args flags = strategies()[2].flags;
    if (n == 3)
      flags.insert(flags.end(), {"--fsdp_backward_prefetch", "BACKWARD_PRE", "--fsdp_forward_prefetch", "true"});
    auto dir = temp_dir("gpt-frozen");
    auto got = gpt_run(n, flags, 12 / n, dir, extra, 3);
    expect_like_one(got, dir);
    const double formula = (16 * trained + 4 * frozen) / n;
    EXPECT_NEAR(got["state_bytes_per_rank"].get<double>(), formula, 0.05 * formula);
    EXPECT_EQ(got["frozen_released_in_backward"], 3 * 8) << got;  // every block, every step
    EXPECT_LT(got["peak_state_bytes_per_rank"].get<double>() - got["state_bytes_per_rank"].get<double>(),
              0.75 * 4 * psi);
  }
  // SHARD_GRAD_OP: frozen parameters whole (they have no gradients or optimizer state to shard). A
  // FULL_SHARD checkpoint of 3 ranks (frozen shards included) resumes there on 2.
  auto zero2 = gpt_run(2, strategies()[1].flags, 6, temp_dir("gpt-frozen-zero2"), extra, 3);
  const double zero2_formula = 4 * frozen + 4 * trained + 12 * trained / 2;
  EXPECT_NEAR(zero2["state_bytes_per_rank"].get<double>(), zero2_formula, 0.05 * zero2_formula);
  Args sharded_sd = strategies()[2].flags;
  sharded_sd.insert(sharded_sd.end(), {"--fsdp_state_dict_type", "SHARDED_STATE_DICT"});
  auto split_dir = temp_dir("gpt-frozen-resume");
  gpt_run(3, sharded_sd, 4, split_dir, {"--max_steps", "4", "--checkpoint_every", "4", "--freeze", extra.back()}, 3);
  ASSERT_TRUE(fs::exists(split_dir + "/checkpoints/checkpoint_0/shards_rank2.safetensors"));
  Args resume = extra;
  resume.insert(resume.end(), {"--resume_from", "latest"});
  auto resumed = gpt_run(2, strategies()[1].flags, 6, split_dir, resume, 3);
  EXPECT_GT(resumed.value("load_state_seconds", 0.0), 0) << resumed;  // it did resume (a fresh run would match too)
  expect_like_one(resumed, split_dir);
  auto bad = run({kGpt, "--max_steps", "1", "--freeze", "wpe,atn", "--output_dir", temp_dir("gpt-frozen-bad")}, 60);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("--freeze \"atn\""), std::string::npos) << bad.out << bad.err;
}

TEST(ShardedGpt, RamEfficientLoadingHoldsTheWholeModelOnNoRankAndChangesNoResult) {
  // fsdp_cpu_ram_efficient_loading (on by default): ranks 1-3 build the GPT without values and receive
  // their shards unit by unit, rank 0 computes them unit by unit, so building and preparing it costs every
  // rank far less resident memory.
  // 14.3 M parameters (57 MB in fp32). With dropout, so that the random numbers drawn after building
  // must match too (the main process's initialisers drew some; the others continue from its state).
  auto gpt = [&](const std::string& loading, const std::string& dir) {
    Args flags = strategies()[2].flags;
    flags.insert(flags.end(), {"--fsdp_cpu_ram_efficient_loading", loading});
    auto a = launch(4, flags, kGpt);
    a.insert(a.end(), {"--n_layer", "8", "--d_model", "384", "--n_head", "6", "--seq_len", "32", "--batch_size", "1",
                       "--max_steps", "2", "--val_windows", "8", "--dropout", "0.1", "--output_dir", dir});
    auto r = run(a, 240);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
  };
  auto on_dir = temp_dir("gpt-rank0-on"), off_dir = temp_dir("gpt-rank0-off");
  auto on = gpt("true", on_dir), off = gpt("false", off_dir);
  EXPECT_TRUE(on.value("rank0_loading", false));
  EXPECT_FALSE(off.value("rank0_loading", true));
  const auto peaks = gpt_runs::same_training_and_setup_peaks(on, off, on_dir, off_dir, 4);
  for (size_t r = 1; r < 4; ++r) EXPECT_GT(peaks.off[r] - peaks.on[r], 0.8 * peaks.model_mb) << on << off;
  // The main process records its build (as DeepSpeed's zero.Init) and each unit's group computes its values
  // when it is made, so it too never holds the whole model.
  EXPECT_GT(on.value("groups_computed_when_made", 0), 8) << on;
  EXPECT_EQ(off.value("groups_computed_when_made", -1), 0) << off;
  EXPECT_GT(peaks.off[0] - peaks.on[0], 0.6 * peaks.model_mb) << on << off;
}

TEST(ShardedGpt, AFullShardRunSavedShardedOnFourRanksResumesOnThreeWithShardGradOp) {
  // A real transformer with one unit per block: saved as SHARDED_STATE_DICT (every rank writes only its
  // shards) by FULL_SHARD on 4 ranks x 3, resumed by SHARD_GRAD_OP on 3 ranks x 4 (same global batch).
  auto zero3 = strategies()[2];
  Args sharded_sd = zero3.flags;
  sharded_sd.insert(sharded_sd.end(), {"--fsdp_state_dict_type", "SHARDED_STATE_DICT"});
  const auto& zero2 = strategies()[1];
  auto whole_dir = temp_dir("gpt-reshard-whole"), split_dir = temp_dir("gpt-reshard-split");
  auto whole = gpt_run(3, zero3.flags, 4, whole_dir, {"--max_steps", "10"});
  gpt_run(4, sharded_sd, 3, split_dir, {"--max_steps", "5", "--checkpoint_every", "5"});
  const auto checkpoint = split_dir + "/checkpoints/checkpoint_0";
  ASSERT_TRUE(fs::exists(checkpoint + "/shards_rank3.safetensors"));
  EXPECT_FALSE(fs::exists(checkpoint + "/model.safetensors"));  // nothing gathered
  auto resumed = gpt_run(3, zero2.flags, 4, split_dir, {"--max_steps", "10", "--resume_from", "latest"});
  ASSERT_TRUE(whole.contains("final_train_loss") && resumed.contains("final_train_loss"));
  EXPECT_EQ(resumed["global_step"], 10);
  EXPECT_EQ(resumed["num_processes"], 3);
  EXPECT_NEAR(resumed["final_train_loss"].get<double>(), whole["final_train_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(resumed["val_loss"].get<double>(), whole["val_loss"].get<double>(), 1e-5);
  expect_same_params(split_dir, whole_dir, 1e-4);
}

TEST(ShardedGpt, AnUnknownLayerClassIsRefusedNamingTheClassesThatExist) {
  auto r = run(launch(2,
                      {"--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                       "--fsdp_transformer_layer_cls_to_wrap", "Blok"},
                      kGpt),
               60);
  EXPECT_NE(r.exit_code, 0);
  const auto text = r.out + r.err;
  EXPECT_NE(text.find("\"Blok\""), std::string::npos) << text;
  EXPECT_NE(text.find("BlockImpl"), std::string::npos) << text;
}

TEST(ShardedGpt, HybridShardOnTwoMachinesOfTwoRanksMatchesOneProcess) {
  // Two launchers form one 4-rank job ("machines" on loopback): HYBRID_SHARD shards inside each machine
  // (2 ranks) and averages each shard's gradients with its replica on the other machine.
  auto one_dir = temp_dir("gpt-hsdp-one"), dir = temp_dir("gpt-hsdp");
  auto one = gpt_run(1, {}, 8, one_dir);
  const int port = xlr8::pick_free_port();
  auto machine = [&](int rank) {
    Args flags{"--num_machines", "2", "--machine_rank", std::to_string(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", std::to_string(port), "--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD",
               "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"};
    auto a = launch(4, flags, kGpt);
    Args rest{"--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--batch_size", "2", "--lr",
              "3e-3", "--val_windows", "24", "--output_dir", dir, "--max_steps", "8", "--checkpoint_every", "8"};
    a.insert(a.end(), rest.begin(), rest.end());
    return a;
  };
  Process m0(machine(0)), m1(machine(1));
  auto r0 = m0.wait(180), r1 = m1.wait(180);
  ASSERT_EQ(r0.exit_code, 0) << r0.out << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  auto got = last_json(r0.out);
  EXPECT_EQ(got["num_processes"], 4);
  EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
  expect_same_params(dir, one_dir, 1e-4);
  // Sharded over 2 ranks, not 4: ZeRO-3's 16 bytes per parameter over 2.
  const double psi = one["parameters"].get<double>();
  EXPECT_NEAR(got["state_bytes_per_rank"].get<double>(), 8 * psi, 0.05 * 8 * psi);
  // Its checkpoint (each shard written once, by the first replica) resumes on one process and continues
  // as one process would have: equal to 10 uninterrupted steps on one process.
  auto ten = gpt_run(1, {}, 8, temp_dir("gpt-hsdp-ten"), {"--max_steps", "10"});
  auto resumed = gpt_run(1, {}, 8, dir, {"--max_steps", "10", "--resume_from", "latest"});
  ASSERT_TRUE(resumed.contains("val_loss"));
  EXPECT_NEAR(resumed["final_train_loss"].get<double>(), ten["final_train_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(resumed["val_loss"].get<double>(), ten["val_loss"].get<double>(), 1e-5);
}

TEST(EstimateMemory, CountsAModelFileOrShardedIndexAndNamesBadArguments) {
  auto dir = temp_dir("estimate");
  auto got = gpt_run(1, {}, 4, dir, {"--max_steps", "1", "--checkpoint_every", "1"});
  ASSERT_TRUE(got.contains("parameters"));
  auto sharded = temp_dir("estimate-index");
  auto r = run({kXlr8, "merge-weights", dir + "/checkpoints/checkpoint_0", sharded, "--max_shard_size", "50KB"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(sharded + "/model.safetensors.index.json"));
  for (const auto& model : {dir + "/model", sharded, sharded + "/model.safetensors.index.json"}) {
    r = run({kXlr8, "estimate-memory", "--model", model, "--json", "--num_processes", "4"}, 30);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto out = last_json(r.out);
    EXPECT_EQ(out["parameters"], got["parameters"]) << model;
    EXPECT_EQ(out["rows"][0]["training_bytes_per_rank"]["zero3"].get<double>(), 4 * got["parameters"].get<double>());
  }
  // Under pp a zero-bubble schedule keeps zero3's units gathered through the step: its parameters are zero2's.
  for (const std::string schedule : {"1F1B", "InterleavedZeroBubble"}) {
    r = run({kXlr8, "estimate-memory", "--params", "1e9", "--num_processes", "4", "--pp_size", "2", "--pp_schedule",
             schedule, "--dtypes", "fp32", "--json"},
            30);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto bytes = last_json(r.out)["rows"][0]["training_bytes_per_rank"];
    // A stage of 5e8 parameters over 2 ranks: zero2 holds 4 bytes of each whole, 12 of each half; zero3 16 of each half.
    EXPECT_EQ(bytes["zero2"].get<double>(), 5e9) << schedule;
    EXPECT_EQ(bytes["zero3"].get<double>(), schedule == "1F1B" ? 4e9 : 5e9) << schedule;
  }
  const std::vector<std::pair<Args, std::string>> bad{
      {{"--params", "1e9", "--n_layer", "2"}, "give exactly one of --params"},
      {{"--params", "1e9", "--num_processes", "0"}, "--num_processes 0 must be 1 or more"},
      {{"--params", "1e9", "--strategies", "zero9"}, "--strategies \"zero9\" is not a strategy"},
      {{"--params", "-5"}, "--params: must be above 0 and at most 1e+18, not -5"},
      {{"--params", "nan"}, "--params: must be above 0 and at most 1e+18, not nan"},  // it named the other inputs
      {{"--n_layer", "2", "--d_model", "30", "--n_head", "4", "--seq_len", "8"}, "--d_model 30 is not a multiple of --n_head 4"},
      {{"--model", dir + "/nothing"}, "holds no model"},
  };
  for (const auto& [args, message] : bad) {
    Args a{kXlr8, "estimate-memory"};
    a.insert(a.end(), args.begin(), args.end());
    r = run(a, 30);
    EXPECT_NE(r.exit_code, 0) << message;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
}

TEST(ShardedCheckpoint, LoadModelReadsSaveModelsFilesUnderEveryStrategyAndOtherRanksHoldOnlyTheirParts) {
  // A 7.2 M-parameter GPT (29 MB) trained 3 steps on one process and saved; loaded with --init_from
  // (Accelerator::load_model) under DDP and sharding, it scores the same validation loss. Rank 0 reads
  // each tensor once; every rank keeps its part: the other ranks' peak RSS grows by far less than the model.
  auto gpt = [&](int processes, const Args& flags, const std::string& dir, Args extra) {
    auto a = launch(processes, flags, kGpt);
    Args rest{"--n_layer", "4", "--d_model", "384", "--n_head", "6", "--seq_len", "32", "--batch_size", "2",
              "--val_windows", "24", "--output_dir", dir};
    a.insert(a.end(), rest.begin(), rest.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a, 180);
  };
  auto base_dir = temp_dir("load-base");
  auto r = gpt(1, {}, base_dir, {"--max_steps", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto base = last_json(r.out);
  const double model_mb = base["parameters"].get<double>() * 4 / (1024.0 * 1024.0);
  const std::vector<std::pair<int, Strategy>> runs{
      {2, {"ddp", {}}}, {3, strategies()[2]}, {2, strategies()[1]}};
  for (const auto& [n, s] : runs) {
    SCOPED_TRACE(fmt::format("{} on {}", s.name, n));
    r = gpt(n, s.flags, temp_dir("load"), {"--max_steps", "0", "--init_from", base_dir + "/model"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto got = last_json(r.out);
    EXPECT_NEAR(got["val_loss"].get<double>(), base["val_loss"].get<double>(), 1e-5);
    const auto growth = got["load_peak_rss_growth_mb"].get<std::vector<double>>();
    ASSERT_EQ(growth.size(), static_cast<size_t>(n));
    // One receive buffer as large as the largest tensor (2.4 MB here), never the model.
    for (int rank = 1; rank < n; ++rank) EXPECT_LT(growth[rank], model_mb / 4) << "rank " << rank;
    std::printf("%s on %d: model %.1f MB, peak RSS growth while loading per rank [%s] MB\n", s.name.c_str(), n, model_mb,
                fmt::format("{:.1f}", fmt::join(growth, ", ")).c_str());
  }
  // Another shape is refused before anything changes, naming the tensor and both shapes.
  auto a = launch(2, strategies()[2].flags, kGpt);
  Args rest{"--n_layer", "4", "--d_model", "128", "--n_head", "4", "--seq_len", "32", "--max_steps", "0",
            "--output_dir", temp_dir("load-bad"), "--init_from", base_dir + "/model"};
  a.insert(a.end(), rest.begin(), rest.end());
  r = run(a, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("wte.weight ([256, 384] in the file, [256, 128] in the model)"), std::string::npos) << r.err;
}
