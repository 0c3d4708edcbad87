// Accelerate's fp8 settings (issue 45, item 1): its own files load with the values they hold, `xlr8 launch`
// exports the variables `accelerate launch` exports, a worker reads them back, and what xlr8 lacks is one line.
#include <gtest/gtest.h>

#include <torch/optim/sgd.h>

#include <filesystem>

#include "xlr8/accelerator.hpp"
#include "xlr8/config.hpp"
#include "xlr8/error.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/nn.hpp"
#include "precision/float8_linear.hpp"
#include "xlr8/settings.hpp"

namespace {

std::filesystem::path accelerate_file(const std::string& name) {
  return std::filesystem::path(XLR8_SOURCE_DIR) / "tests/data/accelerate_configs" / name;
}

xlr8::Fp8Settings fp8_of(const std::string& name) {
  auto settings = xlr8::load_config(accelerate_file(name).string()).settings();
  EXPECT_EQ(settings.mixed_precision, xlr8::MixedPrecision::FP8) << name;
  return settings.fp8;
}

std::string refusal_of(const std::string& yaml) {
  try {
    xlr8::parse_config(yaml, "test.yaml").settings();
  } catch (const xlr8::ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Fp8Config, AcceleratesFilesGiveTheSettingsTheyHold) {
  // Written by `accelerate config` (its key names amax_history_length / amax_compute_algorithm).
  const auto te = fp8_of("fp8_te.yaml");
  EXPECT_EQ(te.backend, "TE");
  EXPECT_EQ(te.fp8_format, "E4M3");
  EXPECT_EQ(te.amax_compute_algo, "most_recent");
  EXPECT_EQ(te.amax_history_len, 1024);
  EXPECT_EQ(te.override_linear_precision, (std::array<bool, 3>{true, false, true}));
  const auto te_default = fp8_of("fp8_te_default.yaml");
  EXPECT_EQ(te_default.fp8_format, "HYBRID");
  EXPECT_EQ(te_default.amax_compute_algo, "max");
  EXPECT_EQ(te_default.override_linear_precision, (std::array<bool, 3>{false, false, false}));
  const auto ao = fp8_of("fp8_ao.yaml");
  EXPECT_EQ(ao.backend, "AO");
  EXPECT_TRUE(ao.enable_fsdp_float8_all_gather);
  EXPECT_FALSE(ao.pad_inner_dim);
  // Accelerate's own test file writes override_linear_precision as the string "(false, false, false)".
  const auto old = fp8_of("accelerate_tests_0_34_0_fp8.yaml");
  EXPECT_EQ(old.backend, "TE");
  EXPECT_EQ(old.amax_compute_algo, "max");
  EXPECT_EQ(old.override_linear_precision, (std::array<bool, 3>{false, false, false}));
}

TEST(Fp8Config, TheLaunchExportsAcceleratesVariablesAndTheWorkerReadsTheSameSettings) {
  const auto settings = xlr8::load_config(accelerate_file("fp8_te.yaml").string()).settings();
  const auto env = xlr8::settings_to_env(settings);
  const std::map<std::string, std::string> expected = {
      {"ACCELERATE_FP8_BACKEND", "TE"}, {"ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", "False"},
      {"ACCELERATE_FP8_MARGIN", "0"}, {"ACCELERATE_FP8_INTERVAL", "1"}, {"ACCELERATE_FP8_FORMAT", "E4M3"},
      {"ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024"}, {"ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "most_recent"},
      {"ACCELERATE_FP8_OVERRIDE_FPROP", "True"}, {"ACCELERATE_FP8_OVERRIDE_DGRAD", "False"},
      {"ACCELERATE_FP8_OVERRIDE_WGRAD", "True"}, {"ACCELERATE_FP8_OPT_LEVEL", "O2"},
      {"ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "True"}, {"ACCELERATE_FP8_PAD_INNER_DIM", "True"}};
  for (const auto& [name, value] : expected) {
    ASSERT_TRUE(env.count(name)) << name;
    EXPECT_EQ(env.at(name), value) << name;
  }
  EXPECT_EQ(env.at("ACCELERATE_MIXED_PRECISION"), "fp8");
  EXPECT_EQ(xlr8::settings_from_env(xlr8::Env(env)), settings);
  // What `accelerate launch --mixed_precision fp8 --fp8_backend te --fp8_pad_inner_dim no` exports (its flags'
  // booleans as 1/0, the backend as typed; Accelerate itself then fails on the lower-case backend).
  auto from_accelerate = env;
  from_accelerate["ACCELERATE_FP8_BACKEND"] = "te";
  from_accelerate["ACCELERATE_FP8_PAD_INNER_DIM"] = "0";
  from_accelerate["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] = "1";
  const auto read = xlr8::settings_from_env(xlr8::Env(from_accelerate)).fp8;
  EXPECT_EQ(read.backend, "TE");
  EXPECT_FALSE(read.pad_inner_dim);
  EXPECT_TRUE(read.enable_fsdp_float8_all_gather);
}

TEST(Fp8Config, WhatXlr8LacksIsRefusedInOneLineNamingTheKeyAndTheBackendsItHas) {
  const std::string fp8 = "mixed_precision: fp8\nfp8_config:\n";
  auto msamp = refusal_of(fp8 + "  backend: MSAMP\n  opt_level: O2\n");
  for (auto piece : {"fp8_config.backend", "MSAMP", "AO", "TE"}) EXPECT_NE(msamp.find(piece), std::string::npos) << msamp;
  auto e5m2 = refusal_of(fp8 + "  backend: TE\n  fp8_format: E5M2\n");
  for (auto piece : {"fp8_config.fp8_format", "E5M2", "HYBRID"}) EXPECT_NE(e5m2.find(piece), std::string::npos) << e5m2;
  auto mxfp8 = refusal_of(fp8 + "  backend: TE\n  use_mxfp8_block_scaling: true\n");
  EXPECT_NE(mxfp8.find("fp8_config.use_mxfp8_block_scaling"), std::string::npos) << mxfp8;
  auto typo = refusal_of(fp8 + "  amax_histroy_len: 16\n");
  EXPECT_NE(typo.find("did you mean \"fp8_config.amax_history_len\""), std::string::npos) << typo;
  auto pair = refusal_of(fp8 + "  override_linear_precision: [true, false]\n");
  EXPECT_NE(pair.find("fp8_config.override_linear_precision: give three booleans"), std::string::npos) << pair;
  const xlr8::Env variable{{"ACCELERATE_MIXED_PRECISION", "fp8"}, {"ACCELERATE_FP8_FORMAT", "E3M4"}};
  EXPECT_THROW(xlr8::settings_from_env(variable), xlr8::ConfigError);
  for (auto line : {msamp, e5m2, mxfp8, typo, pair}) EXPECT_EQ(line.find('\n'), std::string::npos) << line;
}

// Three xlr8::nn::Linear layers: AO's filter converts the middle one only.
struct ThreeLayers : torch::nn::Module {
  ThreeLayers() {
    for (const char* name : {"a", "b", "c"}) layers.push_back(register_module(name, xlr8::nn::Linear(32, 32)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = layer->forward(x).tanh();
    return x;
  }
  std::vector<xlr8::nn::Linear> layers;
};

TEST(Fp8Config, AnAcceleratorInFp8ConvertsTheFiltersLayersAndTrainsThemUnderBf16Autocast) {
  xlr8::Accelerator accelerator(xlr8::AcceleratorOptions{.mixed_precision = xlr8::MixedPrecision::FP8});
  EXPECT_NE(accelerator.plan().describe().find("precision: fp8 (tensorwise scaling, backend AO"), std::string::npos)
      << accelerator.plan().describe();
  auto model = accelerator.prepare(std::make_shared<ThreeLayers>());
  EXPECT_FALSE(model->layers[0]->float8());
  ASSERT_TRUE(model->layers[1]->float8());
  EXPECT_EQ(model->layers[1]->float8()->recipe().scaling, xlr8::fp8::Scaling::Tensorwise);
  auto optimizer = accelerator.prepare(torch::optim::SGD(model->parameters(), 0.1));
  auto before = model->layers[1]->weight.detach().clone();
  {
    auto autocast = accelerator.autocast();
    auto y = model->forward(at::randn({16, 32}));
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    accelerator.backward(y.to(at::kFloat).pow(2).mean());
  }
  optimizer.step();
  EXPECT_FALSE(model->layers[1]->weight.detach().equal(before));
  // A program's recipe that refuses a layer: one line at prepare, naming the layer and the setting.
  xlr8::Fp8Settings strict;
  strict.strict_linear_widths = true;
  xlr8::Accelerator refusing(xlr8::AcceleratorOptions{.mixed_precision = xlr8::MixedPrecision::FP8, .fp8 = strict});
  struct Odd : torch::nn::Module {
    xlr8::nn::Linear a{register_module("a", xlr8::nn::Linear(32, 32))}, b{register_module("b", xlr8::nn::Linear(32, 24))},
        c{register_module("c", xlr8::nn::Linear(24, 32))};
  };
  try {
    refusing.prepare(std::make_shared<Odd>());
    FAIL() << "a width of 24 was accepted under a strict filter";
  } catch (const xlr8::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("layer b: in_features 32 and out_features 24"), std::string::npos) << e.what();
  }
}

// A file written by `accelerate config` holds its own names (amax_compute_algorithm ...); Accelerate's names, which a
// --fp8_* flag is stored under, win over them. Without fp8 the section is not read, as Accelerate does not read it.
TEST(Fp8Config, AcceleratesOwnKeyWinsOverTheNameItsConfigWritesAndOnlyFp8ReadsTheSection) {
  const auto both = xlr8::parse_config("mixed_precision: fp8\nfp8_config:\n  amax_compute_algorithm: max\n"
                                       "  amax_compute_algo: most_recent\n  amax_history_length: 16\n  amax_history_len: 32\n")
                        .settings();
  EXPECT_EQ(both.fp8.amax_compute_algo, "most_recent");
  EXPECT_EQ(both.fp8.amax_history_len, 32);
  for (auto leftover : {"fp8_config:\n  backend: MSAMP\n  anything: 1\n", "fp8_config: TE\n"})
    EXPECT_EQ(refusal_of(std::string("mixed_precision: bf16\n") + leftover), "") << leftover;
}
