// The Accelerator's DeepSpeed JSON (Accelerate's DeepSpeedPlugin): which "auto" each source fills, what
// wins when the launch and the JSON disagree, and the refusals, each naming the key and the fix.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "deepspeed/deepspeed_plugin.hpp"
#include "xlr8/deepspeed_dummy.hpp"
#include "xlr8/deepspeed_schedulers.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"

using namespace xlr8;
using xlr8::deepspeed::DeepSpeedPlugin;

namespace {

DeepSpeedSettings launch_with(const nlohmann::json& config) {
  static int count = 0;
  const auto path = std::filesystem::temp_directory_path() /
                    ("xlr8-plugin-" + std::to_string(::getpid()) + "-" + std::to_string(count++) + ".json");
  std::ofstream(path) << config.dump();
  DeepSpeedSettings launch;
  launch.config_file = path.string();
  return launch;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

struct EmbedNetImpl : torch::nn::Module {
  EmbedNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(10, 8));
    head = register_module("head", torch::nn::Linear(8, 10));
  }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Linear head{nullptr};
};

const nlohmann::json kAllAuto = {{"train_batch_size", "auto"},
                                 {"train_micro_batch_size_per_gpu", "auto"},
                                 {"gradient_accumulation_steps", "auto"},
                                 {"gradient_clipping", "auto"},
                                 {"fp16", {{"enabled", "auto"}}},
                                 {"bf16", {{"enabled", "auto"}}},
                                 {"zero_optimization",
                                  {{"stage", "auto"},
                                   {"reduce_bucket_size", "auto"},
                                   {"stage3_prefetch_bucket_size", "auto"},
                                   {"stage3_param_persistence_threshold", "auto"},
                                   {"stage3_gather_16bit_weights_on_model_save", "auto"}}}};

}  // namespace

TEST(DeepSpeedPlugin, TheLaunchAndTheAcceleratorFillTheirAutoValuesAndTheJsonsOwnValuesWin) {
  auto launch = launch_with(kAllAuto);
  launch.gradient_clipping = 0.3;
  launch.zero_stage = 3;
  launch.zero3_save_16bit_model = true;
  DeepSpeedPlugin plugin(launch, MixedPrecision::BF16, 4, 1, false);
  EXPECT_EQ(plugin.precision(), MixedPrecision::BF16);
  EXPECT_EQ(plugin.gradient_accumulation_steps(), 4);
  EXPECT_DOUBLE_EQ(plugin.config().gradient_clipping, 0.3);
  EXPECT_EQ(plugin.config().zero_optimization.stage, 3);
  EXPECT_TRUE(plugin.config().zero_optimization.stage3_gather_16bit_weights_on_model_save);
  // The disk tier's paths too (offload_*_nvme_path), as Accelerate maps them: an "auto" path was never filled.
  auto with_disk = kAllAuto;
  with_disk["zero_optimization"]["offload_optimizer"] = {{"device", "auto"}, {"nvme_path", "auto"}};
  with_disk["zero_optimization"]["offload_param"] = {{"device", "auto"}, {"nvme_path", "auto"}};
  auto disk_launch = launch_with(with_disk);
  disk_launch.zero_stage = 3;
  disk_launch.offload_optimizer_device = disk_launch.offload_param_device = "nvme";
  disk_launch.offload_optimizer_nvme_path = "/swap/optimizer";
  disk_launch.offload_param_nvme_path = "/swap/parameters";
  DeepSpeedPlugin disk(disk_launch, MixedPrecision::NO, 1, 1, false);
  EXPECT_EQ(disk.config().zero_optimization.offload_optimizer.nvme_path, "/swap/optimizer");
  EXPECT_EQ(disk.config().zero_optimization.offload_param.nvme_path, "/swap/parameters");
  // Without the flags nothing is offloaded, and nothing is left "auto".
  auto no_disk_launch = launch_with(with_disk);
  no_disk_launch.zero_stage = 3;
  DeepSpeedPlugin no_disk(no_disk_launch, MixedPrecision::NO, 1, 1, false);
  EXPECT_EQ(no_disk.config().zero_optimization.offload_optimizer.device, "none");
  // Without --gradient_clipping, Accelerate's 1.0.
  DeepSpeedPlugin defaults(launch_with(kAllAuto), MixedPrecision::NO, 1, 1, false);
  EXPECT_DOUBLE_EQ(defaults.config().gradient_clipping, 1.0);
  EXPECT_EQ(defaults.precision(), MixedPrecision::NO);
  // The JSON's own accumulation and precision win over the Accelerator's.
  DeepSpeedPlugin own(launch_with({{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 3},
                                   {"fp16", {{"enabled", true}}}}),
                      MixedPrecision::NO, 1, 1, false);
  EXPECT_EQ(own.gradient_accumulation_steps(), 3);
  EXPECT_EQ(own.precision(), MixedPrecision::FP16);
  // A precision the JSON does not mention is added, as Accelerate adds the section.
  DeepSpeedPlugin added(launch_with({{"train_micro_batch_size_per_gpu", 2}}), MixedPrecision::FP16, 1, 1, false);
  EXPECT_EQ(added.precision(), MixedPrecision::FP16);
  EXPECT_EQ(added.config().document["fp16"]["enabled"], true);
}

TEST(DeepSpeedPlugin, ALaunchPrecisionThatContradictsTheJsonIsRefusedNamingTheKey) {
  const auto message = error_of([] {
    DeepSpeedPlugin(launch_with({{"bf16", {{"enabled", true}}}}), MixedPrecision::FP16, 1, 1, false);
  });
  EXPECT_NE(message.find("enables bf16"), std::string::npos) << message;
  EXPECT_NE(message.find("bf16.enabled"), std::string::npos) << message;
}

TEST(DeepSpeedPlugin, HiddenSizeKeysComeFromTheOptionOrTheModelsEmbeddingAndAreRefusedWithoutEither) {
  ParallelOptions parallel;
  DeepSpeedPlugin from_embedding(launch_with(kAllAuto), MixedPrecision::NO, 1, 1, false);
  auto net = std::make_shared<EmbedNetImpl>();
  from_embedding.configure_model(*net, parallel, 0);
  const auto& z = from_embedding.config().zero_optimization;
  EXPECT_EQ(z.reduce_bucket_size, 64);  // 8 * 8
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 57);  // int(0.9 * 64)
  EXPECT_EQ(z.stage3_param_persistence_threshold, 80);
  EXPECT_DOUBLE_EQ(parallel.zero.bucket_cap_mb, 64 * 4.0 / (1024 * 1024));

  DeepSpeedPlugin from_option(launch_with(kAllAuto), MixedPrecision::NO, 1, 1, false);
  from_option.configure_model(*torch::nn::Linear(3, 3).ptr(), parallel, 4);
  EXPECT_EQ(from_option.config().zero_optimization.reduce_bucket_size, 16);

  DeepSpeedPlugin neither(launch_with(kAllAuto), MixedPrecision::NO, 1, 1, false);
  const auto message = error_of([&] { neither.configure_model(*torch::nn::Linear(3, 3).ptr(), parallel, 0); });
  EXPECT_NE(message.find("zero_optimization.reduce_bucket_size"), std::string::npos) << message;
  EXPECT_NE(message.find("model_hidden_size"), std::string::npos) << message;
}

TEST(DeepSpeedPlugin, DummyOptimAndDummySchedulerStandForTheJsonsSectionsAndRealOnesBesideThemAreRefused) {
  const nlohmann::json sections = {
      {"train_micro_batch_size_per_gpu", 2},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"weight_decay", "auto"}}}}},
      {"scheduler",
       {{"type", "WarmupDecayLR"},
        {"params", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"},
                    {"total_num_steps", "auto"}, {"warmup_type", "linear"}}}}}};
  DeepSpeedPlugin plugin(launch_with(sections), MixedPrecision::NO, 1, 1, false);
  auto net = torch::nn::Linear(3, 3);
  auto real = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  auto message = error_of([&] { plugin.optimizer_for(real); });
  EXPECT_NE(message.find("DummyOptim"), std::string::npos) << message;

  auto dummy = std::make_shared<DummyOptim>(net->parameters(), 0.02, 0.1);
  message = error_of([&] { plugin.scheduler_for(std::make_shared<DummyScheduler>(*dummy, 10, 4)); });
  EXPECT_NE(message.find("prepare the DummyOptim first"), std::string::npos) << message;
  auto built = plugin.optimizer_for(dummy);
  ASSERT_NE(dynamic_cast<optim::FusedAdamW*>(built.get()), nullptr);
  EXPECT_DOUBLE_EQ(built->param_groups()[0].options().get_lr(), 0.02);
  EXPECT_EQ(plugin.config().document["optimizer"]["params"]["weight_decay"], 0.1);
  EXPECT_THROW(dummy->step(), Error);

  auto scheduler = plugin.scheduler_for(std::make_shared<DummyScheduler>(*dummy, 10, 4));
  ASSERT_NE(dynamic_cast<deepspeed::WarmupDecayLR*>(scheduler.get()), nullptr);
  const auto& params = plugin.config().document["scheduler"]["params"];
  EXPECT_EQ(params["warmup_max_lr"], 0.02);
  EXPECT_EQ(params["warmup_min_lr"], 0.0);
  EXPECT_EQ(params["total_num_steps"], 10);
  // The built scheduler drives the built optimizer, as the same schedule written out does.
  torch::optim::SGD reference(net->parameters(), torch::optim::SGDOptions(0.02));
  deepspeed::WarmupDecayLR expected(reference, 10, {.warmup_min_lr = 0, .warmup_max_lr = 0.02, .warmup_num_steps = 4,
                                                    .warmup_type = "linear"});
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(built->param_groups()[0].options().get_lr(), reference.param_groups()[0].options().get_lr()) << i;
    scheduler->step();
    expected.step();
  }
  EXPECT_GT(built->param_groups()[0].options().get_lr(), 0.0);

  DeepSpeedPlugin without(launch_with({{"train_micro_batch_size_per_gpu", 2}}), MixedPrecision::NO, 1, 1, false);
  message = error_of([&] { without.optimizer_for(std::make_shared<DummyOptim>(net->parameters())); });
  EXPECT_NE(message.find("no \"optimizer\" section"), std::string::npos) << message;
  EXPECT_EQ(without.optimizer_for(real), real);  // no section: the program's own
}

// Accelerate's DummyScheduler warms up over 0 steps by default: an "auto" warm-up filled with it trains (DeepSpeed's
// smallest warm-up, 2 steps, as DeepSpeed up to 0.19.2 clamped it), where a 0 written in the JSON is refused.
TEST(DeepSpeedPlugin, AnAutoWarmupFilledWithTheDummySchedulersZeroStepsTrains) {
  for (const char* type : {"WarmupLR", "WarmupDecayLR"}) {
    SCOPED_TRACE(type);
    nlohmann::json params = {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}};
    if (std::string(type) == "WarmupDecayLR") params["total_num_steps"] = "auto";
    DeepSpeedPlugin plugin(launch_with({{"train_micro_batch_size_per_gpu", 2},
                                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}}}}},
                                        {"scheduler", {{"type", type}, {"params", params}}}}),
                           MixedPrecision::NO, 1, 1, false);
    auto net = torch::nn::Linear(3, 3);
    auto dummy = std::make_shared<DummyOptim>(net->parameters(), 0.02);
    auto built = plugin.optimizer_for(dummy);
    auto scheduler = plugin.scheduler_for(std::make_shared<DummyScheduler>(*dummy, 10));  // warm-up 0, the default
    EXPECT_EQ(plugin.config().document["scheduler"]["params"]["warmup_num_steps"], 2);
    scheduler->step();
    scheduler->step();
    EXPECT_NEAR(built->param_groups()[0].options().get_lr(), 0.02, 1e-12);  // iteration 1 ends the 2-step warm-up
  }
  DeepSpeedPlugin explicit_zero(
      launch_with({{"train_micro_batch_size_per_gpu", 2},
                   {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.02}}}}},
                   {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 0}}}}}}),
      MixedPrecision::NO, 1, 1, false);
  auto net = torch::nn::Linear(3, 3);
  auto dummy = std::make_shared<DummyOptim>(net->parameters());
  explicit_zero.optimizer_for(dummy);
  const auto message = error_of([&] { explicit_zero.scheduler_for(std::make_shared<DummyScheduler>(*dummy, 10)); });
  EXPECT_NE(message.find("warmup_num_steps must be a positive integer, got 0"), std::string::npos) << message;
}

TEST(DeepSpeedPlugin, AnAutoADummyCannotFillIsRefusedNamingIt) {
  DeepSpeedPlugin plugin(launch_with({{"train_micro_batch_size_per_gpu", 2},
                                      {"optimizer", {{"type", "Adam"}, {"params", {{"lr", "auto"}, {"betas", "auto"}}}}}}),
                         MixedPrecision::NO, 1, 1, false);
  auto net = torch::nn::Linear(3, 3);
  const auto message = error_of([&] { plugin.optimizer_for(std::make_shared<DummyOptim>(net->parameters())); });
  EXPECT_NE(message.find("optimizer.params.betas"), std::string::npos) << message;
  EXPECT_EQ(message.find("optimizer.params.lr"), std::string::npos) << message;  // that one was filled
}

TEST(DeepSpeedPlugin, AtTheFirstBackwardBatchSizesComeFromTheLoadersAndWhatIsStillAutoIsRefusedWithWhoFillsIt) {
  DeepSpeedPlugin plugin(launch_with(kAllAuto), MixedPrecision::NO, 2, 3, false);
  plugin.configure_model(*std::make_shared<EmbedNetImpl>(), *std::make_unique<ParallelOptions>(), 0);
  plugin.loader_prepared(8);
  plugin.loader_prepared(16);  // the smallest, as Accelerate's is_train_batch_min
  plugin.finish(2);
  EXPECT_EQ(plugin.config().train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(plugin.config().train_batch_size, 48);

  DeepSpeedPlugin no_loader(launch_with(kAllAuto), MixedPrecision::NO, 1, 2, false);
  auto message = error_of([&] { no_loader.finish(1); });
  EXPECT_NE(message.find("train_micro_batch_size_per_gpu (filled from the batch size of a data loader"), std::string::npos)
      << message;
  EXPECT_NE(message.find("zero_optimization.reduce_bucket_size"), std::string::npos) << message;

  // A fixed train_batch_size that the loader's batch contradicts: DeepSpeed's own error.
  DeepSpeedPlugin fixed(launch_with({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", "auto"}}),
                        MixedPrecision::NO, 1, 2, false);
  fixed.loader_prepared(8);
  message = error_of([&] { fixed.finish(1); });
  EXPECT_NE(message.find("30 != 8 * 1 * 2"), std::string::npos) << message;

  DeepSpeedPlugin unused(launch_with({{"train_micro_batch_size_per_gpu", 2},
                                      {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}}}),
                         MixedPrecision::NO, 1, 1, false);
  message = error_of([&] { unused.finish(1); });
  EXPECT_NE(message.find("prepare an xlr8::DummyOptim"), std::string::npos) << message;
}

TEST(DeepSpeedPlugin, Stage3PrefetchesWithinTheJsonsBucketAndLiveBoundAndAnEmptyBucketPrefetchesNothing) {
  ParallelOptions parallel;
  DeepSpeedPlugin plugin(launch_with({{"train_micro_batch_size_per_gpu", 1},
                                      {"zero_optimization", {{"stage", 3}, {"stage3_prefetch_bucket_size", 1000},
                                                             {"stage3_max_live_parameters", 5000}}}}),
                         MixedPrecision::NO, 1, 1, false);
  plugin.configure_model(*std::make_shared<EmbedNetImpl>(), parallel, 0);
  EXPECT_EQ(parallel.zero.prefetch_bucket_elements, 1000);
  EXPECT_EQ(parallel.zero.max_live_elements, 5000);
  EXPECT_TRUE(parallel.zero.forward_prefetch);
  EXPECT_EQ(parallel.zero.backward_prefetch, BackwardPrefetch::BACKWARD_PRE);

  ParallelOptions none;
  DeepSpeedPlugin empty(launch_with({{"train_micro_batch_size_per_gpu", 1},
                                     {"zero_optimization", {{"stage", 3}, {"stage3_prefetch_bucket_size", 0}}}}),
                        MixedPrecision::NO, 1, 1, false);
  empty.configure_model(*std::make_shared<EmbedNetImpl>(), none, 0);
  EXPECT_EQ(none.zero.prefetch_bucket_elements, 0);
  EXPECT_GT(none.zero.max_live_elements, 0);  // DeepSpeed's bounds, not FSDP's rule
  EXPECT_FALSE(none.zero.forward_prefetch);
}
