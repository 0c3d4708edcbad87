// The ParallelPlan through the real launcher: the launch's flags and keys, a DeepSpeed JSON under the Accelerator
// and under deepspeed::initialize, and the program's AcceleratorOptions resolve into one plan; the strategy every
// prepared model trains with is the one the plan names, and describe() tells it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

using Args = std::vector<std::string>;

namespace {


nlohmann::json result_of(const ProcessResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.out;
  return last_json(r.out);
}

std::string write_json(const std::string& dir, const nlohmann::json& config) {
  const auto path = dir + "/ds.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

}  // namespace

TEST(ParallelPlan, TheLaunchsFsdpKeysAndTheProgramsOptionsBecomeOnePlanThatTheStrategyFollows) {
  for (const auto& [sharding, stage] : {std::pair{"SHARD_GRAD_OP", 2}, std::pair{"FULL_SHARD", 3}}) {
    SCOPED_TRACE(sharding);
    const auto dir = temp_dir("plan-fsdp");
    // The launch asks for fp16 and accumulation 2; the program for bf16 and 1: the program's precision wins, the
    // launch's accumulation wins (as in Accelerate).
    const auto r = run({kXlr8, "launch", "--num_processes", "3", "--use_fsdp", "--fsdp_sharding_strategy", sharding,
                        "--mixed_precision", "fp16", "--gradient_accumulation_steps", "2", kTrain, "--precision", "bf16",
                        "--accum", "1", "--batch", "4", "--steps", "2", "--out", dir},
                       120, {{"XLR8_LOG_LEVEL", "debug"}});
    const auto result = result_of(r);
    const auto& plan = result["plan"];
    EXPECT_EQ(plan["strategy"], fmt::format("zero{}", stage));
    EXPECT_EQ(result["strategy"], plan["strategy"]);
    EXPECT_EQ(plan["zero"]["stage"], stage);
    EXPECT_EQ(plan["data_parallel_dim"], "dp");
    EXPECT_EQ(plan["mixed_precision"], "bf16");
    EXPECT_EQ(plan["loss_scaler"], false);
    EXPECT_EQ(plan["gradient_accumulation_steps"], 2);
    EXPECT_EQ(plan["mesh"]["pp"], 1);
    int ranks = 1;
    for (const auto& [dim, size] : plan["mesh"].items()) ranks *= size.get<int>();
    EXPECT_EQ(ranks, 3);
    EXPECT_NE(r.err.find(fmt::format("xlr8 plan: data parallel: zero{} over dp", stage)), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("xlr8 plan: pipeline: none"), std::string::npos) << r.err;
  }
}

TEST(ParallelPlan, ADeepSpeedJsonWinsUnderTheAcceleratorAndIsTheEnginesOnlySource) {
  const nlohmann::json json = {{"train_batch_size", 24},
                               {"gradient_accumulation_steps", 2},
                               {"gradient_clipping", 0.5},
                               {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
                               {"zero_optimization", {{"stage", 3}, {"reduce_bucket_size", 300}}}};
  // Under the Accelerator (--use_deepspeed --deepspeed_config_file): the JSON's stage beats the launch's
  // --zero_stage, its clipping is applied at each step, ZeRO-3 gathers module by module.
  {
    const auto dir = temp_dir("plan-ds-accelerate");
    auto accelerate = json;
    accelerate.erase("optimizer");
    const auto result = result_of(run({kXlr8, "launch", "--num_processes", "2", "--use_deepspeed",
                                       "--deepspeed_config_file", write_json(dir, accelerate), "--zero_stage", "1",
                                       kEngine, "--accelerate", "--steps", "2", "--out", dir},
                                      120));
    const auto& plan = result["plan"];
    EXPECT_EQ(plan["strategy"], "zero3");
    EXPECT_EQ(result["strategy"], "zero3");
    EXPECT_EQ(plan["zero"]["auto_wrap_policy"], "GUARDED_MODULES");
    EXPECT_EQ(plan["clip_at_step"], 0.5);
    EXPECT_EQ(plan["gradient_accumulation_steps"], 2);
  }
  // deepspeed::initialize: the same JSON configures the engine's own Accelerator; it clips by itself.
  {
    const auto dir = temp_dir("plan-ds-engine");
    const auto result = result_of(run({kXlr8, "launch", "--num_processes", "2", kEngine, "--config",
                                       write_json(dir, json), "--steps", "2", "--out", dir},
                                      120));
    const auto& plan = result["plan"];
    EXPECT_EQ(plan["strategy"], "zero3");
    EXPECT_EQ(result["strategy"], "zero3");
    EXPECT_EQ(plan["zero"]["auto_wrap_policy"], "GUARDED_MODULES");
    EXPECT_EQ(plan["clip_at_step"], 0.0);
    EXPECT_EQ(plan["gradient_accumulation_steps"], 2);
  }
}
