// DeepSpeed JSON configs: the files Accelerate ships and tests with, DeepSpeed's key checks, batch-size
// relations and loss-scaler rules.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "xlr8/deepspeed_config.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;
using namespace xlr8::deepspeed;

namespace {

const std::filesystem::path kConfigs = std::filesystem::path(XLR8_SOURCE_DIR) / "tests/data/deepspeed_configs";

Config load(const std::string& name) { return load_config((kConfigs / name).string()); }

std::string error_of(const std::string& json, int world = 1) {
  try {
    auto c = load_config(json);
    resolve_batch_sizes(c, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::vector<std::string> kAllAuto = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping",
                                           "fp16.enabled", "bf16.enabled"};

}  // namespace

TEST(DeepSpeedConfig, EveryFileAccelerateShipsLoadsAndSaysWhatItConfigures) {
  struct Expect {
    std::string file;
    int stage;
    std::string offload_optimizer, offload_param;
    bool fp16;
    std::vector<std::string> autos;  // in the order they are read
  };
  const std::vector<Expect> expected = {
      {"accelerate_template_zero_stage1_config.json", 1, "none", "none", true,
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping", "zero_optimization.reduce_bucket_size",
        "optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.total_num_steps",
        "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_num_steps"}},
      {"accelerate_template_zero_stage2_config.json", 2, "none", "none", true, {}},
      {"accelerate_template_zero_stage2_offload_config.json", 2, "cpu", "none", true, {}},
      {"accelerate_template_zero_stage3_config.json", 3, "none", "none", true, {}},
      {"accelerate_template_zero_stage3_offload_config.json", 3, "cpu", "cpu", true, {}},
      {"accelerate_tests_ds_config_zero2.json", 2, "cpu", "none", false, {}},
      {"accelerate_tests_ds_config_zero2_model_only.json", 2, "cpu", "none", false, {}},
      {"accelerate_tests_ds_config_zero3.json", 3, "cpu", "cpu", false, {}},
      {"accelerate_tests_ds_config_zero3_model_only.json", 3, "none", "cpu", false, {"fp16.enabled", "bf16.enabled"}},
  };
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kConfigs)) files += entry.path().extension() == ".json";
  EXPECT_EQ(files, expected.size()) << "a file in " << kConfigs << " has no expectation here";
  for (const auto& e : expected) {
    SCOPED_TRACE(e.file);
    const auto c = load(e.file);
    EXPECT_EQ(c.zero_optimization.stage, e.stage);
    EXPECT_EQ(c.zero_optimization.offload_optimizer.device, e.offload_optimizer);
    EXPECT_EQ(c.zero_optimization.offload_param.device, e.offload_param);
    EXPECT_EQ(c.fp16.enabled, e.fp16);
    if (!e.autos.empty()) {
      EXPECT_EQ(c.auto_keys, e.autos);
    }
    // Whatever is left "auto" is named when the config is used without Accelerate filling it.
    if (c.auto_keys.empty()) {
      EXPECT_NO_THROW(require_resolved(c));
    } else {
      try {
        require_resolved(c);
        ADD_FAILURE() << "auto values went unnoticed";
      } catch (const ConfigError& error) {
        EXPECT_NE(std::string(error.what()).find(c.auto_keys.front()), std::string::npos) << error.what();
      }
    }
  }
  // Values the files spell as floats (1e9) are DeepSpeed's integer keys.
  const auto z3 = load("accelerate_tests_ds_config_zero3_model_only.json");
  EXPECT_EQ(z3.zero_optimization.stage3_param_persistence_threshold, 1'000'000'000);
  EXPECT_TRUE(z3.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z3.train_micro_batch_size_per_gpu, 1);
  const auto z2 = load("accelerate_tests_ds_config_zero2.json");
  EXPECT_EQ(z2.zero_optimization.allgather_bucket_size, 200'000'000);
  EXPECT_TRUE(z2.zero_optimization.overlap_comm);
  EXPECT_EQ(z2.optimizer->type, "AdamW");
  EXPECT_EQ(z2.optimizer->params["adam_w_mode"], true);
  EXPECT_EQ(z2.scheduler->type, "WarmupLR");
  EXPECT_EQ(z2.steps_per_print, 2000);
  for (const auto& key : kAllAuto)
    EXPECT_NE(std::find(z2.auto_keys.begin(), z2.auto_keys.end(), key), z2.auto_keys.end()) << key;
}

TEST(DeepSpeedConfig, FillingAutoKeepsTheFilesOwnValuesAndResolvesTheRest) {
  const auto c = load("accelerate_tests_ds_config_zero3.json");
  const auto filled = fill_auto(c, {{"train_batch_size", 32},
                                    {"train_micro_batch_size_per_gpu", 8},
                                    {"gradient_accumulation_steps", 99},  // the file says 1: it stays
                                    {"gradient_clipping", 0.5},
                                    {"fp16.enabled", false},
                                    {"bf16.enabled", true},
                                    {"optimizer.params.lr", 3e-4},
                                    {"optimizer.params.weight_decay", 0.01},
                                    {"scheduler.params.warmup_min_lr", 0},
                                    {"scheduler.params.warmup_max_lr", 3e-4},
                                    {"scheduler.params.warmup_num_steps", 10},
                                    {"zero_optimization.reduce_bucket_size", 1024 * 1024},
                                    {"zero_optimization.stage3_prefetch_bucket_size", 943718},
                                    {"zero_optimization.stage3_param_persistence_threshold", 10240},
                                    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", true}});
  EXPECT_NO_THROW(require_resolved(filled));
  EXPECT_EQ(filled.gradient_accumulation_steps, 1);
  EXPECT_EQ(filled.gradient_clipping, 0.5);
  EXPECT_TRUE(filled.bf16);
  EXPECT_FALSE(filled.fp16.enabled);
  EXPECT_EQ(filled.optimizer->params["lr"], 3e-4);
  EXPECT_EQ(filled.zero_optimization.stage3_param_persistence_threshold, 10240);
  EXPECT_EQ(filled.zero_optimization.stage3_prefetch_bucket_size, 943718);
  const auto sizes = resolve_batch_sizes(filled, 4);
  EXPECT_EQ(sizes.train_batch_size, 32);
  EXPECT_EQ(sizes.micro_batch_per_gpu, 8);
  EXPECT_EQ(sizes.gradient_accumulation_steps, 1);
}

TEST(DeepSpeedConfig, AKeyDeepSpeedDoesNotHaveNamesTheClosestOne) {
  auto what = error_of(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": true}})");
  EXPECT_NE(what.find("DeepSpeed has no key \"zero_optimization.overlap_com\" (did you mean "
                      "\"zero_optimization.overlap_comm\"?)"),
            std::string::npos)
      << what;
  what = error_of(R"({"train_batch_sise": 8})");
  EXPECT_NE(what.find("(did you mean \"train_batch_size\"?)"), std::string::npos) << what;
  what = error_of(R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale_windows": 100}})");
  EXPECT_NE(what.find("\"fp16.loss_scale_windows\" (did you mean \"fp16.loss_scale_window\"?)"), std::string::npos) << what;
}

TEST(DeepSpeedConfig, AFeatureXlr8LacksIsRefusedOnlyWhenItIsTurnedOn) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_quantized_weights": true}})",
       "zero_optimization.zero_quantized_weights = true turns on ZeRO++ quantized weights"},
      {R"({"train_batch_size": 8, "flops_profiler": {"enabled": true, "profile_step": 1}})",
       "flops_profiler.enabled = true turns on the flops profiler"},
      {R"({"train_batch_size": 8, "activation_checkpointing": {"partition_activations": true}})",
       "activation_checkpointing.partition_activations = true"},
      {R"({"train_batch_size": 8, "prescale_gradients": true})", "prescale_gradients = true turns on gradient prescaling"},
      {R"({"train_batch_size": 8, "checkpoint": {"load_universal": true}})", "checkpoint.load_universal = true"},
      {R"({"train_batch_size": 8, "sequence_parallel_size": 0})", "sequence_parallel_size must be at least 1"},
      {R"({"train_batch_size": 8, "seq_parallel_communication_data_type": "bf16"})",
       "seq_parallel_communication_data_type = \"bf16\" turns on a sequence-parallel communication dtype"},
  };
  for (const auto& [json, message] : refused) {
    const auto what = error_of(json);
    EXPECT_NE(what.find(message), std::string::npos) << json << "\n" << what;
  }
  // The same keys at their defaults, as templates spell them out, are fine.
  for (const auto* json :
       {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_quantized_weights": false}})",
        R"({"train_batch_size": 8, "flops_profiler": {"enabled": false, "profile_step": 1}})",
        R"({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 0}})",
        R"({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 4}})",  // read: the engine splits the model
        R"({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 4, "preset_model": "llama"}})",
        R"({"train_batch_size": 8, "activation_checkpointing": {"partition_activations": false, "profile": false}})",
        R"({"train_batch_size": 8, "prescale_gradients": false, "zero_allow_untested_optimizer": true})",
        // Ulysses: the mesh's sp and dp (xlr8 launch makes them); gradients are reduced in fp32 as given.
        R"({"train_batch_size": 8, "sequence_parallel_size": 2, "data_parallel_size": 1,
            "seq_parallel_communication_data_type": "fp32"})"})
    EXPECT_EQ(error_of(json), "") << json;
}

TEST(DeepSpeedConfig, BatchSizesFollowDeepSpeedsRelationAndItsErrors) {
  struct Case {
    std::string json;
    int world;
    BatchSizes want;
  };
  for (const auto& c : std::vector<Case>{
           {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 4, {32, 4, 2}},
           {R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 4, {32, 4, 2}},
           {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 4, {32, 4, 2}},
           {R"({"train_batch_size": 32})", 4, {32, 8, 1}},
           {R"({"train_micro_batch_size_per_gpu": 4})", 3, {12, 4, 1}},
           {R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 3, {24, 4, 2}},
       }) {
    const auto got = resolve_batch_sizes(load_config(c.json), c.world);
    EXPECT_EQ(got.train_batch_size, c.want.train_batch_size) << c.json;
    EXPECT_EQ(got.micro_batch_per_gpu, c.want.micro_batch_per_gpu) << c.json;
    EXPECT_EQ(got.gradient_accumulation_steps, c.want.gradient_accumulation_steps) << c.json;
  }
  // DeepSpeed divides with integers first and then asserts the relation.
  EXPECT_NE(error_of(R"({"train_batch_size": 10})", 3).find("10 != 3 * 1 * 3"), std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})", 4)
                .find("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 32 != 4 * 3 * 4"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"gradient_accumulation_steps": 3})").find("either train_batch_size or train_micro_batch_size_per_gpu"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 2})", 4).find("micro batch size per gpu: 0 has to be greater than 0"),
            std::string::npos);
}

TEST(DeepSpeedConfig, WrongTypesAndValuesNameTheKey) {
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "gradient_clipping": "1.0"})").find("gradient_clipping must be a number, not \"1.0\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8.5})").find("train_batch_size must be a whole number, not 8.5"), std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "zero_optimization": {"stage": 4}})").find("4 is not a ZeRO stage"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})")
                .find("needs stage 3 (stage is 2)"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}})").find("both true"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "checkpoint": {"tag_validation": "Strict"}})").find("use Warn, Ignore or Fail"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "optimizer": {"params": {"lr": 1}}})").find("optimizer.type is required"),
            std::string::npos);
  EXPECT_NE(error_of("/nonexistent/ds.json").find("does not exist or cannot be read"), std::string::npos);
  EXPECT_NE(error_of("{\"train_batch_size\": 8,}").find("is not valid JSON"), std::string::npos);
  // DeepSpeed's defaults where the file is silent.
  const auto c = load_config(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})");
  EXPECT_TRUE(c.zero_optimization.overlap_comm);  // on for stage 3 only
  EXPECT_FALSE(load_config(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})").zero_optimization.overlap_comm);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_EQ(c.tag_validation, "Warn");
}

TEST(DeepSpeedConfig, TheFp16SectionBuildsDeepSpeedsScalerForEachPath) {
  // ZeRO optimizers (stages 1-3): hysteresis 2 delays the first halving; it is not refilled by one.
  auto zero = load_config(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                              "fp16": {"enabled": true, "initial_scale_power": 4, "loss_scale_window": 2, "min_loss_scale": 4}})");
  DynamicLossScaler s(loss_scaler_options(zero.fp16, zero.zero_optimization.stage));
  std::vector<double> scales;
  for (bool overflow : {true, true, true, false, false, false, true}) {
    s.update(overflow);
    scales.push_back(s.scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{16, 8, 4, 4, 4, 8, 8}));
  s.update(true);  // hysteresis is 1 again (the clean window refilled it, the last overflow used it)
  EXPECT_EQ(s.scale(), 4);
  EXPECT_THROW(s.update(true), Error);  // DeepSpeed: "already at minimum"
  // Stage 0 (the fused fp16 optimizer) ignores hysteresis: every overflow halves, floored at the minimum.
  auto plain = fill_auto(zero, {});
  plain.zero_optimization.stage = 0;
  DynamicLossScaler f(loss_scaler_options(plain.fp16, 0));
  scales.clear();
  for (bool overflow : {true, true, true, false, false, false, true, true}) {
    f.update(overflow);
    scales.push_back(f.scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{8, 4, 4, 4, 4, 8, 4, 4}));
  // A static scale (loss_scale > 0) never moves; overflows still skip their steps.
  auto fixed = load_config(R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 128}})");
  DynamicLossScaler st(loss_scaler_options(fixed.fp16, 2));
  for (bool overflow : {true, false, true, true}) st.update(overflow);
  EXPECT_EQ(st.scale(), 128);
  // Dynamic scaling needs a window and a minimum above 0 (DeepSpeed's checks).
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale_window": 0}})")
                .find("fp16.loss_scale_window must be > 0 when loss_scale is 0 (dynamic)"),
            std::string::npos);
}
