// DeepSpeed's loss-scaler state machine and the autocast scope.
#include <gtest/gtest.h>
#include <torch/torch.h>

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
