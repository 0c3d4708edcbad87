// fp8 in training (issue 45): which layers convert and the report of it, checkpointed regions recomputed with the
// same delayed scales, the delayed state saved and restored, amaxes reduced so that two ranks equal one process,
// and a small model that learns in fp8 as it does in bf16.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "precision/float8_linear.hpp"
#include "thread_ranks.hpp"
#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace {

using namespace xlr8;

fp8::Recipe delayed_recipe() {
  fp8::Recipe r;
  r.scaling = fp8::Scaling::Delayed;
  r.amax_history_len = 4;
  return r;
}

struct Mixed : torch::nn::Module {
  Mixed() {
    first = register_module("first", nn::Linear(32, 64));
    middle = register_module("middle", nn::Linear(64, 64));
    odd = register_module("odd", nn::Linear(64, 30));
    plain = register_module("plain", torch::nn::Linear(30, 32));
    last = register_module("last", nn::Linear(32, 16));
  }
  nn::Linear first{nullptr}, middle{nullptr}, odd{nullptr}, last{nullptr};
  torch::nn::Linear plain{nullptr};
};

TEST(Float8Convert, SkipsTheFirstAndLastLinearWidthsNotMultiplesOf16AndPlainLinearsAndSaysWhy) {
  Mixed model;
  auto report = fp8::convert_to_float8_training(model, fp8::Recipe{}, fp8::LayerFilter{});
  EXPECT_EQ(report.converted, std::vector<std::string>{"middle"});
  ASSERT_EQ(report.skipped.size(), 4u);
  const auto text = report.describe();
  for (auto expected : {"first: the model's first Linear", "last: the model's last Linear", "odd: in_features 64 and "
                        "out_features 30", "plain: a torch::nn::Linear: build it as xlr8::nn::Linear"})
    EXPECT_NE(text.find(expected), std::string::npos) << expected << "\n" << text;
  EXPECT_TRUE(model.middle->float8() && !model.first->float8() && !model.odd->float8() && !model.last->float8());
  EXPECT_THROW(fp8::convert_to_float8_training(model, fp8::Recipe{}, fp8::LayerFilter{}), Error);  // twice
}

TEST(Float8Convert, AStrictFilterRefusesAWidthNotAMultipleOf16AndConvertsNothing) {
  Mixed model;
  try {
    fp8::convert_to_float8_training(model, fp8::Recipe{}, fp8::LayerFilter{.skip_first_and_last = false, .strict = true});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("layer odd: in_features 64 and out_features 30"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("strict_linear_widths"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(model.first->float8() || model.middle->float8());
  // The size filter and Transformer Engine's filter (every layer it can).
  auto report = fp8::convert_to_float8_training(model, fp8::Recipe{}, fp8::LayerFilter{.skip_first_and_last = false,
                                                                                        .min_features = 48});
  EXPECT_EQ(report.converted, std::vector<std::string>{"middle"});
  EXPECT_NE(report.describe().find("first: in_features 32 or out_features 64 below min_linear_features 48"),
            std::string::npos);
}

TEST(Float8Convert, AccelerateSettingsNameTheRecipeAndTheFilter) {
  Fp8Settings te;
  te.backend = "TE";
  te.fp8_format = "E4M3";
  te.amax_compute_algo = "max";
  te.override_linear_precision = {false, false, true};
  auto r = fp8::recipe_from(te);
  EXPECT_EQ(r.scaling, fp8::Scaling::Delayed);
  EXPECT_FALSE(r.gradients_e5m2);
  EXPECT_FALSE(r.amax_most_recent);
  EXPECT_TRUE(r.compute_precision[2]);
  EXPECT_FALSE(fp8::filter_from(te).skip_first_and_last);
  Fp8Settings ao;
  EXPECT_EQ(fp8::recipe_from(ao).scaling, fp8::Scaling::Tensorwise);
  EXPECT_TRUE(fp8::recipe_from(ao).gradients_e5m2);
  EXPECT_TRUE(fp8::filter_from(ao).skip_first_and_last);
  ao.ao_recipe = "rowwise";
  EXPECT_EQ(fp8::recipe_from(ao).scaling, fp8::Scaling::Rowwise);
}

struct Block : torch::nn::Module {
  Block() { linear = register_module("linear", nn::Linear(32, 32)); }
  nn::Linear linear{nullptr};
};

// One step of `block` (delayed scaling) on x: the weight's gradient; checkpointed or not.
at::Tensor delayed_step(Block& block, const at::Tensor& x, bool checkpointed) {
  block.linear->weight.mutable_grad() = at::Tensor();
  auto body = [&block](const at::Tensor& in) { return block.linear->forward(in).tanh(); };
  auto y = checkpointed ? checkpoint(body, x) : body(x);
  y.pow(2).sum().backward();
  return block.linear->weight.grad().clone();
}

TEST(Float8Recompute, ACheckpointedRegionIsRecomputedWithTheScalesOfItsFirstRunAndRecordsOnce) {
  at::manual_seed(11);
  Block plain, checkpointed;
  checkpointed.linear->weight.data().copy_(plain.linear->weight.data());
  checkpointed.linear->bias.data().copy_(plain.linear->bias.data());
  for (auto* block : {&plain, &checkpointed})
    ASSERT_EQ(fp8::convert_to_float8_training(*block, delayed_recipe(), {.skip_first_and_last = false}).converted.size(), 1u);
  for (int step = 0; step < 3; ++step) {
    auto x = at::randn({8, 32}) * (3 - step);
    auto want = delayed_step(plain, x, false), got = delayed_step(checkpointed, x, true);
    // The first run's scale moved on after it recorded its amax; the recomputation used the one the forward had.
    EXPECT_TRUE(got.equal(want)) << "step " << step << ": " << (got - want).abs().max().item<float>();
  }
  EXPECT_EQ(checkpointed.linear->float8()->input.casts, 3);
  EXPECT_TRUE(checkpointed.linear->float8()->input.history.equal(plain.linear->float8()->input.history));
}

TEST(Float8State, DelayedHistoriesRoundTripAndAnotherLengthIsRefusedWithTheLayersName) {
  at::manual_seed(12);
  Block block;
  fp8::convert_to_float8_training(block, delayed_recipe(), {.skip_first_and_last = false});
  for (int step = 0; step < 2; ++step) delayed_step(block, at::randn({8, 32}), false);
  auto saved = block.linear->float8()->state_dict();
  EXPECT_EQ(saved.size(), 9u);
  EXPECT_EQ(saved.at("grad_output.casts").item<int64_t>(), 2);
  fp8::LinearState restored(delayed_recipe(), "linear");
  restored.load_state_dict(saved);
  EXPECT_TRUE(restored.input.history.equal(block.linear->float8()->input.history));
  EXPECT_TRUE(restored.weight.scale.equal(block.linear->float8()->weight.scale));
  auto longer = delayed_recipe();
  longer.amax_history_len = 8;
  fp8::LinearState other(longer, "blocks.0.linear");
  try {
    other.load_state_dict(saved);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.linear"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("amax_history_len is 8"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fp8::LinearState(fp8::Recipe{}, "dynamic").state_dict().empty());
}

// Two ranks, each with half the batch and the batch group: the same outputs and summed weight gradients as one
// process on the whole batch (each cast's amax is the whole batch's).
void expect_two_ranks_equal_one(const fp8::Recipe& recipe) {
  at::manual_seed(13);
  auto x = at::randn({16, 32}) * at::linspace(0.1, 4, 16).unsqueeze(1), g = at::randn({16, 32});
  Block reference;
  const auto initial = reference.linear->weight.detach().clone(), bias = reference.linear->bias.detach().clone();
  fp8::convert_to_float8_training(reference, recipe, {.skip_first_and_last = false});
  auto whole_x = x.clone().requires_grad_(true);
  auto whole = reference.linear->forward(whole_x);
  whole.backward(g);
  std::vector<at::Tensor> outputs(2), weight_grads(2);
  xlr8::testing::run_ranks(2, [&](Communicator& comm) {
    Block block;
    block.linear->weight.data().copy_(initial);
    block.linear->bias.data().copy_(bias);
    fp8::convert_to_float8_training(block, recipe, {.skip_first_and_last = false}, comm);
    auto half = x.chunk(2)[comm.rank()].clone().requires_grad_(true);
    auto y = block.linear->forward(half);
    y.backward(g.chunk(2)[comm.rank()]);
    outputs[comm.rank()] = y.detach();
    weight_grads[comm.rank()] = block.linear->weight.grad().clone();
  });
  EXPECT_TRUE(at::allclose(at::cat(outputs), whole.detach(), 1e-6, 1e-6)) << fp8::to_string(recipe.scaling);
  EXPECT_TRUE(at::allclose(weight_grads[0] + weight_grads[1], reference.linear->weight.grad(), 1e-5, 1e-5))
      << fp8::to_string(recipe.scaling) << ": "
      << (weight_grads[0] + weight_grads[1] - reference.linear->weight.grad()).abs().max().item<float>();
}

TEST(Float8Ranks, TwoRanksOnHalfTheBatchEqualOneProcessInEveryRecipe) {
  fp8::Recipe rowwise;
  rowwise.scaling = fp8::Scaling::Rowwise;
  rowwise.gradients_e5m2 = false;
  for (const auto& recipe : {fp8::Recipe{}, rowwise, delayed_recipe()}) expect_two_ranks_equal_one(recipe);
}

struct Pair : torch::nn::Module {
  Pair() {
    fc_in = register_module("fc_in", nn::Linear(32, 64));
    fc_out = register_module("fc_out", nn::Linear(64, 32));
  }
  at::Tensor forward(const at::Tensor& x) { return fc_out->forward(at::gelu(fc_in->forward(x))); }
  nn::Linear fc_in{nullptr}, fc_out{nullptr};
};

// Two passes of `pair` on x (its output gradient g): the second's output and weight gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor> two_passes(Pair& pair, const at::Tensor& x, const at::Tensor& g) {
  at::Tensor y;
  for (int pass = 0; pass < 2; ++pass) {
    pair.zero_grad();
    y = pair.forward(x);
    y.backward(g);
  }
  return {y.detach(), pair.fc_in->weight.grad().clone(), pair.fc_out->weight.grad().clone()};
}

// Tensor parallelism: a column-wise fc_in and a row-wise fc_out on 2 ranks equal one process, each rank's gradients
// its slice of the whole: the amaxes of the split activations, gradients and weights are reduced over the tp group.
TEST(Float8Ranks, ColumnAndRowWiseLayersOnTwoTensorParallelRanksEqualOneProcessInEveryRecipe) {
  fp8::Recipe rowwise;
  rowwise.scaling = fp8::Scaling::Rowwise;
  rowwise.gradients_e5m2 = false;
  for (const auto& recipe : {fp8::Recipe{}, rowwise, delayed_recipe()}) {
    SCOPED_TRACE(fp8::to_string(recipe.scaling));
    at::manual_seed(14);
    auto x = at::randn({16, 32}) * at::linspace(0.1, 4, 32), g = at::randn({16, 32});
    Pair whole;
    std::map<std::string, at::Tensor> state;  // the initial values, for the ranks' models
    for (const auto& p : whole.named_parameters()) state[p.key()] = p.value().detach().clone();
    fp8::convert_to_float8_training(whole, recipe, {.skip_first_and_last = false});
    const auto [y, grad_in, grad_out] = two_passes(whole, x, g);
    xlr8::testing::run_ranks(2, [&](Communicator& comm) {
      Pair pair;
      {
        torch::NoGradGuard no_grad;
        for (auto& p : pair.named_parameters()) p.value().copy_(state.at(p.key()));
      }
      tp::parallelize(pair, comm, {{"fc_in", tp::Style::Colwise}, {"fc_out", tp::Style::Rowwise}});
      fp8::convert_to_float8_training(pair, recipe, {.skip_first_and_last = false});
      const auto [y_rank, grad_in_rank, grad_out_rank] = two_passes(pair, x, g);
      EXPECT_TRUE(at::allclose(y_rank, y, 1e-5, 1e-5)) << (y_rank - y).abs().max().item<float>();
      EXPECT_TRUE(at::allclose(grad_in_rank, grad_in.chunk(2, 0)[comm.rank()], 1e-5, 1e-5));
      EXPECT_TRUE(at::allclose(grad_out_rank, grad_out.chunk(2, 1)[comm.rank()], 1e-5, 1e-5));
    });
  }
}

// A small regression in bf16 autocast; fp8 = true converts its middle layers.
// The first and the last step's loss.
std::pair<double, double> losses(bool fp8, fp8::Scaling scaling) {
  at::manual_seed(21);
  torch::nn::Sequential model(nn::Linear(32, 64), torch::nn::Functional(at::gelu, "none"), nn::Linear(64, 64),
                              torch::nn::Functional(at::gelu, "none"), nn::Linear(64, 64),
                              torch::nn::Functional(at::gelu, "none"), nn::Linear(64, 16));
  auto target = nn::Linear(32, 16);
  if (fp8) {
    fp8::Recipe recipe;
    recipe.scaling = scaling;
    recipe.gradients_e5m2 = scaling != fp8::Scaling::Rowwise;
    EXPECT_EQ(fp8::convert_to_float8_training(*model, recipe, {}).converted.size(), 2u);
  }
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    auto x = at::randn({64, 32});
    at::Tensor loss;
    {
      AutocastScope bf16(c10::DeviceType::CPU, at::kBFloat16);
      loss = at::mse_loss(model->forward(x).to(at::kFloat), target->forward(x).detach());
    }
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

TEST(Float8Training, ASmallModelLearnsInFp8AsInBf16) {
  const auto [start, bf16] = losses(false, fp8::Scaling::Tensorwise);
  for (auto scaling : {fp8::Scaling::Tensorwise, fp8::Scaling::Rowwise, fp8::Scaling::Delayed}) {
    const auto [first, in_fp8] = losses(true, scaling);
    std::cout << fp8::to_string(scaling) << ": loss " << first << " -> " << in_fp8 << " (bf16 " << start << " -> " << bf16
              << ")\n";
    EXPECT_LT(in_fp8, 0.01 * first);  // it learned (the loss fell a hundredfold)
    EXPECT_LT(in_fp8, 1.6 * bf16);    // and nearly as well as bf16 (measured 1.20-1.38x on this tiny loss, torch 2.11-2.15)
  }
}

}  // namespace
