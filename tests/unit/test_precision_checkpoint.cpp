// DeepSpeed's loss-scaler state machine, the autocast scope, and the safetensors format.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "xlr8/autocast.hpp"
#include "xlr8/error.hpp"
#include "xlr8/loss_scaler.hpp"
#include "xlr8/safetensors.hpp"

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

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  NamedTensors tensors;
  for (auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kByte, at::kBool})
    tensors.emplace_back(std::string("t_") + c10::toString(t), (at::arange(6) % 2).to(t).view({2, 3}));
  tensors.emplace_back("scalar", at::full({}, 3.5));
  auto path = (std::filesystem::temp_directory_path() / ("xlr8_st_" + std::to_string(getpid()))).string();
  save_safetensors(path, tensors, {{"format", "pt"}});
  auto back = load_safetensors(path);
  EXPECT_EQ(back.metadata.at("format"), "pt");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(back.tensors[i].second.equal(tensors[i].second)) << tensors[i].first;
  }
  // The header starts after an 8-byte length and keeps the data 8-byte aligned, as the format specifies.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  std::filesystem::remove(path);
}

TEST(Safetensors, CorruptFilesAreNamedErrors) {
  auto bytes = safetensors_bytes({{"w", at::ones({4})}});
  EXPECT_THROW(parse_safetensors(bytes.substr(0, 5), "x"), Error);
  EXPECT_THROW(parse_safetensors(bytes.substr(0, bytes.size() - 4), "x"), Error);  // data truncated
  std::string bad_header = bytes;
  bad_header[9] = '#';
  try {
    parse_safetensors(bad_header, "model.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors is not a valid safetensors file"), std::string::npos);
  }
}
