// fp8's numerics: saturated casts, scales from amaxes, and the scaled gemm (float8.hpp).
#include "xlr8/float8.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "xlr8/error.hpp"

namespace xlr8::fp8 {
namespace {

at::Tensor dequantised(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                       at::ScalarType out_dtype) {
  auto product = at::mm(a.to(at::kFloat), b.to(at::kFloat));
  return (product * (a_scale.reciprocal() * b_scale.reciprocal())).to(out_dtype);
}

bool is_float8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// The fp8 gemm's rule on CUDA: the contraction a multiple of 16. Zeros added to both operands leave the
// product unchanged.
std::pair<at::Tensor, at::Tensor> pad_contraction(const at::Tensor& a, const at::Tensor& b) {
  const int64_t k = a.size(1), padded = (k + 15) / 16 * 16;
  if (padded == k) return {a, b};
  auto wide_a = at::zeros({a.size(0), padded}, a.options());
  wide_a.narrow(1, 0, k).copy_(a);
  auto tall_b = at::zeros({padded, b.size(1)}, b.options());
  tall_b.narrow(0, 0, k).copy_(b);
  return {wide_a, tall_b};
}

at::Tensor real_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                          at::ScalarType out_dtype) {
  auto [left, right] = a.is_cuda() ? pad_contraction(a, b) : std::pair{a, b};
  // The first operand row-major, the second column-major (cuBLASLt's layout for fp8).
  left = left.contiguous();
  right = right.t().contiguous().t();
  return at::_scaled_mm(left, right, a_scale.reciprocal().to(at::kFloat), b_scale.reciprocal().to(at::kFloat),
                        std::nullopt, std::nullopt, out_dtype);
}

struct GemmSupport {
  std::mutex mutex;
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, bool>, bool> known;
};
GemmSupport& gemm_support() {
  static GemmSupport support;
  return support;
}

}  // namespace

std::string to_string(Scaling scaling) {
  switch (scaling) {
    case Scaling::Tensorwise: return "tensorwise";
    case Scaling::Rowwise: return "rowwise";
    case Scaling::Delayed: return "delayed";
  }
  return "?";
}

Recipe recipe_from(const Fp8Settings& s) {
  Recipe r;
  r.use_autocast_during_eval = s.use_autocast_during_eval;
  if (s.backend == "TE") {
    r.scaling = Scaling::Delayed;
    r.gradients_e5m2 = s.fp8_format != "E4M3";
    r.margin = s.margin;
    r.interval = s.interval;
    r.amax_history_len = s.amax_history_len;
    r.amax_most_recent = s.amax_compute_algo != "max";
    r.compute_precision = s.override_linear_precision;
  } else if (s.ao_recipe == "rowwise") {
    r.scaling = Scaling::Rowwise;
    r.gradients_e5m2 = false;  // torchao's rowwise recipe casts every operand to e4m3
  }
  return r;
}

LayerFilter filter_from(const Fp8Settings& s) {
  // Accelerate filters AO's first and last Linear; Transformer Engine converts every layer.
  return LayerFilter{.skip_first_and_last = s.backend != "TE" && s.skip_first_and_last_linear,
                     .min_features = s.min_linear_features,
                     .strict = s.strict_linear_widths};
}

double max_finite(at::ScalarType float8) {
  if (float8 == at::kFloat8_e4m3fn) return 448.0;
  if (float8 == at::kFloat8_e5m2) return 57344.0;
  throw Error(fmt::format("fp8: {} is not a float8 dtype (Float8_e4m3fn or Float8_e5m2)", c10::toString(float8)));
}

at::Tensor scale_for(const at::Tensor& amax, at::ScalarType float8, int margin) {
  // In double, as torchao computes it, then fp32: the scale of a tiny amax does not overflow to inf on the way.
  auto scale = max_finite(float8) / amax.to(at::kDouble).clamp_min(1e-12);
  if (margin > 0) scale = scale / std::ldexp(1.0, margin);
  return scale.to(at::kFloat);
}

at::Tensor cast_to_float8(const at::Tensor& x, const at::Tensor& scale, at::ScalarType float8) {
  const double limit = max_finite(float8);
  // A scale with a dimension takes part in type promotion: the product is fp32, each element read once and
  // widened on the way (a 0-dim fp32 scale would leave a bf16 product, rounded twice).
  auto scaled = at::mul(x, scale.dim() == 0 ? scale.to(at::kFloat).reshape({1}) : scale.to(at::kFloat));
  if (scaled.scalar_type() != at::kFloat) scaled = scaled.to(at::kFloat);
  return scaled.clamp_(-limit, limit).to(float8);
}

at::Tensor dequantised_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                          const at::Tensor& b_scale, at::ScalarType out_dtype) {
  return dequantised(a, b, a_scale, b_scale, out_dtype);
}

bool has_fp8_gemm(c10::Device device, bool rowwise) {
  // A CPU has no fp8 arithmetic: LibTorch's CPU _scaled_mm widens too, as fast as our product at best (1.1x its time
  // on an AVX2 EPYC) and 60x slower on AVX512-FP16/AMX ones (oneDNN's reference kernel). The two sum in different
  // orders, so choosing between them by timing them made runs differ under load (a resumed run missed the straight
  // one by 6e-5): the CPU always takes the dequantised product.
  if (device.is_cpu()) return false;
  auto& support = gemm_support();
  const auto key = std::tuple{device.type(), device.index(), rowwise};
  {
    std::lock_guard<std::mutex> lock(support.mutex);
    if (auto it = support.known.find(key); it != support.known.end()) return it->second;
  }
  bool works = true;
  try {
    auto a = at::ones({16, 16}, at::TensorOptions().device(device)).to(at::kFloat8_e4m3fn);
    auto one = at::ones(rowwise ? std::vector<int64_t>{16, 1} : std::vector<int64_t>{}, a.options().dtype(at::kFloat));
    auto product = real_scaled_mm(a, a.t(), one, rowwise ? one.t() : one, at::kBFloat16);
    works = product.to(at::kFloat).eq(16).all().item<bool>();
  } catch (const c10::Error&) {
    works = false;
  }
  std::lock_guard<std::mutex> lock(support.mutex);
  support.known[key] = works;
  return works;
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                     at::ScalarType out_dtype) {
  if (!is_float8(a.scalar_type()) || !is_float8(b.scalar_type()) || a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0))
    throw Error(fmt::format("fp8::scaled_mm: needs float8 matrices a [M, K] and b [K, N], got {} {} and {} {}",
                            c10::toString(a.scalar_type()), a.sizes(), c10::toString(b.scalar_type()), b.sizes()));
  const bool rowwise = a_scale.numel() > 1 || b_scale.numel() > 1;
  // CUDA's row-wise fp8 gemm writes bf16 only; an fp32 product of row-wise casts is computed dequantised.
  const bool writes = !(rowwise && a.is_cuda() && out_dtype != at::kBFloat16);
  if (writes && has_fp8_gemm(a.device(), rowwise)) return real_scaled_mm(a, b, a_scale, b_scale, out_dtype);
  return dequantised_mm(a, b, a_scale, b_scale, out_dtype);
}

}  // namespace xlr8::fp8
