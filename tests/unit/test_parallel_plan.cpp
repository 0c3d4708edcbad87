// resolve_plan on one process: the launch's variables, the program's options and the plan's own variables become
// one ParallelPlan; what cannot be resolved is refused by name before any model exists.
#include <gtest/gtest.h>

#include "accelerate/parallel_plan.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;

namespace {

ParallelPlan plan_for(const Env& launch, const AcceleratorOptions& options, const Env& variables = {}) {
  const auto state = ProcessState::create(launch);
  xlr8::accelerate::PlanInputs in{.state = state.get(), .options = &options};
  in.precision = options.mixed_precision.value_or(state->mixed_precision());
  in.accumulation = gradient_accumulation_steps_for(state->settings(), options.gradient_accumulation_steps, false);
  return xlr8::accelerate::resolve_plan(in, variables);
}

}  // namespace

TEST(ParallelPlan, TheLaunchsFsdpVariablesDecideTheStageUnitsAndRecomputation) {
  const Env launch{{"ACCELERATE_USE_FSDP", "true"},
                   {"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
                   {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
                   {"FSDP_TRANSFORMER_CLS_TO_WRAP", "Block"},
                   {"FSDP_ACTIVATION_CHECKPOINTING", "true"},
                   {"ACCELERATE_MIXED_PRECISION", "bf16"},
                   {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"}};
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;  // the launch's 4 wins, as in Accelerate
  const auto plan = plan_for(launch, options);
  EXPECT_EQ(plan.data_parallel.zero.stage, 2);
  EXPECT_EQ(plan.data_parallel.zero.auto_wrap_policy, AutoWrapPolicy::TRANSFORMER_BASED_WRAP);
  EXPECT_EQ(plan.data_parallel.zero.layer_classes, std::vector<std::string>{"Block"});
  EXPECT_TRUE(plan.recompute_units);
  EXPECT_EQ(plan.mixed_precision, MixedPrecision::BF16);
  EXPECT_EQ(plan.gradient_accumulation_steps, 4);
  EXPECT_FALSE(plan.data_parallel.zero.param_dtype);  // on the CPU parameters stay fp32 under autocast
  EXPECT_EQ(plan.strategy, "single");                 // one process: nothing to synchronise
  EXPECT_EQ(plan.mesh.pp, 1);
  const auto text = plan.describe();
  EXPECT_NE(text.find("xlr8 plan: activation checkpointing: every unit of the wrap policy"), std::string::npos) << text;
  EXPECT_NE(text.find("xlr8 plan: steps: 4 micro-batch(es)"), std::string::npos) << text;
  EXPECT_EQ(plan.to_json()["zero"]["stage"], 2);
}

TEST(ParallelPlan, TheProgramsOptionsWinOverThePlansVariablesAndBadValuesAreRefusedByName) {
  AcceleratorOptions options;
  options.tp_sequence_parallel = false;
  options.tp_head_dim = 64;
  const Env variables{{"XLR8_TP_SEQUENCE_PARALLEL", "true"}, {"XLR8_TP_PLAN_FILE", "/plans/tp.json"},
                      {"XLR8_SPLIT_BATCHES", "1"}};
  auto plan = plan_for({}, options, variables);
  EXPECT_FALSE(plan.tensor.sequence_parallel);
  EXPECT_EQ(plan.tensor.head_dim, 64);
  EXPECT_EQ(plan.tensor.plan_file, "/plans/tp.json");
  EXPECT_TRUE(plan.split_batches);
  options.tp_sequence_parallel.reset();
  EXPECT_TRUE(plan_for({}, options, variables).tensor.sequence_parallel);
  try {
    plan_for({}, options, Env{{"XLR8_SHARDED_PARAM_DTYPE", "fp8"}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("XLR8_SHARDED_PARAM_DTYPE=\"fp8\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(plan_for({}, options, Env{{"XLR8_SHARDED_PARAM_DTYPE", "bf16"}}).data_parallel.zero.param_dtype,
            at::kBFloat16);
}

TEST(ParallelPlan, DeepSpeedLaunchKeysGiveTheStageClippingAndModuleUnits) {
  const Env launch{{"ACCELERATE_USE_DEEPSPEED", "true"},
                   {"ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"},
                   {"ACCELERATE_GRADIENT_CLIPPING", "0.25"},
                   {"ACCELERATE_MIXED_PRECISION", "fp16"}};
  const auto plan = plan_for(launch, {});
  EXPECT_EQ(plan.data_parallel.zero.stage, 3);
  EXPECT_EQ(plan.data_parallel.zero.auto_wrap_policy, AutoWrapPolicy::GUARDED_MODULES);
  EXPECT_DOUBLE_EQ(plan.clip_at_step, 0.25);
  ASSERT_TRUE(plan.loss_scaler);
  EXPECT_EQ(plan.loss_scaler->initial_scale_power, 16);
  // Without --gradient_clipping, DeepSpeed clips at 1.0 as Accelerate's generated config does ("auto" filled with
  // 1.0); 0 turns it off.
  EXPECT_DOUBLE_EQ(plan_for(Env{{"ACCELERATE_USE_DEEPSPEED", "true"}}, {}).clip_at_step, 1.0);
  EXPECT_DOUBLE_EQ(plan_for(Env{{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_GRADIENT_CLIPPING", "auto"}}, {}).clip_at_step,
                   1.0);
  EXPECT_DOUBLE_EQ(plan_for(Env{{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_GRADIENT_CLIPPING", "0"}}, {}).clip_at_step,
                   0.0);
}

TEST(ParallelPlan, Tf32ComesFromTheProgramElseItsVariableAndABadValueIsRefusedByName) {
  AcceleratorOptions options;
  EXPECT_FALSE(plan_for({}, options).allow_tf32);
  EXPECT_EQ(plan_for({}, options, Env{{"XLR8_ALLOW_TF32", "true"}}).allow_tf32, true);
  options.allow_tf32 = false;
  EXPECT_EQ(plan_for({}, options, Env{{"XLR8_ALLOW_TF32", "true"}}).allow_tf32, false);
  options.allow_tf32.reset();
  try {
    plan_for({}, options, Env{{"XLR8_ALLOW_TF32", "fast"}});
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("XLR8_ALLOW_TF32=\"fast\" is not a boolean"), std::string::npos) << e.what();
  }
}

// (A pipeline refused: GptOffloadDisk.GradientsOnDiskTooTrainAsInMemory, which launches one.)
TEST(ParallelPlan, GradientsOnDiskNeedTheOptimizersStateOnDisk) {
  const Env nvme{{"ACCELERATE_USE_DEEPSPEED", "true"},
                 {"ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"},
                 {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme"},
                 {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "/var/tmp/swap"}};
  const Env gradients{{"XLR8_GRADIENTS_ON_DISK", "1"}};
  EXPECT_FALSE(plan_for(nvme, {}).data_parallel.zero.optimizer_on_disk.gradients);
  const auto plan = plan_for(nvme, {}, gradients);
  EXPECT_TRUE(plan.data_parallel.zero.optimizer_on_disk.gradients);
  EXPECT_NE(plan.describe().find("gradients on disk"), std::string::npos) << plan.describe();
  const auto refused = [&](const Env& launch, const std::string& expected) {
    try {
      plan_for(launch, {}, gradients);
      ADD_FAILURE() << "expected an error: " << expected;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused({{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"}},
          "XLR8_GRADIENTS_ON_DISK=1: the gradients go to the optimizer's swap file, and the optimizer's state is not on "
          "disk; set offload_optimizer_device nvme");
}
