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

// train_batch_size 24 with accumulation 2: the micro-batch is 24 / ranks / 2 (12, 6, 4, 3 on 1-4 ranks).
std::string write_config(const std::string& dir, int stage) {
  const nlohmann::json config = {
      {"train_batch_size", 24},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"steps_per_print", 1000},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 300}}}};  // several buckets
  const auto path = dir + "/ds_config.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

Run engine_run(int processes, int stage) {
  auto dir = temp_dir("ds-engine");
  Args a{kXlr8, "launch", "--num_processes", std::to_string(processes), kEngine, "--config", write_config(dir, stage),
         "--steps", "4", "--out", dir};
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
