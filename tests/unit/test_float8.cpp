// fp8's numerics (issue 45): the saturated casts against LibTorch's own float8 conversion over every bf16 value
// and a million fp32 values, the scaled gemm against a product of the cast values, and each recipe's forward and
// backward against the same products computed here from the definitions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>

#include "precision/float8_linear.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/nn.hpp"

namespace {

using namespace xlr8;

constexpr auto kE4M3 = at::kFloat8_e4m3fn;
constexpr auto kE5M2 = at::kFloat8_e5m2;

// The bit pattern of the largest finite value of each format, +: e4m3fn 0x7E (448), e5m2 0x7B (57344).
uint8_t max_bits(at::ScalarType float8) { return float8 == kE4M3 ? 0x7E : 0x7B; }

// fp8's rule checked value by value: within the finite range xlr8's cast is LibTorch's conversion (bit for bit);
// beyond it (and ±inf) the largest finite value of that sign; NaN stays NaN.
void expect_cast_matches_libtorch(const at::Tensor& values, at::ScalarType float8) {
  auto ours = fp8::cast_to_float8(values, at::ones({}), float8);
  auto as_float = values.to(at::kFloat);
  auto libtorch = as_float.to(float8);
  auto ours_bits = ours.view(at::kByte), theirs_bits = libtorch.view(at::kByte);
  const double limit = fp8::max_finite(float8);
  auto nan = as_float.isnan();
  auto beyond = as_float.abs().gt(limit).logical_and(nan.logical_not());
  auto within = nan.logical_or(beyond).logical_not();
  EXPECT_TRUE(ours_bits.masked_select(within).equal(theirs_bits.masked_select(within))) << c10::toString(float8);
  EXPECT_TRUE(ours.to(at::kFloat).masked_select(nan).isnan().all().item<bool>());
  auto expected_beyond = at::where(as_float.lt(0), at::scalar_tensor(0x80 | max_bits(float8), at::kInt),
                                   at::scalar_tensor(max_bits(float8), at::kInt))
                             .to(at::kByte);
  EXPECT_TRUE(ours_bits.masked_select(beyond).equal(expected_beyond.masked_select(beyond))) << c10::toString(float8);
  EXPECT_GT(beyond.sum().item<int64_t>(), 0);  // the test met values beyond the range
}

TEST(Float8Cast, EveryBf16ValueCastsAsLibTorchConvertsItAndSaturatesBeyondTheRange) {
  auto bits = at::arange(0, 1 << 16, at::kInt).to(at::kShort);  // every 16-bit pattern, as int16
  auto every_bf16 = bits.view(at::kBFloat16);
  for (auto float8 : {kE4M3, kE5M2}) expect_cast_matches_libtorch(every_bf16, float8);
}

TEST(Float8Cast, AMillionFp32ValuesAndTheBoundariesCastAsLibTorchConvertsThem) {
  at::manual_seed(45);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (auto float8 : {kE4M3, kE5M2}) {
    const float top = static_cast<float>(fp8::max_finite(float8));
    const float tiny = float8 == kE4M3 ? std::ldexp(1.0f, -9) : std::ldexp(1.0f, -16);  // smallest subnormal
    // Random bit patterns (every exponent), values spread over the fp8 range, and the edges of each format.
    auto patterns = at::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), {400000},
                                at::kInt).view(at::kFloat);
    auto spread = at::randn({600000}) * at::pow(2.0, at::randint(-20, 20, {600000}).to(at::kFloat));
    auto edges = at::tensor({top, -top, std::nextafter(top, inf), top * 1.03f, top * 1.1f, 2 * top, tiny, -tiny,
                             tiny / 2, tiny * 0.75f, tiny * 1.5f, 0.0f, -0.0f, inf, -inf, nan,
                             std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()});
    expect_cast_matches_libtorch(at::cat({patterns, spread, edges}), float8);
  }
}

TEST(Float8Cast, TheScaleMultipliesBeforeTheRoundingAndComesFromTheAmax) {
  auto x = at::randn({1000}) * 7;
  auto amax = x.abs().max();
  auto scale = fp8::scale_for(amax, kE4M3);
  EXPECT_FLOAT_EQ(scale.item<float>(), static_cast<float>(448.0 / amax.item<double>()));
  auto cast = fp8::cast_to_float8(x, scale, kE4M3);
  EXPECT_TRUE(cast.view(at::kByte).equal((x * scale).to(kE4M3).view(at::kByte)));
  EXPECT_FLOAT_EQ(cast.to(at::kFloat).abs().max().item<float>(), 448.0f);  // the amax lands on the largest value
  EXPECT_FLOAT_EQ(fp8::scale_for(amax, kE5M2, /*margin=*/2).item<float>(),
                  static_cast<float>(57344.0 / amax.item<double>() / 4));
  EXPECT_TRUE(std::isfinite(fp8::scale_for(at::zeros({}), kE4M3).item<float>()));  // a zero tensor casts to zeros
  EXPECT_THROW(fp8::max_finite(at::kBFloat16), Error);
}

// The reference product: the fp8 values exactly (in double), divided by their scales.
at::Tensor reference_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb) {
  return at::mm(a.to(at::kDouble), b.to(at::kDouble)) / (sa.to(at::kDouble) * sb.to(at::kDouble));
}

TEST(Float8ScaledMm, TensorwiseAndRowwiseProductsEqualTheProductOfTheCastValues) {
  at::manual_seed(3);
  auto x = at::randn({48, 64}), w = at::randn({32, 64});
  // Tensorwise.
  auto sx = fp8::scale_for(x.abs().max(), kE4M3), sw = fp8::scale_for(w.abs().max(), kE4M3);
  auto x8 = fp8::cast_to_float8(x, sx, kE4M3), w8 = fp8::cast_to_float8(w, sw, kE4M3);
  auto got = fp8::scaled_mm(x8, w8.t(), sx, sw, at::kFloat);
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), reference_mm(x8, w8.t(), sx, sw), 1e-5, 1e-5));
  // Without an fp8 gemm (the CPU's choice): the same values, summed in another order than LibTorch's own CPU
  // _scaled_mm sums them, where this LibTorch has one.
  auto modelled = fp8::dequantised_mm(x8, w8.t(), sx, sw, at::kFloat);
  EXPECT_TRUE(at::allclose(modelled.to(at::kDouble), reference_mm(x8, w8.t(), sx, sw), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(modelled, got, 1e-5, 1e-5));
  EXPECT_FALSE(fp8::has_fp8_gemm(at::kCPU, false));  // so that a CPU run never depends on timing two gemms
  try {
    auto libtorch = at::_scaled_mm(x8, w8.t(), sx.reciprocal(), sw.reciprocal(), std::nullopt, std::nullopt, at::kFloat);
    EXPECT_TRUE(at::allclose(libtorch, modelled, 1e-5, 1e-5));
  } catch (const c10::Error& e) {
    std::cout << "this LibTorch has no CPU _scaled_mm: " << std::string(e.what()).substr(0, 120) << "\n";
  }
  // Rowwise: a scale per row of x and per row of w (a column of the product).
  auto rx = fp8::scale_for(at::amax(x.abs(), {1}, true), kE4M3), rw = fp8::scale_for(at::amax(w.abs(), {1}, true), kE4M3);
  auto xr = fp8::cast_to_float8(x, rx, kE4M3), wr = fp8::cast_to_float8(w, rw, kE4M3);
  got = fp8::scaled_mm(xr, wr.t(), rx, rw.t(), at::kFloat);
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), reference_mm(xr, wr.t(), rx, rw.t()), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(fp8::dequantised_mm(xr, wr.t(), rx, rw.t(), at::kFloat), got, 1e-5, 1e-5));
  // In bf16, the product rounds once at the end.
  auto bf16 = fp8::scaled_mm(x8, w8.t(), sx, sw, at::kBFloat16);
  EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::allclose(bf16.to(at::kDouble), reference_mm(x8, w8.t(), sx, sw), 1e-2, 1e-2));
  // The fp8 values differ from the input: the cast really rounded (3 mantissa bits).
  EXPECT_GT((x8.to(at::kFloat) / sx - x).abs().max().item<float>(), 1e-3);
  EXPECT_THROW(fp8::scaled_mm(x, w.t(), sx, sw, at::kFloat), Error);
}

// On a lent GPU: the CUDA casts equal the CPU's bit for bit, and the fp8 gemm (cuBLASLt's, from compute capability
// 8.9) equals the product of the cast values within bf16's rounding of its output.
TEST(Float8CastOnAGpu, TheCudaCastsEqualTheCpusAndTheFp8GemmTheProductOfTheCastValues) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(45);
  auto bits = at::arange(0, 1 << 16, at::kInt).to(at::kShort).view(at::kBFloat16);
  auto floats = at::cat({at::randn({500000}) * at::pow(2.0, at::randint(-20, 20, {500000}).to(at::kFloat)),
                         at::randint(-(1LL << 31), (1LL << 31) - 1, {500000}, at::kInt).view(at::kFloat)});
  const auto scale = at::full({}, 0.75);
  for (auto float8 : {kE4M3, kE5M2})
    for (const auto& values : {bits, floats}) {
      auto cpu = fp8::cast_to_float8(values, scale, float8).view(at::kByte);
      auto cuda = fp8::cast_to_float8(values.cuda(), scale.cuda(), float8).view(at::kByte).cpu();
      auto nan = fp8::cast_to_float8(values, scale, float8).to(at::kFloat).isnan();  // NaN's bits may differ
      EXPECT_TRUE(cpu.masked_select(nan.logical_not()).equal(cuda.masked_select(nan.logical_not())))
          << c10::toString(float8);
    }
  const bool tensor_cores = fp8::has_fp8_gemm(at::Device(at::kCUDA, 0), false);
  std::cout << "fp8 gemm on this GPU: " << (tensor_cores ? "_scaled_mm" : "dequantised") << "\n";
  auto x = at::randn({64, 128}, at::kCUDA), w = at::randn({96, 128}, at::kCUDA);
  auto sx = fp8::scale_for(x.abs().max(), kE4M3), sw = fp8::scale_for(w.abs().max(), kE4M3);
  auto x8 = fp8::cast_to_float8(x, sx, kE4M3), w8 = fp8::cast_to_float8(w, sw, kE4M3);
  auto got = fp8::scaled_mm(x8, w8.t(), sx, sw, at::kBFloat16).cpu().to(at::kDouble);
  EXPECT_TRUE(at::allclose(got, reference_mm(x8.cpu(), w8.t().cpu(), sx.cpu(), sw.cpu()), 1e-2, 1e-2));
  auto rx = fp8::scale_for(at::amax(x.abs(), {1}, true), kE4M3), rw = fp8::scale_for(at::amax(w.abs(), {1}, true), kE4M3);
  auto xr = fp8::cast_to_float8(x, rx, kE4M3), wr = fp8::cast_to_float8(w, rw, kE4M3);
  got = fp8::scaled_mm(xr, wr.t(), rx, rw.t(), at::kBFloat16).cpu().to(at::kDouble);
  EXPECT_TRUE(at::allclose(got, reference_mm(xr.cpu(), wr.t().cpu(), rx.cpu(), rw.t().cpu()), 1e-2, 1e-2));
}

// An fp32 layer (no autocast) converted with `recipe`, and its input.
struct Layer {
  nn::Linear linear{nn::Linear(64, 32)};
  std::shared_ptr<fp8::LinearState> state;
  explicit Layer(const fp8::Recipe& recipe) {
    state = std::make_shared<fp8::LinearState>(recipe, "layer");
    linear->use_float8(state);
  }
};

// Forward, and backward from upstream gradient `g`: (y, grad x, grad w).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run(Layer& layer, const at::Tensor& x_in, const at::Tensor& g) {
  auto x = x_in.clone().requires_grad_(true);
  layer.linear->weight.mutable_grad() = at::Tensor();
  auto y = layer.linear->forward(x);
  y.backward(g);
  return {y.detach(), x.grad(), layer.linear->weight.grad()};
}

at::Tensor tensorwise_scale(const at::Tensor& t, at::ScalarType float8) { return fp8::scale_for(t.abs().max(), float8); }
at::Tensor cast(const at::Tensor& t, const at::Tensor& s, at::ScalarType f) { return fp8::cast_to_float8(t, s, f); }

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, 1e-5, 1e-5))
      << what << ": max difference " << (got.to(at::kDouble) - want).abs().max().item<double>();
}

TEST(Float8Linear, TensorwiseForwardAndBothGradientGemmsUseTheAmaxScalesWithE5m2Gradients) {
  at::manual_seed(5);
  Layer layer{fp8::Recipe{}};
  auto x = at::randn({24, 64}), g = at::randn({24, 32}) * 1e-3;
  auto [y, gx, gw] = run(layer, x, g);
  auto w = layer.linear->weight.detach(), b = layer.linear->bias.detach();
  auto sx = tensorwise_scale(x, kE4M3), sw = tensorwise_scale(w, kE4M3), sg = tensorwise_scale(g, kE5M2);
  auto x8 = cast(x, sx, kE4M3), w8 = cast(w, sw, kE4M3), g8 = cast(g, sg, kE5M2);
  expect_close(y, reference_mm(x8, w8.t(), sx, sw) + b.to(at::kDouble), "forward");
  expect_close(gx, reference_mm(g8, w8, sg, sw), "grad_input");
  expect_close(gw, reference_mm(g8.t(), x8, sg, sx), "grad_weight");
  // Not what the layer computes in fp32: fp8 really ran.
  EXPECT_GT((y - at::linear(x, w, b)).abs().max().item<float>(), 1e-3);
}

TEST(Float8Linear, RowwiseCastsEachOperandAlongTheContractionOfItsGemmInE4m3) {
  at::manual_seed(6);
  fp8::Recipe recipe;
  recipe.scaling = fp8::Scaling::Rowwise;
  recipe.gradients_e5m2 = false;
  Layer layer{recipe};
  auto x = at::randn({24, 64}) * at::rand({24, 1}) * 10, g = at::randn({24, 32});
  auto [y, gx, gw] = run(layer, x, g);
  auto w = layer.linear->weight.detach(), b = layer.linear->bias.detach();
  auto along = [](const at::Tensor& t, int64_t dim) { return fp8::scale_for(at::amax(t.abs(), {dim}, true), kE4M3); };
  // forward: x [M, K] and w [N, K] over K.
  auto sx = along(x, 1), sw = along(w, 1);
  expect_close(y, reference_mm(cast(x, sx, kE4M3), cast(w, sw, kE4M3).t(), sx, sw.t()) + b.to(at::kDouble), "forward");
  // grad_input = g [M, N] @ w [N, K]: over N.
  auto sg_rows = along(g, 1), sw_cols = along(w, 0);
  expect_close(gx, reference_mm(cast(g, sg_rows, kE4M3), cast(w, sw_cols, kE4M3), sg_rows, sw_cols), "grad_input");
  // grad_weight = g^T [N, M] @ x [M, K]: over M.
  auto sg_cols = along(g, 0), sx_cols = along(x, 0);
  expect_close(gw, reference_mm(cast(g, sg_cols, kE4M3).t(), cast(x, sx_cols, kE4M3), sg_cols.t(), sx_cols),
               "grad_weight");
}

TEST(Float8Linear, DelayedScalingCastsWithTheScaleOfEarlierAmaxesAndUpdatesItEveryInterval) {
  at::manual_seed(7);
  fp8::Recipe recipe;
  recipe.scaling = fp8::Scaling::Delayed;
  recipe.amax_history_len = 2;
  Layer layer{recipe};
  auto& s = *layer.state;
  std::vector<at::Tensor> xs, gs;
  for (int step = 0; step < 3; ++step) {
    xs.push_back(at::randn({16, 64}) * (step + 1));
    gs.push_back(at::randn({16, 32}) * 1e-2);
  }
  // Step 1 casts with scale 1 (nothing recorded yet), then records its amaxes.
  auto w = layer.linear->weight.detach();
  auto [y0, gx0, gw0] = run(layer, xs[0], gs[0]);
  auto one = at::ones({});
  expect_close(y0, reference_mm(cast(xs[0], one, kE4M3), cast(w, one, kE4M3).t(), one, one) +
                       layer.linear->bias.detach().to(at::kDouble), "first forward");
  expect_close(gx0, reference_mm(cast(gs[0], one, kE5M2), cast(w, one, kE4M3), one, one), "first grad_input");
  EXPECT_FLOAT_EQ(s.input.scale.item<float>(), tensorwise_scale(xs[0], kE4M3).item<float>());
  EXPECT_FLOAT_EQ(s.grad_output.scale.item<float>(), tensorwise_scale(gs[0], kE5M2).item<float>());
  // Step 2 casts with step 1's scales.
  auto [y1, gx1, gw1] = run(layer, xs[1], gs[1]);
  auto sx = tensorwise_scale(xs[0], kE4M3), sw = tensorwise_scale(w, kE4M3), sg = tensorwise_scale(gs[0], kE5M2);
  expect_close(gw1, reference_mm(cast(gs[1], sg, kE5M2).t(), cast(xs[1], sx, kE4M3), sg, sx), "second grad_weight");
  expect_close(y1, reference_mm(cast(xs[1], sx, kE4M3), cast(w, sw, kE4M3).t(), sx, sw) +
                       layer.linear->bias.detach().to(at::kDouble), "second forward");
  EXPECT_EQ(s.input.casts, 2);
  EXPECT_FLOAT_EQ(s.input.history[0].item<float>(), xs[1].abs().max().item<float>());
  EXPECT_FLOAT_EQ(s.input.history[1].item<float>(), xs[0].abs().max().item<float>());
}

TEST(Float8Linear, DelayedScalingTakesTheHistorysMaxWithItsMarginAndWaitsForTheInterval) {
  fp8::Recipe recipe;
  recipe.scaling = fp8::Scaling::Delayed;
  recipe.amax_history_len = 3;
  recipe.amax_most_recent = false;
  recipe.margin = 1;
  recipe.interval = 2;
  Layer layer{recipe};
  const double amaxes[] = {4.0, 8.0, 2.0};
  std::vector<float> scales;
  for (double amax : amaxes) {
    auto x = at::zeros({16, 64});
    x[3][5] = -amax;
    run(layer, x, at::zeros({16, 32}));
    scales.push_back(layer.state->input.scale.item<float>());
  }
  EXPECT_FLOAT_EQ(scales[0], 1.0f);                      // interval 2: not updated after the first cast
  EXPECT_FLOAT_EQ(scales[1], static_cast<float>(448.0 / 8 / 2));  // max(4, 8), margin 1
  EXPECT_FLOAT_EQ(scales[2], scales[1]);                  // the third cast waits for the fourth
  EXPECT_FLOAT_EQ(layer.state->grad_output.scale.item<float>(), 1.0f);  // zero gradients keep the scale
}

TEST(Float8Linear, EvaluationComputesInTheComputeDtypeUnlessTheRecipeSaysFp8) {
  at::manual_seed(8);
  Layer layer{fp8::Recipe{}};
  auto x = at::randn({8, 64});
  layer.linear->eval();
  auto w = layer.linear->weight.detach(), b = layer.linear->bias.detach();
  EXPECT_TRUE(layer.linear->forward(x).equal(at::linear(x, w, b)));
  fp8::Recipe in_fp8;
  in_fp8.use_autocast_during_eval = true;
  Layer evaluated{in_fp8};
  evaluated.linear->eval();
  auto y = evaluated.linear->forward(x);
  auto w2 = evaluated.linear->weight.detach();
  EXPECT_FALSE(y.equal(at::linear(x, w2, evaluated.linear->bias.detach())));
}

TEST(Float8Linear, UnderBf16AutocastTheProductIsBf16AndTheWeightGradientFp32) {
  at::manual_seed(9);
  Layer layer{fp8::Recipe{}};
  auto x = at::randn({8, 64}).requires_grad_(true);
  at::Tensor y;
  {
    AutocastScope bf16(c10::DeviceType::CPU, at::kBFloat16);
    y = layer.linear->forward(x);
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  y.sum().backward();
  EXPECT_EQ(layer.linear->weight.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
}

}  // namespace
