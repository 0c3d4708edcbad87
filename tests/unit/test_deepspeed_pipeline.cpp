// DeepSpeed's pipeline API (issue 46): partition_method's cuts, a PipelineModule built from layer specs (seeded by
// layer, a tied module named and trained once), explicit part starts, the JSON's "pipeline" section, and tied layers
// on two stages (threads) whose exchanges give the owner one process's gradient.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "parallel/pipeline/tied_weights.hpp"
#include "thread_ranks.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/deepspeed_pipeline.hpp"
#include "xlr8/error.hpp"

namespace {

using namespace xlr8;

std::string config_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(DeepSpeedPartition, ParametersUniformAndTypeCutAsDeepSpeedNamesThem) {
  using deepspeed::partition_layers;
  const std::vector<std::string> types{"torch::nn::EmbeddingImpl", "BlockImpl", "BlockImpl", "BlockImpl",
                                       "BlockImpl",                "BlockImpl", "torch::nn::LinearImpl"};
  const std::vector<int64_t> counts{100, 10, 10, 10, 10, 10, 100};
  EXPECT_EQ(partition_layers(counts, types, 3, "uniform"), (std::vector<size_t>{0, 3, 5}));
  // By parameters (the default): 250 in all, the first stage the embedding and two blocks (120), the second 130.
  EXPECT_EQ(partition_layers(counts, types, 2, "parameters"), (std::vector<size_t>{0, 3}));
  // type:<regex>, case-insensitive: the 5 blocks spread 3 + 2 and 2 + 2 + 1, each stage starting at one.
  EXPECT_EQ(partition_layers(counts, types, 2, "type:block"), (std::vector<size_t>{0, 4}));
  EXPECT_EQ(partition_layers(counts, types, 3, "type:^Block"), (std::vector<size_t>{0, 3, 5}));
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 2, "type:Attention"); }).find("matches 0 of the layers"),
            std::string::npos);
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 6, "type:Block"); }).find("fewer than the 6 stages"),
            std::string::npos);
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 2, "type:(("); }).find("not a valid regex"), std::string::npos);
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 2, "profile"); }).find("not implemented"), std::string::npos);
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 2, "balanced"); }).find("\"type:<regex>\""), std::string::npos);
  EXPECT_NE(config_error_of([&] { partition_layers(counts, types, 8, "uniform"); }).find("8 stages for a model of 7 layers"),
            std::string::npos);
}

at::Tensor tied_head(torch::nn::Module& m, const at::Tensor& x) { return x.matmul(m.as<torch::nn::Embedding>()->weight.t()); }

deepspeed::PipelineModule tied_model() {
  using namespace deepspeed;
  const auto embed = LayerSpec::of<torch::nn::Embedding>(10, 6);
  return PipelineModule(std::vector<PipeLayer>{TiedLayerSpec("embed", embed), LayerSpec::of<torch::nn::Linear>(6, 6),
                                               TiedLayerSpec("embed", embed, tied_head)},
                        PipelineModuleOptions{
                            .loss_fn = [](const at::Tensor& y, const at::Tensor& t) { return at::mse_loss(y, t); }});
}

TEST(DeepSpeedPipelineModule, LayersAreSeededByIndexAndATiedModuleIsOneParameterUsedTwice) {
  auto a = tied_model(), b = tied_model();
  const auto names = a->named_parameters();
  ASSERT_EQ(names.size(), 3u);  // the embedding once (under its first layer), the Linear's weight and bias
  EXPECT_TRUE(names.contains("0.embed.weight"));
  EXPECT_TRUE(names.contains("1.weight"));
  for (const auto& p : a->named_parameters()) EXPECT_TRUE(at::equal(p.value(), b->named_parameters()[p.key()])) << p.key();
  // The head reads the embedding's weight: the forward is embed -> linear -> x W^T, and both uses train it.
  const auto tokens = at::tensor({1, 4, 7}, at::kLong);
  auto y = a->forward(tokens);
  const auto& w = names["0.embed.weight"];
  EXPECT_TRUE(at::allclose(y, at::linear(w.index_select(0, tokens), names["1.weight"], names["1.bias"]).matmul(w.t())));
  y.sum().backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_EQ(a->stage_starts(), (std::vector<size_t>{0}));
}

// The same model as a plain Sequential handle (the holder's constructor would take a derived pointer as a layer).
torch::nn::Sequential as_sequential(const pp::PartitionedSequential& model) {
  return torch::nn::Sequential(std::static_pointer_cast<torch::nn::SequentialImpl>(model.ptr()));
}

TEST(DeepSpeedPipelineModule, PartStartsCutWhereTheySayOrAreRefused) {
  pp::PartitionedSequential whole(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  whole->part_starts = {0, 2};
  using Cuts = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(pp::parts_of(as_sequential(whole), 2, 1), (Cuts{{0, 2}, {2, 3}}));
  EXPECT_EQ(pp::stage_of(as_sequential(whole), 2, 1)->size(), 1u);
  for (const auto& starts : std::vector<std::vector<size_t>>{{0}, {1, 2}, {0, 0}, {0, 3}}) {
    whole->part_starts = starts;
    EXPECT_NE(config_error_of([&] { pp::parts_of(as_sequential(whole), 2, 1); }).find("do not cut its 3 layers"),
              std::string::npos);
  }
  // One part a stage (what a PipelineModule cuts) under an interleaved schedule's 2 chunks: the schedule is named as
  // what to change, not the part starts the program never gave.
  whole->part_starts = {0, 2};
  const auto interleaved = config_error_of([&] { pp::parts_of(as_sequential(whole), 2, 2); });
  EXPECT_NE(interleaved.find("an interleaved schedule runs 2 chunks a stage, 4 parts in all, but the model's part "
                             "starts cut it into 2 parts, one a stage"),
            std::string::npos)
      << interleaved;
  EXPECT_NE(interleaved.find("set parallelism_config_pp_virtual_stages 1"), std::string::npos) << interleaved;
}

TEST(DeepSpeedConfigPipeline, TheSectionIsReadWithDeepSpeedsKeys) {
  auto c = deepspeed::parse_config(nlohmann::json::parse(
      R"({"pipeline": {"stages": 2, "partition": "type:Block", "activation_checkpoint_interval": 1,
                       "seed_layers": true, "pipe_partitioned": true, "grad_partitioned": false}})"));
  EXPECT_EQ(c.pipeline.stages, 2);
  EXPECT_EQ(c.pipeline.partition, "type:Block");
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 1);
  EXPECT_FALSE(deepspeed::parse_config(nlohmann::json::parse(R"({"pipeline": {"stages": "auto"}})")).pipeline.stages);
  EXPECT_TRUE(deepspeed::parse_config(nlohmann::json::parse(R"({"pipeline": {"stages": "auto"}})")).auto_keys.empty());
  EXPECT_NE(config_error_of([] { deepspeed::parse_config(nlohmann::json::parse(R"({"pipeline": {"stage": 2}})")); })
                .find("did you mean \"pipeline.stages\""),
            std::string::npos);
  EXPECT_NE(config_error_of([] { deepspeed::parse_config(nlohmann::json::parse(R"({"pipeline": {"stages": 0}})")); })
                .find("pipeline.stages"),
            std::string::npos);
}

// [embed (owner), Linear | head (a copy)] on two ranks: after the exchanges the owner's gradient is one process's
// (both uses summed), the copy's is cleared, and the next step's copy takes the owner's values.
TEST(TiedWeights, TheOwnerGetsBothStagesGradientAndTheCopyItsValues) {
  auto build = [] {
    at::manual_seed(3);
    torch::nn::AnyModule embedding(torch::nn::Embedding(10, 6));
    return pp::PartitionedSequential(pp::TiedLayer("embed", embedding, pp::TiedForward{}, true), torch::nn::Linear(6, 6),
                                     pp::TiedLayer("embed", embedding, tied_head, false));
  };
  const auto tokens = at::tensor({1, 4, 7, 2}, at::kLong).reshape({2, 2});
  const auto target = at::randn({2, 2, 10});
  auto one = build();
  at::mse_loss(one->forward(tokens), target).backward();
  const auto expected = one->named_parameters()["0.embed.weight"].grad();
  xlr8::testing::run_ranks(2, [&](Communicator& comm) {
    pp::PartitionedSequential whole;
    {
      std::lock_guard<std::mutex> lock(xlr8::testing::generator_lock());
      whole = build();
    }
    whole->part_starts = {0, 2};
    const auto all = as_sequential(whole);
    auto stage = pp::stage_of(all, 2, comm.rank());
    pp::copy_tied_modules(all, stage);
    const auto alone = Communicator::in_process(xlr8::testing::unique_key(), 0, 1);  // no data parallelism
    pp::TiedWeights tied(all, stage, pp::parts_of(all, 2, 1), comm, alone, at::kCPU);
    tied.check_copies_match();
    EXPECT_FALSE(tied.empty());
    pp::Pipeline pipeline(stage, comm, pp::Schedule::OneFOneB, 2);
    tied.share_values();
    const auto inputs = tokens.chunk(2), targets = target.chunk(2);
    pipeline.step(comm.rank() == 0 ? inputs : std::vector<at::Tensor>{},
                  comm.rank() == 1 ? targets : std::vector<at::Tensor>{},
                  [](const at::Tensor& y, const at::Tensor& t) { return at::mse_loss(y, t); });
    tied.sum_gradients();
    auto& module = stage->ptr(0)->as<pp::TiedLayerImpl>()->tied();  // the owner on rank 0, the copy on rank 1
    auto weight = module.parameters().front();
    if (comm.rank() == 0) {
      EXPECT_TRUE(at::allclose(weight.grad(), expected, 1e-5, 1e-7));
      at::NoGradGuard no_grad;
      weight.add_(1.0);  // an optimizer's step on the owner
    } else {
      EXPECT_FALSE(weight.grad().defined());
    }
    tied.share_values();
    if (comm.rank() == 1) {
      EXPECT_TRUE(at::allclose(weight, one->named_parameters()["0.embed.weight"] + 1.0));
    }
  });
}

}  // namespace
