// DeepSpeed's loss-scaler state machine and the autocast scope.
#include <gtest/gtest.h>

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
