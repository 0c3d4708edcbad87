// DeepSpeed's pipeline API through the real launcher (issue 46): examples/pipeline_deepspeed, a PipelineModule of
// layer specs whose embedding is tied to the output head, trained by engine->train_batch() from a DeepSpeed JSON,
// equals one process on 2, 3 and 4 stages (uneven cuts), under each partition method, with recomputed regions, and
// with data parallelism (DDP and ZeRO 1-3, tied); its checkpoints resume on another layout; what cannot run is one
// line before training.
#include <gtest/gtest.h>

#include <fstream>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace {

using Args = std::vector<std::string>;

const std::string kDsPipelineJson = kSource + "/examples/pipeline_deepspeed/ds_pipeline.json";

// xlr8 launch --num_processes N <launcher flags> pipeline_deepspeed --config <json> <program flags>.
ProcessResult launch_ds_pipeline(int processes, const Args& launcher, const Args& program = {}, const std::string& json = kDsPipelineJson) {
  Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
  command.insert(command.end(), launcher.begin(), launcher.end());
  command.insert(command.end(), {kPipelineDeepSpeed, "--config", json});
  command.insert(command.end(), program.begin(), program.end());
  return run(command, 120);
}

Args pp_flags(int pp) { return {"--parallelism_config_pp_size", std::to_string(pp)}; }
// Two pipelines of two stages, data parallel by the JSON's ZeRO stage (0: DDP).
const Args kTwoPipelines{"--parallelism_config_pp_size", "2", "--parallelism_config_dp_shard_size", "2"};

nlohmann::json ds_result(const ProcessResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return r.exit_code == 0 ? last_json(r.out) : nlohmann::json::object();
}

// The same losses at every step (AdamW: a gradient summed in another order moves a parameter by a few ulps), the
// same evaluation, and the same saved parameters.
void expect_as_ds_one_process(const nlohmann::json& got, const nlohmann::json& one) {
  ASSERT_TRUE(got.contains("losses") && one.contains("losses"));
  expect_close(got["losses"].get<std::vector<double>>(), one["losses"].get<std::vector<double>>(), 1e-5);
  EXPECT_NEAR(got["eval_loss"].get<double>(), one["eval_loss"].get<double>(), 1e-5);
}

// A copy of the example's JSON with `changes` merged in.
std::string ds_json_with(const nlohmann::json& changes) {
  std::ifstream in(kDsPipelineJson);
  auto json = nlohmann::json::parse(in);
  json.merge_patch(changes);
  const auto path = temp_dir("ds-pipeline-json") + "/ds.json";
  std::ofstream(path) << json.dump();
  return path;
}

}  // namespace

// The embedding and the head share one weight: on one process one parameter used twice, under pp a copy on the last
// stage that takes the first stage's values and gives back its gradient. 7 layers over 2, 3 and 4 stages cut
// unevenly; each rank holds only its stage's parameters.
TEST(DeepSpeedPipeline, TrainBatchWithATiedEmbeddingOnTwoThreeAndFourStagesEqualsOneProcess) {
  const auto one_dir = temp_dir("ds-pipe-one");
  const auto one_run = launch_ds_pipeline(1, {}, {"--save_model", one_dir + "/model"});
  const auto one = ds_result(one_run);
  ASSERT_TRUE(one.contains("losses"));
  const auto losses = one["losses"].get<std::vector<double>>();
  EXPECT_LT(losses.back(), losses.front());  // it learns
  for (int pp : {2, 3, 4}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    const auto dir = temp_dir("ds-pipe");
    const auto got = ds_result(launch_ds_pipeline(pp, pp_flags(pp), {"--save_model", dir + "/model"}));
    expect_as_ds_one_process(got, one);
    EXPECT_EQ(got["stage_starts"].size(), static_cast<size_t>(pp));
    EXPECT_LT(got["parameter_bytes"].get<int64_t>(), one["parameter_bytes"].get<int64_t>());
    expect_same_params(dir, one_dir, 1e-5);  // the tied weight saved once, under its first layer's name
  }
  // The JSON's "pipeline": {"stages": 2}, given to the launcher, sets the launch's pp by itself.
  const auto json = ds_json_with({{"pipeline", {{"stages", 2}}}});
  expect_as_ds_one_process(
      ds_result(launch_ds_pipeline(2, {"--use_deepspeed", "--deepspeed_config_file", json}, {}, json)), one);
}

// Each partition method cuts where it says; recomputed regions and data parallelism over two pipelines change
// nothing in the numbers.
TEST(DeepSpeedPipeline, PartitionMethodsRecomputationAndDataParallelPipelinesEqualOneProcess) {
  const auto one = ds_result(launch_ds_pipeline(1, {}));
  const auto by_type = ds_result(launch_ds_pipeline(2, pp_flags(2), {"--partition_method", "type:block"}));
  expect_as_ds_one_process(by_type, one);
  EXPECT_EQ(by_type["stage_starts"], nlohmann::json({0, 4}));  // 5 blocks: 3 on the first stage (with the embedding)
  const auto uniform = ds_result(launch_ds_pipeline(3, pp_flags(3), {"--partition_method", "uniform"}));
  expect_as_ds_one_process(uniform, one);
  EXPECT_EQ(uniform["stage_starts"], nlohmann::json({0, 3, 5}));  // 7 layers: 3, 2, 2
  // Recomputed regions of 2 layers: the first stage's blocks run each forward twice (again in backward).
  const auto plain = ds_result(launch_ds_pipeline(2, pp_flags(2)));
  const auto recomputed = ds_result(launch_ds_pipeline(2, pp_flags(2), {"--activation_checkpoint_interval", "2"}));
  expect_as_ds_one_process(recomputed, one);
  EXPECT_GT(plain["block_forwards"].get<int64_t>(), 0);
  EXPECT_EQ(recomputed["block_forwards"].get<int64_t>(), 2 * plain["block_forwards"].get<int64_t>());
  // The JSON's interval, when the module sets none, does the same.
  EXPECT_EQ(ds_result(launch_ds_pipeline(2, pp_flags(2), {},
                                         ds_json_with({{"pipeline", {{"activation_checkpoint_interval", 1}}}})))
                ["block_forwards"],
            recomputed["block_forwards"]);
  expect_as_ds_one_process(ds_result(launch_ds_pipeline(4, kTwoPipelines)), one);  // pp 2 x dp 2 (DDP), tied
  // DeepSpeed refuses ZeRO-2 and 3 with pipelines; here the stages shard, the tied embedding's copy taking its values
  // from the first stage's shards and giving its gradient to them.
  for (int zero : {1, 2, 3}) {
    SCOPED_TRACE("zero stage " + std::to_string(zero));
    expect_as_ds_one_process(
        ds_result(launch_ds_pipeline(4, kTwoPipelines, {}, ds_json_with({{"zero_optimization", {{"stage", zero}}}}))), one);
  }
  const auto untied = ds_result(launch_ds_pipeline(1, {}, {"--untied"}));
  expect_as_ds_one_process(
      ds_result(launch_ds_pipeline(4, kTwoPipelines, {"--untied"}, ds_json_with({{"zero_optimization", {{"stage", 3}}}}))),
      untied);
}

// A checkpoint of pp 2 resumed on one process, and one of one process resumed on pp 2 x dp 2, continue as the
// straight run does.
TEST(DeepSpeedPipeline, CheckpointsResumeOnAnotherLayout) {
  const auto straight = ds_result(launch_ds_pipeline(1, {}, {"--steps", "6"}))["losses"].get<std::vector<double>>();
  ASSERT_EQ(straight.size(), 6u);
  const std::vector<double> tail(straight.begin() + 3, straight.end());
  for (const auto& [first, then] : std::vector<std::pair<int, int>>{{2, 1}, {1, 4}}) {
    SCOPED_TRACE(std::to_string(first) + " processes, then " + std::to_string(then));
    const auto dir = temp_dir("ds-pipe-ckpt");
    auto layout = [](int processes) { return processes == 1 ? Args{} : processes == 2 ? pp_flags(2) : kTwoPipelines; };
    const Args first_stages = layout(first), then_stages = layout(then);
    ds_result(launch_ds_pipeline(first, first_stages, {"--steps", "3", "--save_checkpoint", dir}));
    const auto resumed = ds_result(launch_ds_pipeline(then, then_stages, {"--steps", "3", "--load_checkpoint", dir}));
    ASSERT_TRUE(resumed.contains("losses"));
    EXPECT_EQ(resumed["global_steps"], 6);
    expect_close(resumed["losses"].get<std::vector<double>>(), tail, 1e-5);
  }
}

// What cannot run is refused in one line naming the key, before any step.
TEST(DeepSpeedPipeline, WhatCannotRunIsOneLineBeforeTraining) {
  const std::vector<std::tuple<std::string, int, Args, Args, std::string, std::string>> cases{
      {"stages disagree", 2, pp_flags(2), {}, ds_json_with({{"pipeline", {{"stages", 4}}}}), "pipeline.stages 4"},
      {"no such type", 2, pp_flags(2), {"--partition_method", "type:Attention"}, kDsPipelineJson, "type:Attention"},
      {"unknown method", 2, pp_flags(2), {"--partition_method", "best_effort"}, kDsPipelineJson, "partition_method"},
      {"partition disagrees", 2, pp_flags(2), {"--partition_method", "uniform"},
       ds_json_with({{"pipeline", {{"partition", "parameters"}}}}), "pipeline.partition \"parameters\""},
      {"more stages than layers", 8, pp_flags(8), {}, kDsPipelineJson, "8 stages"},
      {"fp16", 2, pp_flags(2), {}, ds_json_with({{"fp16", {{"enabled", true}}}}), "fp16.enabled under pp"},
      {"another schedule", 2, {"--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "GPipe"}, {},
       kDsPipelineJson, "runs 1F1B over its gradient_accumulation_steps"}};
  for (const auto& [name, processes, launcher, program, json, expected] : cases) {
    SCOPED_TRACE(name);
    const auto r = launch_ds_pipeline(processes, launcher, program, json);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE((r.out + r.err).find(expected), std::string::npos) << r.out << r.err;
    EXPECT_EQ((r.out + r.err).find("\"losses\""), std::string::npos);
  }
}

// examples/gpt_deepspeed --pipeline: the GPT as layer specs (embeddings tied to the head, blocks, final norm) in a
// PipelineModule, on the fortunes text, trains on pp 2 and 4 and on two pipelines of 2 (DDP) as on one process.
TEST(DeepSpeedPipeline, TheGptAsLayerSpecsTrainsOnEveryLayoutAsOneProcess) {
  const auto json = temp_dir("ds-pipe-gpt") + "/ds.json";
  std::ofstream(json) << R"({"train_batch_size": 8, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                             "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})";
  auto train = [&](int processes, const Args& launcher) {
    Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
    command.insert(command.end(), launcher.begin(), launcher.end());
    command.insert(command.end(), {kGptDeepSpeed, "--deepspeed_config", json, "--pipeline", "--max_steps", "6",
                                   "--n_layer", "2", "--d_model", "32", "--n_head", "2", "--seq_len", "32"});
    return ds_result(run(command, 180));
  };
  const auto one = train(1, {});
  ASSERT_TRUE(one.contains("losses"));
  const auto losses = one["losses"].get<std::vector<double>>();
  ASSERT_EQ(losses.size(), 6u);
  EXPECT_LT(losses.back(), losses.front());
  for (const auto& [name, processes, launcher] : std::vector<std::tuple<std::string, int, Args>>{
           {"pp 2", 2, pp_flags(2)}, {"pp 4", 4, pp_flags(4)}, {"pp 2 x DDP 2", 4, kTwoPipelines}}) {
    SCOPED_TRACE(name);
    const auto got = train(processes, launcher);
    ASSERT_TRUE(got.contains("losses"));
    EXPECT_EQ(got["stage_starts"].size(), static_cast<size_t>(got["pp_size"].get<int>()));
    expect_close(got["losses"].get<std::vector<double>>(), losses, 1e-5);
    if (name == "pp 2 x DDP 2") continue;
    // `xlr8 estimate-memory --pp_size` cuts the same shape as the PipelineModule does: each stage's parameters
    // predicted exactly (the tied head's copy apart, which the last stage runs without training it).
    const auto pp = std::to_string(processes);
    const auto estimate = run({kXlr8, "estimate-memory", "--n_layer", "2", "--d_model", "32", "--n_head", "2",
                               "--seq_len", "32", "--pp_size", pp, "--num_processes", pp, "--json"},
                              30);
    ASSERT_EQ(estimate.exit_code, 0) << estimate.err;
    const auto predicted = last_json(estimate.out)["pp"]["stage_parameters"];
    ASSERT_EQ(predicted.size(), got["parameters_by_rank"].size());
    for (size_t s = 0; s < predicted.size(); ++s)
      EXPECT_EQ(predicted[s].get<double>(), got["parameters_by_rank"][s].get<double>()) << "stage " << s;
  }
}
