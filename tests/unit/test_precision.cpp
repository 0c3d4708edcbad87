// DeepSpeed's loss-scaler state machine, the autocast scope, and the training step's phases (how fp16's
// unscaling orders a step).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "step/step_state.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/error.hpp"
#include "xlr8/loss_scaler.hpp"

using namespace xlr8;

TEST(LossScaler, DefaultsAreDeepSpeeds) {
  DynamicLossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScaler, OverflowHalvesOnlyAfterHysteresisAndIsNotRefilledByADecrease) {
  DynamicLossScaler s;
  s.update(true);  // hysteresis 2 -> 1, scale unchanged
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.hysteresis_left(), 1);
  s.update(true);  // now halves
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(true);  // hysteresis stays at 1: halves again
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_EQ(s.hysteresis_left(), 1);
}

TEST(LossScaler, GrowsAfterACleanWindowAndRefillsHysteresis) {
  LossScalerOptions o;
  o.initial_scale_power = 8;
  o.scale_window = 2;
  DynamicLossScaler s(o);
  s.update(false);  // iteration 0: stable 0
  EXPECT_EQ(s.scale(), 256.0);
  s.update(false);  // iteration 1: stable 1
  EXPECT_EQ(s.scale(), 256.0);
  s.update(false);  // iteration 2: stable 2 -> doubles
  EXPECT_EQ(s.scale(), 512.0);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 256.0);
  EXPECT_EQ(s.hysteresis_left(), 1);
  // stable = iteration - last_overflow - 1: the first clean step after an overflow counts 0.
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 256.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 512.0);  // a full clean window after the overflow
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScaler, MinimumScaleRaises) {
  LossScalerOptions o;
  o.initial_scale_power = 1;
  o.hysteresis = 1;
  DynamicLossScaler s(o);
  s.update(true);
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_THROW(s.update(true), Error);
}

TEST(LossScaler, StateRoundTrips) {
  DynamicLossScaler a;
  a.update(true);
  a.update(false);
  DynamicLossScaler b;
  b.load_state(a.state());
  EXPECT_EQ(b.state(), a.state());
}

TEST(Autocast, ScopeEnablesBf16OnCpuAndRestores) {
  auto w = at::randn({4, 4});
  {
    AutocastScope scope(c10::DeviceType::CPU, at::kBFloat16);
    EXPECT_EQ(at::mm(w, w).scalar_type(), at::kBFloat16);
    {
      AutocastPause pause;
      EXPECT_EQ(at::mm(w, w).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(at::mm(w, w).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(at::mm(w, w).scalar_type(), at::kFloat);
  AutocastScope disabled;
  EXPECT_EQ(at::mm(w, w).scalar_type(), at::kFloat);
}

TEST(Autocast, NormsTakeALowerPrecisionInputWithFp32WeightsOnCpu) {
  // A Linear feeding a norm under mixed precision: a bf16 input with fp32 weights. LibTorch 1.x's CPU kernels
  // refused it (xlr8 supplied the policy then); 2.x's take it, and this keeps the LibTorch in use honest.
  torch::manual_seed(3);
  torch::nn::Linear fc(8, 8);
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({8}));
  torch::nn::GroupNorm gn(torch::nn::GroupNormOptions(2, 8));
  torch::nn::BatchNorm1d bn(8);
  auto x = at::randn({6, 8});
  auto run = [&](bool bf16) {
    for (auto* m : std::initializer_list<torch::nn::Module*>{fc.get(), ln.get(), gn.get(), bn.get()}) m->zero_grad();
    at::Tensor loss;
    {
      AutocastScope scope(c10::DeviceType::CPU, at::kBFloat16, bf16);
      auto h = fc(x);
      auto y = ln(h) + gn(h) + bn(h);
      if (bf16) {
        EXPECT_EQ(y.scalar_type(), at::kBFloat16);  // the input's dtype, as 2.x returns it
      }
      loss = y.to(at::kFloat).square().mean();
    }
    loss.backward();
    return std::vector<at::Tensor>{ln->weight.grad().clone(), gn->weight.grad().clone(), bn->weight.grad().clone(),
                                   fc->weight.grad().clone()};
  };
  const auto exact = run(false);
  const auto mixed = run(true);
  for (size_t i = 0; i < exact.size(); ++i) {
    EXPECT_EQ(mixed[i].scalar_type(), at::kFloat);
    EXPECT_LT((mixed[i] - exact[i]).abs().max().item<double>(), 0.05 * exact[i].abs().max().item<double>() + 1e-3) << i;
  }
}

// The step's order as one table: a backward may start a step from any phase; a step's gradients are
// readied once; optimizers apply ready gradients and skip overflowed ones, several per step.
TEST(StepState, EachPhaseFollowsOnlyThePhasesTheStepsOrderAllows) {
  using enum xlr8::step::StepPhase;
  const std::vector<xlr8::step::StepPhase> all{idle, gradients, unscaled, overflowed, updated, skipped};
  std::string table;
  for (auto from : all) {
    table += fmt::format("{}:", xlr8::step::to_string(from));
    for (auto next : all)
      if (xlr8::step::StepState::allowed(from, next)) table += fmt::format(" {}", xlr8::step::to_string(next));
    table += "\n";
  }
  EXPECT_EQ(table,
            "idle: idle gradients unscaled overflowed\n"
            "gradients: idle gradients unscaled overflowed\n"
            "unscaled: idle gradients updated\n"
            "overflowed: idle gradients skipped\n"
            "updated: idle gradients updated\n"
            "skipped: idle gradients skipped\n");
  xlr8::step::StepState state;
  EXPECT_EQ(state.enter(gradients, "backward()"), idle);
  EXPECT_EQ(state.enter(unscaled, "unscale"), gradients);
  try {
    state.enter(skipped, "optimizer.step()");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the training step is unscaled, which skipped cannot follow"), std::string::npos)
        << e.what();
  }
}

// fp16 paths through the phases: a program that sees an infinite norm, zeroes the gradients and goes on
// without a step trains its next step as usual; two optimizers of one step each apply gradients unscaled
// once (the second finds them ready), whatever the first's zero_grad did to its own.
TEST(StepState, Fp16SkippedByTheProgramAndTwoOptimizersOfOneStepEachApplyGradientsUnscaledOnce) {
  AcceleratorOptions o;
  o.mixed_precision = MixedPrecision::FP16;
  Accelerator acc(o);
  auto a = acc.prepare(torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false)));
  auto b = acc.prepare(torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false)));
  auto opt_a = acc.prepare(torch::optim::SGD(a->parameters(), 0.5));
  auto opt_b = acc.prepare(torch::optim::SGD(b->parameters(), 0.25));
  const auto x = torch::ones({1, 2});
  acc.backward(a->forward(x).sum() * std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isinf(acc.clip_grad_norm(a->parameters(), 1.0).value()));
  opt_a.zero_grad();  // the program skips this step itself
  const auto a_before = a->weight.clone(), b_before = b->weight.clone();
  acc.backward(a->forward(x).sum() + b->forward(x).sum());  // d/dw = x = 1 for both
  opt_a.step();
  opt_a.zero_grad();
  opt_b.step();
  EXPECT_TRUE(torch::allclose(a->weight, a_before - 0.5));
  EXPECT_TRUE(torch::allclose(b->weight, b_before - 0.25));
  EXPECT_EQ(opt_a.steps_taken(), 1);
  EXPECT_EQ(opt_b.steps_taken(), 1);
}
