// The DeepSpeed engine through the real launcher: every ZeRO stage on 2, 3 and 4 ranks equals one
// process on the same global batch, from one JSON whose batch sizes derive per world size.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "oracle.hpp"
#include "process_runner.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {

const std::string kXlr8 = XLR8_BIN;
const std::string kEngine = ENGINE_BIN;
const std::string kGptDeepSpeed = GPT_DEEPSPEED_BIN;

// train_batch_size 24 with accumulation 2: the micro-batch is 24 / ranks / 2 (12, 6, 4, 3 on 1-4 ranks).
std::string write_config(const std::string& dir, int stage) {
  const nlohmann::json config = {
      {"train_batch_size", 24},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"steps_per_print", 1000},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
      // Several buckets; at stage 3 the biases and norms (16 elements) stay whole, the weights are sharded.
      {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 300}, {"stage3_param_persistence_threshold", 20}}}};
  const auto path = dir + "/ds_config.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

Run engine_run(int processes, int stage, Args extra = {}, int steps = 4) {
  auto dir = temp_dir("ds-engine");
  Args a{kXlr8, "launch", "--num_processes", std::to_string(processes), kEngine, "--config", write_config(dir, stage),
         "--steps", std::to_string(steps), "--out", dir};
  a.insert(a.end(), extra.begin(), extra.end());
  return oracle_command(a, dir, 120);
}

}  // namespace

TEST(DeepSpeedEngineOracle, EveryZeroStageOnTwoThreeAndFourRanksEqualsOneProcess) {
  auto one = engine_run(1, 0);
  ASSERT_EQ(one.losses.size(), 4u);
  EXPECT_EQ(one.result["micro_batch"], 12);
  for (int stage : {0, 1, 2, 3})
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(fmt::format("stage {} on {} ranks", stage, n));
      auto got = engine_run(n, stage);
      ASSERT_EQ(got.losses.size(), 4u);
      EXPECT_EQ(got.result["strategy"], stage == 0 ? "ddp" : fmt::format("zero{}", stage));
      EXPECT_EQ(got.result["micro_batch"], 24 / n / 2);
      EXPECT_EQ(got.result["global_steps"], 4);
      EXPECT_EQ(got.result["global_samples"], 96);
      expect_close(got.losses, one.losses, 1e-5);
      expect_same_params(got.dir, one.dir, 1e-5);
    }
}

TEST(DeepSpeedEngineOracle, ACheckpointSavedOnThreeRanksAtStage3ResumesOnTwoAtStage2AsIfUninterrupted) {
  auto one = engine_run(1, 0);
  auto first = engine_run(3, 3, {"--save_at", "2"}, 2);
  ASSERT_EQ(first.losses.size(), 2u);
  std::ifstream latest(first.dir + "/ckpt/latest");
  std::string tag;
  std::getline(latest, tag);
  EXPECT_EQ(tag, "global_step2");
  // `xlr8 merge-weights` (our zero_to_fp32) turns the stage-3 shards into the model save_model wrote.
  auto merged = run({kXlr8, "merge-weights", first.dir + "/ckpt/global_step2", first.dir + "/merged/model"}, 60);
  ASSERT_EQ(merged.exit_code, 0) << merged.err;
  expect_same_params(first.dir + "/merged", first.dir, 0);
  auto resumed = engine_run(2, 2, {"--resume", first.dir + "/ckpt"});
  ASSERT_EQ(resumed.losses.size(), 2u);  // steps 3 and 4
  expect_close({first.losses[0], first.losses[1], resumed.losses[0], resumed.losses[1]}, one.losses, 1e-5);
  EXPECT_EQ(resumed.result["global_steps"], 4);
  expect_same_params(resumed.dir, one.dir, 1e-5);
}

TEST(DeepSpeedEngineExample, TheGptTrainsThroughTheEngineFromTheShippedJsonAndItsStage3Variant) {
  const std::string shipped = std::string(XLR8_SOURCE_DIR) + "/examples/gpt_deepspeed/zero2.json";
  auto dir = temp_dir("gpt-ds");
  std::ifstream in(shipped);
  auto stage3 = nlohmann::json::parse(in);
  stage3["zero_optimization"]["stage"] = 3;
  std::ofstream(dir + "/zero3.json") << stage3.dump();
  for (const auto& [config, stage] : std::vector<std::pair<std::string, int>>{{shipped, 2}, {dir + "/zero3.json", 3}}) {
    SCOPED_TRACE(config);
    auto r = run({kXlr8, "launch", "--num_processes", "2", kGptDeepSpeed, "--deepspeed_config", config, "--max_steps",
                  "12", "--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32", "--log_every", "4"},
                 180);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    auto got = last_json(r.out);
    EXPECT_EQ(got["global_steps"], 12);
    EXPECT_EQ(got["stage"], stage);
    const auto losses = got["losses"].get<std::vector<double>>();
    ASSERT_EQ(losses.size(), 12u);
    EXPECT_LT(losses.back(), losses.front() - 0.1) << got;  // it learns (the schedule warms up from 0)
  }
}
