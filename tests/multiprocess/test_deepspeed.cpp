// The DeepSpeed engine through the real launcher: every ZeRO stage on 2, 3 and 4 ranks equals one
// process on the same global batch, from one JSON whose batch sizes derive per world size.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "oracle.hpp"
#include "process_runner.hpp"
#include "programs.hpp"

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {


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

// The Accelerate way: the JSON leaves every value Accelerate fills "auto"; the launch gives accumulation 2 and
// clipping 0.5, the worker DummyOptim(lr 1e-2, weight decay 0.01), DummyScheduler(warm-up 3), hidden size 16
// and a loader whose batch fills the micro-batch. `engine_twin` writes the values this resolves to.
std::string write_auto_config(const std::string& dir, int stage) {
  const nlohmann::json config = {
      {"train_batch_size", "auto"},
      {"train_micro_batch_size_per_gpu", "auto"},
      {"gradient_accumulation_steps", "auto"},
      {"gradient_clipping", "auto"},
      {"fp16", {{"enabled", "auto"}}},
      {"bf16", {{"enabled", "auto"}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"weight_decay", "auto"}, {"torch_adam", true}}}}},
      {"scheduler",
       {{"type", "WarmupLR"},
        {"params", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}}}}},
      {"zero_optimization",
       {{"stage", stage},
        {"reduce_bucket_size", "auto"},
        {"stage3_prefetch_bucket_size", "auto"},
        {"stage3_param_persistence_threshold", "auto"}}}};
  const auto path = dir + "/ds_auto.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

std::string write_engine_twin(const std::string& dir) {
  const nlohmann::json config = {
      {"train_batch_size", 24},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
      {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", 0}, {"warmup_max_lr", 1e-2}, {"warmup_num_steps", 3}}}}},
      {"zero_optimization", {{"stage", 0}, {"reduce_bucket_size", 256}}}};
  const auto path = dir + "/ds_twin.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

Run accelerate_run(int processes, int stage, const std::string& clipping = "0.5") {
  auto dir = temp_dir("ds-accelerate");
  return oracle_command({kXlr8, "launch", "--num_processes", std::to_string(processes), "--use_deepspeed",
                         "--deepspeed_config_file", write_auto_config(dir, stage), "--gradient_accumulation_steps", "2",
                         "--gradient_clipping", clipping, kEngine, "--accelerate", "--steps", "4", "--out", dir},
                        dir, 120);
}

bool has_auto(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>() == "auto";
  if (!j.is_structured()) return false;  // iterating a number yields the number itself
  for (const auto& item : j)
    if (has_auto(item)) return true;
  return false;
}

}  // namespace

TEST(DeepSpeedAccelerateOracle, AnAllAutoJsonUnderTheAcceleratorEqualsTheEngineOnWhatItResolvesToAtEveryStage) {
  auto twin_dir = temp_dir("ds-twin");
  auto engine = oracle_command({kXlr8, "launch", "--num_processes", "1", kEngine, "--config", write_engine_twin(twin_dir),
                                "--steps", "4", "--out", twin_dir},
                               twin_dir, 120);
  ASSERT_EQ(engine.losses.size(), 4u);
  auto one = accelerate_run(1, 0);
  expect_close(one.losses, engine.losses, 1e-6);
  expect_same_params(one.dir, engine.dir, 1e-6);
  const auto& resolved = one.result["resolved"];
  EXPECT_FALSE(has_auto(resolved)) << resolved;
  EXPECT_EQ(resolved["train_batch_size"], 24);
  EXPECT_EQ(resolved["train_micro_batch_size_per_gpu"], 12);
  EXPECT_EQ(resolved["gradient_accumulation_steps"], 2);
  EXPECT_EQ(resolved["gradient_clipping"], 0.5);
  EXPECT_EQ(resolved["fp16"]["enabled"], false);
  EXPECT_EQ(resolved["optimizer"]["params"]["lr"], 1e-2);
  EXPECT_EQ(resolved["scheduler"]["params"]["warmup_max_lr"], 1e-2);
  EXPECT_EQ(resolved["scheduler"]["params"]["warmup_num_steps"], 3);
  EXPECT_EQ(resolved["zero_optimization"]["reduce_bucket_size"], 256);  // hidden size 16, squared
  EXPECT_EQ(resolved["zero_optimization"]["stage3_param_persistence_threshold"], 160);
  // The JSON's clipping is applied at every step: without it the run is another one.
  auto unclipped = accelerate_run(1, 0, "1000");
  EXPECT_GT(std::abs(unclipped.losses.back() - engine.losses.back()), 1e-4);
  for (int stage : {0, 1, 2, 3})
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(fmt::format("stage {} on {} ranks", stage, n));
      auto got = accelerate_run(n, stage);
      EXPECT_EQ(got.result["strategy"], stage == 0 ? "ddp" : fmt::format("zero{}", stage));
      EXPECT_EQ(got.result["micro_batch"], 24 / n / 2);
      expect_close(got.losses, engine.losses, 1e-5);
      expect_same_params(got.dir, engine.dir, 1e-5);
    }
}

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

// DeepSpeed's `with deepspeed.zero.Init():` as xlr8::DeferredInitScope around the model's construction: at stage 3 on
// 2 and 3 ranks each sharding group's values are computed as it is made (on one process, whole at prepare), and the
// training equals one process's.
TEST(DeepSpeedEngineOracle, AModelBuiltUnderZeroInitTrainsAsOneProcessAtStageThree) {
  auto one = engine_run(1, 0);
  ASSERT_EQ(one.losses.size(), 4u);
  for (int n : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", n));
    auto got = engine_run(n, 3, {"--zero_init"});
    ASSERT_EQ(got.losses.size(), 4u);
    EXPECT_EQ(got.result["groups_computed_when_made"].get<int>() > 0, n > 1) << got.result;
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
  // Given the root, as zero_to_fp32.py is: `latest` is followed, and the tag it used is named.
  auto from_root = run({kXlr8, "merge-weights", first.dir + "/ckpt", first.dir + "/merged_root/model"}, 60);
  ASSERT_EQ(from_root.exit_code, 0) << from_root.err;
  EXPECT_NE(from_root.out.find("names the tag \"global_step2\""), std::string::npos) << from_root.out;
  expect_same_params(first.dir + "/merged_root", first.dir, 0);
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

// The JSON files users copy from Accelerate's templates and tests (tests/data/deepspeed_configs) train the
// GPT through the Accelerate path: the example supplies lr, weight decay, total and warm-up steps (its
// DummyOptim / DummyScheduler), the launch the precision, and nothing is left "auto". The example's own
// warm-up (0 steps, Accelerate's DummyScheduler default) fills "auto" as DeepSpeed's smallest, 2.
TEST(DeepSpeedAccelerateExample, EveryCopiedJsonTrainsTheGptThroughTheAcceleratePath) {
  const auto configs = fs::path(XLR8_SOURCE_DIR) / "tests/data/deepspeed_configs";
  int trained = 0;
  for (const auto& entry : fs::directory_iterator(configs)) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().filename().string());
    auto dir = temp_dir("gpt-ds-json");
    auto r = run({kXlr8, "launch", "--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file",
                  entry.path().string(), kGpt, "--max_steps", "4", "--n_layer", "1", "--d_model",
                  "32", "--n_head", "2", "--seq_len", "32", "--val_windows", "8", "--log_every", "2", "--output_dir", dir},
                 180);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    auto got = last_json(r.out);
    EXPECT_EQ(got["global_step"], 4);
    EXPECT_TRUE(std::isfinite(got["final_train_loss"].get<double>())) << got;
    const auto logged = r.out + r.err;
    const auto at = logged.find("resolved to ");
    ASSERT_NE(at, std::string::npos) << logged;
    const auto line = logged.substr(at + 12, logged.find('\n', at) - at - 12);
    const auto resolved = nlohmann::json::parse(line);
    EXPECT_FALSE(has_auto(resolved)) << line;
    std::ifstream file(entry.path());
    const auto given = nlohmann::json::parse(file);
    if (given["train_micro_batch_size_per_gpu"] == "auto") {
      EXPECT_EQ(resolved["train_micro_batch_size_per_gpu"], 16);  // the example's --batch_size
      EXPECT_EQ(resolved["train_batch_size"], 32);                 // on 2 ranks
    } else {  // the file's own value stays (and a warning says the loaders differ)
      EXPECT_EQ(resolved["train_micro_batch_size_per_gpu"], given["train_micro_batch_size_per_gpu"]);
      EXPECT_NE(logged.find("but the data loaders give 16 per process"), std::string::npos);
    }
    if (resolved.contains("optimizer")) {
      EXPECT_EQ(resolved["optimizer"]["params"]["lr"], 3e-4);
    }
    if (resolved.contains("scheduler")) {
      EXPECT_EQ(resolved["scheduler"]["params"]["warmup_num_steps"], 2);
    }
    ++trained;
  }
  EXPECT_EQ(trained, 9);
}

// DeepSpeed's AutoTP training config (issue 24): a JSON's tensor_parallel section splits the GPT through the
// engine. autotp_size alone (AutoTP), given to the launcher, which makes the mesh's tp dimension from it;
// partition_config rules (fused q/k/v with shape [3, -1], the rest by AutoTP) under the launch flag. Each
// trains as one process does on the same batch; a JSON asking for tp the launch did not make is refused
// with the flag to use.
TEST(DeepSpeedTensorParallel, TheJsonsAutotpSizeAndPartitionRulesSplitTheGptAndTrainAsOneProcess) {
  const auto dir = temp_dir("ds-tp");
  std::ifstream in(std::string(XLR8_SOURCE_DIR) + "/examples/gpt_deepspeed/zero2.json");
  auto base = nlohmann::json::parse(in);
  auto autotp = base, rules = base;
  autotp["tensor_parallel"] = {{"autotp_size", 2}};
  rules["tensor_parallel"] = {
      {"autotp_size", 2},
      {"partition_config",
       {{"use_default_specs", true},
        {"layer_specs",
         {{{"patterns", {"blocks\\..*\\.attn\\.qkv"}}, {"partition_type", "column"}, {"shape", {3, -1}}},
          {{"patterns", {"blocks\\..*\\.attn\\.proj"}}, {"partition_type", "row"}}}}}}};
  std::map<std::string, std::string> files{{"base", dir + "/base.json"}, {"autotp", dir + "/autotp.json"},
                                           {"rules", dir + "/rules.json"}};
  std::ofstream(files["base"]) << base.dump();
  std::ofstream(files["autotp"]) << autotp.dump();
  std::ofstream(files["rules"]) << rules.dump();
  auto train = [&](int processes, const Args& launcher, const std::string& json) {
    Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
    command.insert(command.end(), launcher.begin(), launcher.end());
    for (auto a : Args{kGptDeepSpeed, "--deepspeed_config", json, "--max_steps", "6", "--n_layer", "2", "--d_model",
                       "32", "--n_head", "2", "--seq_len", "32", "--log_every", "3"})
      command.push_back(a);
    return run(command, 180);
  };
  auto one = train(1, {}, files["base"]);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const auto expected = last_json(one.out)["losses"].get<std::vector<double>>();
  for (const auto& [name, launcher, json] :
       std::vector<std::tuple<std::string, Args, std::string>>{
           {"autotp_size via the launcher", {"--use_deepspeed", "--deepspeed_config_file", files["autotp"]}, files["autotp"]},
           {"partition_config rules", {"--parallelism_config_tp_size", "2"}, files["rules"]}}) {
    SCOPED_TRACE(name);
    auto r = train(2, launcher, json);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const auto got = last_json(r.out);
    EXPECT_EQ(got["tp_size"], 2);
    // Split, not replicated (which would train the same losses with one data-parallel rank): per block the
    // qkv and fc weights and biases (column-wise) and both proj weights (row-wise), and the two embeddings.
    EXPECT_EQ(got["sliced_parameters"], 2 * 6 + 2) << got;
    expect_close(got["losses"].get<std::vector<double>>(), expected, 1e-5);
  }
  auto refused = train(2, {}, files["autotp"]);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("sets tensor_parallel.autotp_size 2 but this job's mesh has tp 1; launch it with "
                             "--parallelism_config_tp_size 2"),
            std::string::npos)
      << refused.err;
}

// DeepSpeed's Ulysses settings (issue 25): a JSON's sequence_parallel_size, given to the launcher, makes the
// mesh's sp dimension (data_parallel_size, when given, must be what is left), and the GPT trained through the
// engine with each window split over the sp ranks equals one process on the same global batch; a JSON
// asking for sp the launch did not make is refused with the flag to use.
TEST(DeepSpeedSequenceParallel, TheJsonsSequenceParallelSizeSplitsTheSequenceAndTrainsAsOneProcess) {
  const auto dir = temp_dir("ds-sp");
  std::ifstream in(std::string(XLR8_SOURCE_DIR) + "/examples/gpt_deepspeed/zero2.json");
  auto base = nlohmann::json::parse(in);
  auto sp = base, sp_dp = base, wrong_dp = base;
  sp["sequence_parallel_size"] = 2;
  sp_dp["sequence_parallel_size"] = 2;
  sp_dp["data_parallel_size"] = 2;
  sp_dp["train_micro_batch_size_per_gpu"] = 8;  // 2 data-parallel ranks x 8 = one process's 16
  wrong_dp["sequence_parallel_size"] = 2;
  wrong_dp["data_parallel_size"] = 3;
  std::map<std::string, std::string> files{{"base", dir + "/base.json"}, {"sp", dir + "/sp.json"},
                                           {"sp_dp", dir + "/sp_dp.json"}, {"wrong_dp", dir + "/wrong_dp.json"}};
  for (const auto& [name, json] : std::map<std::string, nlohmann::json>{
           {"base", base}, {"sp", sp}, {"sp_dp", sp_dp}, {"wrong_dp", wrong_dp}})
    std::ofstream(files[name]) << json.dump();
  auto train = [&](int processes, const std::string& json, bool through_launcher) {
    Args command{kXlr8, "launch", "--num_processes", std::to_string(processes)};
    if (through_launcher)
      for (auto a : Args{"--use_deepspeed", "--deepspeed_config_file", json}) command.push_back(a);
    for (auto a : Args{kGptDeepSpeed, "--deepspeed_config", json, "--max_steps", "6", "--n_layer", "2", "--d_model",
                       "32", "--n_head", "2", "--seq_len", "32", "--log_every", "3"})
      command.push_back(a);
    return run(command, 180);
  };
  auto one = train(1, files["base"], false);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const auto expected = last_json(one.out)["losses"].get<std::vector<double>>();
  for (const auto& [name, processes] : std::vector<std::pair<std::string, int>>{{"sp", 2}, {"sp_dp", 4}}) {
    SCOPED_TRACE(name);
    auto r = train(processes, files[name], true);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const auto got = last_json(r.out);
    EXPECT_EQ(got["sp_size"], 2);
    expect_close(got["losses"].get<std::vector<double>>(), expected, 1e-5);
  }
  auto refused = train(2, files["sp"], false);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("sets sequence_parallel_size 2 but this job's mesh has sp 1; launch it with "
                             "--parallelism_config_sp_size 2"),
            std::string::npos)
      << refused.err;
  auto wrong = train(4, files["wrong_dp"], true);
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.err.find("sets data_parallel_size 3 but this launch has 2 data-parallel ranks"), std::string::npos)
      << wrong.err;
}

// Accelerate's zero3_init_flag defaults to on at ZeRO-3: build_model records the build, so one that reads a value
// back fails, saying which setting builds it whole; off, or at stage 2, it trains.
TEST(DeepSpeedZero3Init, OnByDefaultAtStageThreeAndABuildItCannotRecordSaysHowToBuildWhole) {
  auto train = [](const Args& flags) {
    const auto dir = temp_dir("ds-z3i-reads");
    Args a{kXlr8, "launch", "--num_processes", "2", "--use_deepspeed"};
    a.insert(a.end(), flags.begin(), flags.end());
    a.insert(a.end(), {kTrain, "--build_reads_values", "--steps", "2", "--out", dir});
    return run(a, 120);
  };
  const auto recorded = train({"--zero_stage", "3"});
  EXPECT_NE(recorded.exit_code, 0);
  for (const char* said : {"build_model recorded the build", "zero3_init_flag (on at ZeRO-3 unless set)"})
    EXPECT_NE(recorded.err.find(said), std::string::npos) << said << "\n" << recorded.err;
  for (const Args& flags : {Args{"--zero_stage", "3", "--zero3_init_flag", "false"}, Args{"--zero_stage", "2"}}) {
    const auto whole = train(flags);
    EXPECT_EQ(whole.exit_code, 0) << flags[1] << whole.out << whole.err;
  }
}
