// Ulysses sequence parallelism on the GPT example through the real launcher (issue 25): sp 2, 3 and 4,
// and composed with FSDP, DDP, DeepSpeed ZeRO-3 and TP, equal 1 process on the global batch and move
// exactly the bytes of its all-to-alls.
#include <gtest/gtest.h>

#include "gpt_runs.hpp"

namespace {

using namespace gpt_runs;

// 2 layers, d_model 48 in 12 heads (divisible by sp 2, 3 and 4, and by tp 2 x sp 2 with 6 per tp rank),
// windows of 48 tokens.
Args sp_gpt(int batch, const std::string& dir, const Args& more = {}) {
  return concat({"--n_layer", "2", "--d_model", "48", "--n_head", "12", "--seq_len", "48", "--batch_size",
                 std::to_string(batch), "--lr", "3e-3", "--val_windows", "48", "--output_dir", dir, "--max_steps", "6",
                 "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"},
                more);
}

// Bytes an sp rank sends per micro-step: per layer q, k, v and the output (b windows x T/sp tokens x c
// features, fp32) each cross once forward and their gradients once backward, (sp-1)/sp of each leaving.
int64_t sp_wire_bytes(int64_t layers, int64_t b, int64_t T, int64_t c, int64_t sp) {
  return layers * 2 * 4 * b * (T / sp) * c * 4 * (sp - 1) / sp;
}

struct Layout {
  std::string name;
  int processes, batch;
  Args launcher;
  int sp;
  int64_t attention_width;  // features of q, k and v on one rank (d_model / tp)
};

void expect_layouts_equal_one_process(const std::vector<Layout>& layouts) {
  const auto one_dir = temp_dir("gpt-sp-one");
  const auto one = json_of(launch_gpt(1, {}, sp_gpt(8, one_dir)));
  ASSERT_TRUE(one.contains("final_train_loss"));
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const auto dir = temp_dir("gpt-sp");
    auto got = json_of(launch_gpt(layout.processes, layout.launcher, sp_gpt(layout.batch, dir)));
    ASSERT_TRUE(got.contains("final_train_loss"));
    EXPECT_EQ(got["sp_size"], layout.sp);
    EXPECT_EQ(got["cp_size"], 1);
    EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 1e-5);
    EXPECT_NEAR(got["last_grad_norm"].get<double>(), one["last_grad_norm"].get<double>(),
                1e-4 * one["last_grad_norm"].get<double>());
    EXPECT_EQ(got["cp_wire_bytes_per_micro_step"], sp_wire_bytes(2, layout.batch, 48, layout.attention_width, layout.sp));
    expect_same_params(dir, one_dir, 5e-4);  // AdamW at lr 3e-3 amplifies float rounding (as for TP and CP)
  }
}

}  // namespace

TEST(GptUlysses, SpOnTwoThreeAndFourRanksEqualsOneProcess) {
  expect_layouts_equal_one_process({
      {"sp 2", 2, 8, {"--parallelism_config_sp_size", "2"}, 2, 48},
      {"sp 3", 3, 8, {"--parallelism_config_sp_size", "3"}, 3, 48},
      {"sp 4", 4, 8, {"--parallelism_config_sp_size", "4", "--parallelism_config_sp_backend", "deepspeed"}, 4, 48},
  });
}

TEST(GptUlysses, SpWithFsdpDdpDeepSpeedZeroThreeAndTpEqualsOneProcess) {
  expect_layouts_equal_one_process({
      {"dp_shard 2 x sp 2 (FSDP + Ulysses)", 4, 4,
       {"--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
        "Block", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_sp_size", "2"},
       2, 48},
      {"dp_replicate 2 x sp 2 (DDP + Ulysses)", 4, 4,
       {"--parallelism_config_dp_replicate_size", "2", "--parallelism_config_sp_size", "2"}, 2, 48},
      // Accelerate's ALST setting: DeepSpeed ZeRO-3 over every rank, sp inside.
      {"DeepSpeed ZeRO-3, dp_shard 2 x sp 2", 4, 4,
       {"--use_deepspeed", "--zero_stage", "3", "--parallelism_config_dp_shard_size", "2",
        "--parallelism_config_sp_size", "2"},
       2, 48},
      {"sp 2 x tp 2 (TP + Ulysses)", 4, 8, {"--parallelism_config_sp_size", "2", "--parallelism_config_tp_size", "2"}, 2,
       24},
  });
}

TEST(GptUlysses, HeadsOrALengthSpDoesNotDivideAFixedLengthMissedOrCpWithSpAreOneLineBeforeTheFirstStep) {
  const Args small{"--n_layer", "1", "--batch_size", "2", "--max_steps", "2", "--seq_len", "32"};
  auto heads = launch_gpt(4, {"--parallelism_config_sp_size", "4"},
                          concat(small, {"--d_model", "16", "--n_head", "2", "--output_dir", temp_dir("gpt-sp-heads")}),
                          /*expect_success=*/false);
  EXPECT_NE(heads.exit_code, 0);
  EXPECT_NE(heads.err.find("query has 2 heads"), std::string::npos) << heads.err;
  EXPECT_NE(heads.err.find("parallelism_config_sp_size 4 does not divide"), std::string::npos) << heads.err;
  EXPECT_EQ(heads.out.find("train "), std::string::npos) << "no step ran";
  auto length = launch_gpt(3, {"--parallelism_config_sp_size", "3"},
                           concat(small, {"--d_model", "24", "--n_head", "3", "--output_dir", temp_dir("gpt-sp-length")}),
                           /*expect_success=*/false);
  EXPECT_NE(length.exit_code, 0);
  EXPECT_NE(length.err.find("the sequence length is 32, which parallelism_config_sp_size 3 does not divide"),
            std::string::npos)
      << length.err;
  auto fixed = launch_gpt(2,
                          {"--parallelism_config_sp_size", "2", "--parallelism_config_sp_seq_length", "64",
                           "--parallelism_config_sp_seq_length_is_variable", "false"},
                          concat(small, {"--d_model", "16", "--n_head", "2", "--output_dir", temp_dir("gpt-sp-fixed")}),
                          /*expect_success=*/false);
  EXPECT_NE(fixed.exit_code, 0);
  EXPECT_NE(fixed.err.find("this batch's sequence is 32 tokens, but parallelism_config_sp_seq_length is 64"),
            std::string::npos)
      << fixed.err;
  auto both = launch_gpt(4, {"--parallelism_config_sp_size", "2", "--parallelism_config_cp_size", "2"},
                         concat(small, {"--d_model", "16", "--n_head", "2", "--output_dir", temp_dir("gpt-sp-cp")}),
                         /*expect_success=*/false);
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("set one of them to 1"), std::string::npos) << both.err;
}

TEST(GptUlysses, Bf16StaysWithinTheBf16ToleranceOfOneProcess) {
  // Under bf16 autocast q, k, v and the output cross the all-to-all in bf16 (Gloo carries them as bytes);
  // stated tolerance 3e-2 on losses and parameters (as for TP and CP), after 6 steps.
  const auto one_dir = temp_dir("gpt-sp-bf16-one"), dir = temp_dir("gpt-sp-bf16");
  const auto one = json_of(launch_gpt(1, {"--mixed_precision", "bf16"}, sp_gpt(8, one_dir)));
  auto got = json_of(launch_gpt(2, {"--mixed_precision", "bf16", "--parallelism_config_sp_size", "2"}, sp_gpt(8, dir)));
  ASSERT_TRUE(got.contains("final_train_loss") && one.contains("final_train_loss"));
  // Half the bytes of fp32: the all-to-alls carry bf16.
  EXPECT_EQ(got["cp_wire_bytes_per_micro_step"], sp_wire_bytes(2, 8, 48, 48, 2) / 2);
  EXPECT_NEAR(got["final_train_loss"].get<double>(), one["final_train_loss"].get<double>(), 3e-2);
  EXPECT_NEAR(got["val_loss"].get<double>(), one["val_loss"].get<double>(), 3e-2);
  expect_same_params(dir, one_dir, 3e-2);
}
