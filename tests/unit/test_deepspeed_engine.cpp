// The DeepSpeed engine on one process: each of its rules against the loop it replaces, written by hand
// in plain LibTorch on the same data (accumulation, clipping, manual backward with scale(), the JSON's
// optimizer, fp16 overflow skips, the boundary override, several engines).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "xlr8/deepspeed.hpp"
#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"

using namespace xlr8;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(11);
  return Net();
}

torch::Tensor batch(int i) { return torch::linspace(-1, 1, 16).reshape({4, 4}) * (1 + 0.1 * i); }
torch::Tensor loss_of(const torch::Tensor& out) { return out.pow(2).mean(); }

// The hand-written loop: losses divided by the accumulation steps, an optional clip, SGD, every `gas`.
Net plain_loop(int micro_steps, int gas, double clip, double* norm = nullptr) {
  auto net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int i = 0; i < micro_steps; ++i) {
    (loss_of(net->forward(batch(i))) / gas).backward();
    if ((i + 1) % gas == 0) {
      double n = torch::nn::utils::clip_grad_norm_(net->parameters(), clip > 0 ? clip : std::numeric_limits<double>::infinity());
      if (norm) *norm = n;
      opt.step();
      opt.zero_grad();
    }
  }
  return net;
}

nlohmann::json sgd_config(int gas, double clip) {
  return {{"train_micro_batch_size_per_gpu", 4},
          {"gradient_accumulation_steps", gas},
          {"gradient_clipping", clip},
          {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}, {"momentum", 0.9}}}}}};
}

void expect_same(Net& got, Net& want, double tolerance = 1e-6) {
  auto a = got->parameters(), b = want->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE((a[i] - b[i]).abs().max().item<double>(), tolerance) << i;
}

}  // namespace

TEST(DeepSpeedEngine, AccumulationAndClippingEqualTheHandWrittenLoopAndTheCountersFollowDeepSpeed) {
  for (double clip : {0.0, 0.05}) {
    SCOPED_TRACE(clip);
    double want_norm = 0;
    auto want = plain_loop(6, 3, clip, &want_norm);
    auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), sgd_config(3, clip));
    EXPECT_FALSE(scheduler.has_value());
    std::vector<bool> boundaries;
    for (int i = 0; i < 6; ++i) {
      boundaries.push_back(engine->is_gradient_accumulation_boundary());
      auto logged = engine->backward(loss_of(engine->forward(batch(i))));
      EXPECT_NEAR(logged.item<double>(), loss_of(engine->model()->forward(batch(i))).item<double>() / 3, 1e-6);
      engine->step();
    }
    EXPECT_EQ(boundaries, (std::vector<bool>{false, false, true, false, false, true}));
    expect_same(engine->model(), want);
    EXPECT_NEAR(engine->get_global_grad_norm(), want_norm, 1e-5);  // the norm before clipping
    EXPECT_EQ(engine->micro_steps(), 6);
    EXPECT_EQ(engine->global_steps(), 2);
    EXPECT_EQ(engine->global_samples(), 2 * 12);  // train_batch_size = 4 x 3 x 1 rank
    EXPECT_EQ(engine->train_batch_size(), 12);
    EXPECT_EQ(engine->skipped_steps(), 0);
    EXPECT_TRUE(engine->was_step_applied());
    EXPECT_EQ(engine->get_lr(), std::vector<double>{0.1});
  }
}

TEST(DeepSpeedEngine, ScaleThenLossBackwardGivesTheGradientsBackwardGives) {
  auto want = plain_loop(4, 2, 0);
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), sgd_config(2, 0));
  for (int i = 0; i < 4; ++i) {
    engine->scale(loss_of(engine->forward(batch(i)))).backward();
    engine->step();
  }
  expect_same(engine->model(), want);
}

TEST(DeepSpeedEngine, TheJsonOptimizerIsDeepSpeedsAdamWWhenAdamWModeIsOn) {
  // DeepSpeed's "Adam" with adam_w_mode (its default) decays weights as AdamW does.
  auto want = make_net();
  torch::optim::AdamW adamw(want->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  for (int i = 0; i < 3; ++i) {
    loss_of(want->forward(batch(i))).backward();
    adamw.step();
    adamw.zero_grad();
  }
  nlohmann::json config = {{"train_batch_size", 4},
                           {"gradient_clipping", 0.0},
                           {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}, {"torch_adam", true}}}}}};
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), config);
  for (int i = 0; i < 3; ++i) {
    engine->backward(loss_of(engine->forward(batch(i))));
    engine->step();
  }
  expect_same(engine->model(), want, 1e-5);
  EXPECT_EQ(engine->gradient_accumulation_steps(), 1);
  // adam_w_mode false: Adam's L2 decay, which moves the weights differently.
  config["optimizer"]["params"]["adam_w_mode"] = false;
  auto l2 = deepspeed::initialize(make_net(), config);
  for (int i = 0; i < 3; ++i) {
    l2.engine->backward(loss_of(l2.engine->forward(batch(i))));
    l2.engine->step();
  }
  EXPECT_GT((l2.engine->model()->fc1->weight - want->fc1->weight).abs().max().item<double>(), 1e-4);
}

TEST(DeepSpeedEngine, Fp16OverflowsSkipTheStepAndMoveTheScaleByTheJsonsRules) {
  nlohmann::json config = sgd_config(1, 0);
  config["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), config);
  EXPECT_EQ(engine->loss_scale(), 256);
  auto before = engine->model()->fc1->weight.clone();
  engine->backward(loss_of(engine->forward(batch(0))) * std::numeric_limits<float>::infinity());
  engine->step();
  EXPECT_FALSE(engine->was_step_applied());
  EXPECT_TRUE(engine->model()->fc1->weight.equal(before));
  EXPECT_EQ(engine->skipped_steps(), 1);
  EXPECT_EQ(engine->global_steps(), 1);  // counted in every case, as DeepSpeed does
  EXPECT_EQ(engine->loss_scale(), 128);  // hysteresis 1: the first overflow halves
  for (int i = 0; i < 3; ++i) {
    engine->backward(loss_of(engine->forward(batch(i))));
    engine->step();
    EXPECT_TRUE(engine->was_step_applied());
  }
  EXPECT_EQ(engine->loss_scale(), 256);  // the window (2) counted from the step after the overflow: doubled
}

TEST(DeepSpeedEngine, TheBoundaryOverrideAndNoSyncFollowDeepSpeed) {
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), sgd_config(4, 0));
  engine->set_gradient_accumulation_boundary(true);
  EXPECT_TRUE(engine->is_gradient_accumulation_boundary());
  auto before = engine->model()->fc1->weight.clone();
  engine->backward(loss_of(engine->forward(batch(0))));
  engine->step();
  EXPECT_FALSE(engine->model()->fc1->weight.equal(before));  // stepped at micro-step 0
  engine->set_gradient_accumulation_boundary(false);
  {
    auto guard = engine->no_sync();
    engine->backward(loss_of(engine->forward(batch(1))));
    EXPECT_THROW(engine->step(), Error);
  }
}

TEST(DeepSpeedEngine, TwoEnginesInOneProcessCountTheirOwnSteps) {
  auto a = deepspeed::initialize(make_net(), sgd_config(2, 0));
  auto b = deepspeed::initialize(make_net(), sgd_config(1, 0));
  for (int i = 0; i < 4; ++i) {
    a.engine->backward(loss_of(a.engine->forward(batch(i))));
    b.engine->backward(loss_of(b.engine->forward(batch(i))));
    a.engine->step();
    b.engine->step();
  }
  EXPECT_EQ(a.engine->global_steps(), 2);
  EXPECT_EQ(b.engine->global_steps(), 4);
  auto want_a = plain_loop(4, 2, 0), want_b = plain_loop(4, 1, 0);
  expect_same(a.engine->model(), want_a);
  expect_same(b.engine->model(), want_b);
}

TEST(DeepSpeedEngine, AnOptimizerGivenTwiceOrNeverAndUnfilledAutoAreRefused) {
  auto net = make_net();
  auto mine = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  auto message = [&](auto&& fn) {
    try {
      fn();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message([&] { deepspeed::initialize(net, sgd_config(1, 0), mine); }).find("keep one of them"), std::string::npos);
  EXPECT_NE(message([&] { deepspeed::initialize(make_net(), nlohmann::json{{"train_batch_size", 4}}); }).find("no optimizer"),
            std::string::npos);
  auto with_auto = sgd_config(1, 0);
  with_auto["gradient_clipping"] = "auto";
  EXPECT_NE(message([&] { deepspeed::initialize(make_net(), with_auto); }).find("leaves gradient_clipping as \"auto\""),
            std::string::npos);
  auto lion = sgd_config(1, 0);
  lion["optimizer"]["type"] = "Lion";
  EXPECT_NE(message([&] { deepspeed::initialize(make_net(), lion); }).find("\"Lion\" is not implemented"), std::string::npos);
  auto typo = sgd_config(1, 0);
  typo["optimizer"]["params"]["momentun"] = 0.9;
  EXPECT_NE(message([&] { deepspeed::initialize(make_net(), typo); }).find("(did you mean \"momentum\"?)"), std::string::npos);
}

namespace {

// The learning rate before any step, then after each of `steps` steps.
std::vector<double> schedule(const nlohmann::json& scheduler, int steps, double optimizer_lr = 0.3) {
  auto net = make_net();
  torch::optim::SGD opt(net->parameters(), optimizer_lr);
  auto sched = deepspeed::make_scheduler(deepspeed::TypedSection{scheduler["type"], scheduler["params"]}, opt);
  std::vector<double> lrs{opt.param_groups()[0].options().get_lr()};
  for (int i = 0; i < steps; ++i) {
    sched->step();
    lrs.push_back(opt.param_groups()[0].options().get_lr());
  }
  return lrs;
}

void expect_lrs(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-7) << "after " << i << " steps";
}

}  // namespace

TEST(DeepSpeedSchedulers, WarmupLRFollowsDeepSpeedsLogAndLinearWarmUp) {
  // Iteration i of W = 4: log(i + 1) / log(4), so i = 1 is exactly half way; the first two steps run at the minimum.
  expect_lrs(schedule({{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 0.1}, {"warmup_num_steps", 4}}}}, 5),
             {0, 0, 0.05, 0.1 * std::log(3.0) / std::log(4.0), 0.1, 0.1});
  expect_lrs(schedule({{"type", "WarmupLR"},
                       {"params", {{"warmup_min_lr", 0.01}, {"warmup_max_lr", 0.09}, {"warmup_num_steps", 4}, {"warmup_type", "linear"}}}},
                      5),
             {0.01, 0.01, 0.03, 0.05, 0.07, 0.09});
  // Without warmup_max_lr, the optimizer's own rate is the maximum.
  expect_lrs(schedule({{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 2}}}}, 3), {0, 0, 0.3, 0.3});
}

TEST(DeepSpeedSchedulers, WarmupDecayLRDecaysLinearlyToZeroAtTheTotal) {
  expect_lrs(schedule({{"type", "WarmupDecayLR"},
                       {"params", {{"warmup_max_lr", 0.1}, {"warmup_num_steps", 4}, {"total_num_steps", 8}, {"warmup_type", "linear"}}}},
                      10),
             {0, 0, 0.025, 0.05, 0.075, 0.1, 0.075, 0.05, 0.025, 0, 0});
  // Its maximum defaults to DeepSpeed's 0.001, not the optimizer's rate.
  auto lrs = schedule({{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 2}, {"total_num_steps", 10}}}}, 3);
  EXPECT_NEAR(lrs.back(), 0.001, 1e-12);
}

TEST(DeepSpeedSchedulers, WarmupCosineLRScalesTheOptimizersRateByTheWarmUpThenACosine) {
  const double quarter = (1 + std::cos(M_PI / 4)) / 2, three_quarters = (1 + std::cos(3 * M_PI / 4)) / 2;
  expect_lrs(schedule({{"type", "WarmupCosineLR"},
                       {"params", {{"total_num_steps", 6}, {"warmup_num_steps", 2}, {"cos_min_ratio", 0.0}, {"warmup_type", "linear"}}}},
                      7, 0.1),
             {0, 0, 0.05, 0.1 * quarter, 0.05, 0.1 * three_quarters, 0, 0});
}

// Expected values: DeepSpeed's own deepspeed/runtime/lr_schedules.py (OneCycle, LRRangeTest, at the
// deepspeedai/DeepSpeed snapshot of 2026-11) run on a stand-in optimizer with one group, printed with repr().
TEST(DeepSpeedSchedulers, OneCycleCyclesTheRateAndAdamsBeta1AndDecaysAfterTheCycleAsDeepSpeedsDoes) {
  auto net = make_net();
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.5));
  auto sched = deepspeed::make_scheduler(
      {"OneCycle",
       {{"cycle_min_lr", 0.1}, {"cycle_max_lr", 1.0}, {"decay_lr_rate", 0.5}, {"cycle_first_step_size", 4},
        {"cycle_second_step_size", 2}, {"decay_step_size", 2}, {"cycle_min_mom", 0.8}, {"cycle_max_mom", 0.9},
        {"decay_mom_rate", 0.1}}},
      opt);
  auto& options = static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
  const std::vector<double> lr = {0.1, 0.3250000000000001, 0.5499999999999999, 0.775, 0.9999999999999998, 0.5499999999999996,
                                  0.1, 0.08, 0.06666666666666667, 0.05714285714285715, 0.05};
  const std::vector<double> beta1 = {0.8, 0.875, 0.8500000000000001, 0.8250000000000001, 0.8, 0.8500000000000001,
                                     0.9, 0.9450000000000001, 0.9900000000000001, 1.035, 1.08};
  for (size_t i = 0; i < lr.size(); ++i) {
    if (i > 0) sched->step();
    EXPECT_NEAR(options.lr(), lr[i], 1e-12) << "after " << i << " steps";
    EXPECT_NEAR(std::get<0>(options.betas()), beta1[i], 1e-12) << "after " << i << " steps";
    EXPECT_EQ(std::get<1>(options.betas()), 0.99);  // DeepSpeed replaces beta2 with 0.99
  }
}

TEST(DeepSpeedSchedulers, OneCycleClimbsInStairsAndLRRangeTestGrowsByItsRateAsDeepSpeedsDo) {
  // SGD has no betas: the momentum does not cycle, the rate does.
  expect_lrs(schedule({{"type", "OneCycle"},
                       {"params", {{"cycle_min_lr", 0.1}, {"cycle_max_lr", 1.0}, {"cycle_first_step_size", 6},
                                   {"cycle_first_stair_count", 3}}}},
                      14),
             {0.1, 0.1, 0.4, 0.4, 0.7, 0.7, 1.0, 0.7, 0.7, 0.4, 0.4, 0.1, 0.1, 0.1, 0.1});
  expect_lrs(schedule({{"type", "LRRangeTest"},
                       {"params", {{"lr_range_test_min_lr", 0.01}, {"lr_range_test_step_size", 3},
                                   {"lr_range_test_step_rate", 2.0}, {"lr_range_test_staircase", true}}}},
                      5),
             {0.01, 0.01, 0.01, 0.03, 0.03, 0.03});
}

namespace {

// Each group's (lr, beta1) before any step, then after each of `steps` steps, on AdamW with two groups (lr 0.3, 0.03).
std::vector<std::vector<std::pair<double, double>>> schedule_two_groups(const nlohmann::json& scheduler, int steps) {
  auto net = make_net();
  std::vector<torch::optim::OptimizerParamGroup> groups{
      {net->fc1->parameters(), std::make_unique<torch::optim::AdamWOptions>(0.3)},
      {net->fc2->parameters(), std::make_unique<torch::optim::AdamWOptions>(0.03)}};
  torch::optim::AdamW opt(std::move(groups));
  auto sched = deepspeed::make_scheduler(deepspeed::TypedSection{scheduler["type"], scheduler["params"]}, opt);
  std::vector<std::vector<std::pair<double, double>>> seen;
  for (int i = 0; i <= steps; ++i) {
    if (i > 0) sched->step();
    auto& row = seen.emplace_back();
    for (auto& group : opt.param_groups()) {
      auto& options = static_cast<torch::optim::AdamWOptions&>(group.options());
      row.emplace_back(options.lr(), std::get<0>(options.betas()));
    }
  }
  return seen;
}

void expect_rows(const std::vector<std::vector<std::pair<double, double>>>& got,
                 const std::vector<std::vector<std::pair<double, double>>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    for (size_t g = 0; g < 2; ++g) {
      EXPECT_NEAR(got[i][g].first, want[i][g].first, 1e-12) << "lr of group " << g << " after " << i << " steps";
      EXPECT_NEAR(got[i][g].second, want[i][g].second, 1e-12) << "beta1 of group " << g << " after " << i << " steps";
    }
}

}  // namespace

// Expected values: DeepSpeed 0.19.8's lr_schedules.py on torch's AdamW with the same two groups, printed with repr().
TEST(DeepSpeedSchedulers, ListsGiveEachParameterGroupItsOwnRatesAndMomentaAsDeepSpeedsDo) {
  expect_rows(schedule_two_groups({{"type", "WarmupLR"},
                                   {"params", {{"warmup_min_lr", {0.01, 0.001}}, {"warmup_max_lr", {0.09, 0.009}},
                                               {"warmup_num_steps", 4}, {"warmup_type", "linear"}}}},
                                  5),
              {{{0.01, 0.9}, {0.001, 0.9}}, {{0.01, 0.9}, {0.001, 0.9}}, {{0.03, 0.9}, {0.003, 0.9}},
               {{0.05, 0.9}, {0.005, 0.9}}, {{0.07, 0.9}, {0.007, 0.9}}, {{0.09, 0.9}, {0.009, 0.9}}});
  // A list of minima with no maximum: each group warms up to its own lr.
  expect_rows(schedule_two_groups({{"type", "WarmupLR"},
                                   {"params", {{"warmup_min_lr", {0.0, 0.01}}, {"warmup_num_steps", 2},
                                               {"warmup_type", "linear"}}}},
                                  3),
              {{{0.0, 0.9}, {0.01, 0.9}}, {{0.0, 0.9}, {0.01, 0.9}}, {{0.15, 0.9}, {0.02, 0.9}}, {{0.3, 0.9}, {0.03, 0.9}}});
  expect_rows(schedule_two_groups({{"type", "WarmupDecayLR"},
                                   {"params", {{"warmup_max_lr", {0.1, 0.2}}, {"warmup_num_steps", 2},
                                               {"total_num_steps", 6}, {"warmup_type", "linear"}}}},
                                  6),
              {{{0, 0.9}, {0, 0.9}}, {{0, 0.9}, {0, 0.9}}, {{0.05, 0.9}, {0.1, 0.9}}, {{0.1, 0.9}, {0.2, 0.9}},
               {{0.075, 0.9}, {0.15, 0.9}}, {{0.05, 0.9}, {0.1, 0.9}}, {{0.025, 0.9}, {0.05, 0.9}}});
  expect_rows(schedule_two_groups({{"type", "OneCycle"},
                                   {"params", {{"cycle_min_lr", {0.1, 0.01}}, {"cycle_max_lr", {1.0, 0.1}},
                                               {"decay_lr_rate", 0.5}, {"cycle_first_step_size", 2},
                                               {"decay_step_size", 2}, {"cycle_min_mom", {0.8, 0.7}},
                                               {"cycle_max_mom", {0.9, 0.95}}, {"decay_mom_rate", 0.1}}}},
                                  8),
              {{{0.1, 0.8}, {0.01, 0.7}}, {{0.55, 0.85}, {0.055, 0.825}}, {{1.0, 0.8}, {0.1, 0.7}},
               {{0.55, 0.85}, {0.055, 0.825}}, {{0.1, 0.9}, {0.01, 0.95}}, {{0.08, 0.945}, {0.008, 0.9975}},
               {{0.06666666666666667, 0.99}, {0.006666666666666667, 1.045}},
               {{0.05714285714285715, 1.035}, {0.005714285714285714, 1.0925}}, {{0.05, 1.08}, {0.005, 1.14}}});
  expect_rows(schedule_two_groups({{"type", "LRRangeTest"},
                                   {"params", {{"lr_range_test_min_lr", {0.01, 0.1}}, {"lr_range_test_step_size", 2}}}},
                                  3),
              {{{0.01, 0.9}, {0.1, 0.9}}, {{0.015, 0.9}, {0.15, 0.9}}, {{0.02, 0.9}, {0.2, 0.9}}, {{0.025, 0.9}, {0.25, 0.9}}});
}

TEST(DeepSpeedSchedulers, AListOfAnotherLengthThanTheGroupsOrOfNonNumbersIsNamed) {
  auto refusal = [](const nlohmann::json& params) {
    try {
      schedule_two_groups({{"type", "WarmupLR"}, {"params", params}}, 1);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("built");
  };
  EXPECT_NE(refusal({{"warmup_max_lr", {0.1, 0.2, 0.3}}}).find("scheduler.params.warmup_max_lr lists 3 values but the "
                                                                "optimizer has 2 parameter groups"),
            std::string::npos);
  EXPECT_NE(refusal({{"warmup_min_lr", {0.1, "x"}}}).find("must be a number or a list of numbers"), std::string::npos);
  EXPECT_NE(refusal({{"warmup_min_lr", nlohmann::json::array()}}).find("is an empty list"), std::string::npos);
  EXPECT_NE(refusal({{"warmup_min_lr", "0.1"}}).find("must be a number or a list of numbers"), std::string::npos);
  // As DeepSpeed, momenta that do not cycle (SGD has no betas) are not checked against the groups.
  auto net = make_net();
  std::vector<torch::optim::OptimizerParamGroup> groups{
      {net->fc1->parameters(), std::make_unique<torch::optim::SGDOptions>(0.1)},
      {net->fc2->parameters(), std::make_unique<torch::optim::SGDOptions>(0.1)}};
  torch::optim::SGD sgd(std::move(groups), torch::optim::SGDOptions(0.1));
  deepspeed::OneCycleOptions cycle;
  cycle.cycle_min_lr = 0.1;
  cycle.cycle_max_lr = 1.0;
  cycle.cycle_min_mom = std::vector<double>{0.8, 0.8, 0.8};
  EXPECT_NO_THROW(deepspeed::OneCycle(sgd, cycle));
  EXPECT_EQ(refusal({{"warmup_min_lr", {0.0, 0.01}}, {"warmup_max_lr", 0.1}}), "built");  // a list beside a scalar
}

TEST(DeepSpeedSchedulers, TheEnginesJsonSchedulerStepsOnlyAfterAnAppliedStep) {
  nlohmann::json config = sgd_config(1, 0);
  config["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 0.1}, {"warmup_num_steps", 4}}}};
  config["fp16"] = {{"enabled", true}, {"hysteresis", 1}};
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), config);
  ASSERT_TRUE(scheduler.has_value());
  EXPECT_EQ(engine->get_lr(), std::vector<double>{0.0});
  for (int i = 0; i < 2; ++i) {
    engine->backward(loss_of(engine->forward(batch(i))));
    engine->step();
  }
  EXPECT_NEAR(engine->get_lr()[0], 0.05, 1e-9);  // two applied steps: iteration 1
  engine->backward(loss_of(engine->forward(batch(2))) * std::numeric_limits<float>::infinity());
  engine->step();
  EXPECT_FALSE(engine->was_step_applied());
  EXPECT_NEAR(engine->get_lr()[0], 0.05, 1e-9);  // the skipped step did not advance it
}

TEST(DeepSpeedSchedulers, AMissingOrUnknownParameterAndAnUnbuiltTypeAreNamed) {
  auto refusal = [](const nlohmann::json& scheduler) {
    try {
      schedule(scheduler, 1);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("built");
  };
  EXPECT_NE(refusal({{"type", "WarmupDecayLR"}, {"params", nlohmann::json::object()}}).find("needs params.total_num_steps"),
            std::string::npos);
  EXPECT_NE(refusal({{"type", "WarmupLR"}, {"params", {{"warmup_num_step", 10}}}}).find("(did you mean \"warmup_num_steps\"?)"),
            std::string::npos);
  EXPECT_NE(refusal({{"type", "OneCycle"}, {"params", nlohmann::json::object()}}).find("needs params.cycle_min_lr"),
            std::string::npos);
  EXPECT_NE(refusal({{"type", "OneCycel"}, {"params", nlohmann::json::object()}}).find("(did you mean \"OneCycle\"?)"),
            std::string::npos);
  // DeepSpeed refuses a warm-up of 0 written in the JSON (0.19.3 on), and warms up with log for a type it does not know.
  EXPECT_NE(refusal({{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 0}}}}).find("must be a positive integer, got 0"),
            std::string::npos);
  EXPECT_EQ(refusal({{"type", "WarmupLR"}, {"params", {{"warmup_type", "cubic"}}}}), "built");
  EXPECT_EQ(refusal({{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", nullptr}}}}), "built");
}

TEST(DeepSpeedEngine, ACheckpointRestoresModelOptimizerSchedulerCountersAndClientStateAndLatestNamesIt) {
  const auto dir = (std::filesystem::temp_directory_path() / fmt::format("xlr8_ds_ckpt_{}", getpid())).string();
  std::filesystem::remove_all(dir);
  nlohmann::json config = sgd_config(1, 0);
  config["scheduler"] = {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 0.1}, {"warmup_num_steps", 10}}}};
  auto train = [](auto& engine, int from, int to) {
    for (int i = from; i < to; ++i) {
      engine->backward(loss_of(engine->forward(batch(i))));
      engine->step();
    }
  };
  auto a = deepspeed::initialize(make_net(), config);
  train(a.engine, 0, 3);
  const auto path = a.engine->save_checkpoint(dir, "", {{"epoch", 2}});
  EXPECT_EQ(path, dir + "/global_step3");
  std::ifstream latest(dir + "/latest");
  std::string tag;
  std::getline(latest, tag);
  EXPECT_EQ(tag, "global_step3");
  train(a.engine, 3, 5);

  torch::manual_seed(99);  // another start: everything must come from the checkpoint
  auto b = deepspeed::initialize(Net(), config);
  auto loaded = b.engine->load_checkpoint(dir);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->first, dir + "/global_step3");
  EXPECT_EQ(loaded->second, (nlohmann::json{{"epoch", 2}}));
  EXPECT_EQ(b.engine->global_steps(), 3);
  EXPECT_EQ(b.engine->global_samples(), 12);
  train(b.engine, 3, 5);
  expect_same(b.engine->model(), a.engine->model());  // momentum and the schedule's position came back too
  EXPECT_EQ(b.engine->get_lr(), a.engine->get_lr());
  // No directory, or no `latest` in it: DeepSpeed warns and loads nothing; the warning says which.
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(b.engine->load_checkpoint(dir + "/nowhere").has_value());
  std::filesystem::create_directories(dir + "/empty");
  EXPECT_FALSE(b.engine->load_checkpoint(dir + "/empty").has_value());
  const auto warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("the directory " + dir + "/nowhere does not exist"), std::string::npos) << warned;
  EXPECT_NE(warned.find(dir + "/empty has no 'latest' file"), std::string::npos) << warned;
  std::filesystem::remove_all(dir);
}

// An elastic restart changes gradient_accumulation_steps with the world size: a loaded engine's windows start where
// the saved run's ended (saved after 4 micro-steps of 2, loaded under 3: the third micro-step is the boundary; before,
// the saved count modulo 3 made the second one).
TEST(DeepSpeedEngine, ALoadUnderAnotherAccumulationStartsItsWindowsWhereTheSavedRunsEnded) {
  const auto dir = (std::filesystem::temp_directory_path() / fmt::format("xlr8_ds_gas_{}", getpid())).string();
  std::filesystem::remove_all(dir);
  auto a = deepspeed::initialize(make_net(), sgd_config(2, 0));
  for (int i = 0; i < 4; ++i) {
    a.engine->backward(loss_of(a.engine->forward(batch(i))));
    a.engine->step();
  }
  a.engine->save_checkpoint(dir);
  auto b = deepspeed::initialize(make_net(), sgd_config(3, 0));
  ASSERT_TRUE(b.engine->load_checkpoint(dir).has_value());
  std::vector<bool> boundaries;
  for (int i = 0; i < 3; ++i) {
    boundaries.push_back(b.engine->is_gradient_accumulation_boundary());
    b.engine->backward(loss_of(b.engine->forward(batch(i))));
    b.engine->step();
  }
  EXPECT_EQ(boundaries, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(b.engine->global_steps(), 3);
  EXPECT_EQ(b.engine->micro_steps(), 7);
  std::filesystem::remove_all(dir);
}

TEST(DeepSpeedEngine, Save16BitModelWritesTheTrainingDtypeAndUnderZero3OnlyWhenAskedTo) {
  const auto dir = (std::filesystem::temp_directory_path() / fmt::format("xlr8_ds_16bit_{}", getpid())).string();
  std::filesystem::remove_all(dir);
  nlohmann::json config = sgd_config(1, 0);
  config["fp16"] = {{"enabled", true}};
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), config);
  ASSERT_TRUE(engine->save_16bit_model(dir));
  auto saved = load_safetensors(dir + "/model.safetensors");
  ASSERT_EQ(saved.tensors.size(), 4u);
  for (const auto& [name, tensor] : saved.tensors) {
    EXPECT_EQ(tensor.scalar_type(), at::kHalf) << name;
    EXPECT_TRUE(tensor.equal(engine->model()->named_parameters()[name].to(at::kHalf))) << name;
  }
  config["zero_optimization"] = {{"stage", 3}};
  auto z3 = deepspeed::initialize(make_net(), config);
  EXPECT_FALSE(z3.engine->save_16bit_model(dir, "z3.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/z3.safetensors"));
  config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
  auto gathered = deepspeed::initialize(make_net(), config);
  EXPECT_TRUE(gathered.engine->save_16bit_model(dir, "z3.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/z3.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST(DeepSpeedEngine, LeafModulesAreMatchedByClassNameOrSuffixAndAMatchOfNothingIsNamed) {
  auto net = make_net();
  EXPECT_EQ(deepspeed::set_z3_leaf_modules(*net, {"Linear"}), 2);  // torch::nn::Linear, as the config names classes
  EXPECT_EQ(deepspeed::set_z3_leaf_modules_by_name(*net, {"fc1"}), 1);
  EXPECT_EQ(deepspeed::set_z3_leaf_modules_by_suffix(*net, {"fc2"}), 1);
  try {
    deepspeed::set_z3_leaf_modules(*net, {"Experts"});
    ADD_FAILURE() << "a class the model does not have was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no module of the model matches Experts"), std::string::npos) << e.what();
  }
}

namespace {
struct NineRows {
  size_t size() const { return 9; }
  torch::data::Example<> get(size_t i) const {
    return {torch::full({4}, static_cast<float>(i)), torch::zeros({2})};
  }
};
}  // namespace

TEST(DeepSpeedEngine, InitializeWithTrainingDataGivesALoaderOfShuffledMicroBatchesInDeepSpeedsTupleOrder) {
  auto config = sgd_config(2, 0);
  config["train_micro_batch_size_per_gpu"] = 2;
  config["dataloader_drop_last"] = true;
  auto [engine, optimizer, loader, scheduler] = deepspeed::initialize(make_net(), config, NineRows{});
  EXPECT_FALSE(scheduler.has_value());
  EXPECT_EQ(loader->size(), 4);  // 9 rows in micro-batches of 2, the partial one dropped
  std::vector<int> order;
  for (auto& batch : *loader) {
    ASSERT_EQ(batch.data.size(0), 2);
    for (int64_t r = 0; r < 2; ++r) order.push_back(static_cast<int>(batch.data[r][0].item<float>()));
    engine->backward(loss_of(engine->forward(batch.data)));
    engine->step();
  }
  EXPECT_EQ(engine->global_steps(), 2);  // 4 micro-steps, accumulation 2
  EXPECT_EQ(std::set<int>(order.begin(), order.end()).size(), 8u);
  EXPECT_FALSE(std::is_sorted(order.begin(), order.end()));  // DeepSpeed's training sampler shuffles
  // A path, JSON text or parsed JSON work the same; without drop_last the partial batch stays.
  config["dataloader_drop_last"] = false;
  auto with_text = deepspeed::initialize(make_net(), config.dump(), NineRows{});
  EXPECT_EQ(with_text.training_dataloader->size(), 5);
}

TEST(DeepSpeedEngine, WallClockBreakdownTimesEachPhaseAndPrintsEachIntervalOnlyWhenTheConfigAsks) {
  auto config = sgd_config(2, 1.0);
  config["wall_clock_breakdown"] = true;
  config["steps_per_print"] = 2;
  auto [engine, optimizer, scheduler] = deepspeed::initialize(make_net(), config);
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  for (int i = 0; i < 8; ++i) {
    engine->backward(loss_of(engine->forward(batch(i))));
    engine->step();
  }
  const auto printed = ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  const auto& w = engine->wall_clock();
  EXPECT_GT(w.forward_ms, 0);
  EXPECT_GT(w.backward_ms, 0);
  EXPECT_GT(w.step_ms, 0);
  EXPECT_NEAR(w.backward_ms, w.backward_inner_ms + w.backward_allreduce_ms, 1e-9);
  // Four optimizer steps, printed every two: "over steps 1-2" and "over steps 3-4".
  EXPECT_NE(printed.find("time (ms) over steps 1-2 | fwd: "), std::string::npos) << printed;
  EXPECT_NE(printed.find("time (ms) over steps 3-4 | fwd: "), std::string::npos) << printed;

  auto [quiet, o, s] = deepspeed::initialize(make_net(), sgd_config(1, 1.0));
  quiet->backward(loss_of(quiet->forward(batch(0))));
  quiet->step();
  EXPECT_EQ(quiet->wall_clock().forward_ms, 0);
  EXPECT_EQ(quiet->wall_clock().step_ms, 0);
}
