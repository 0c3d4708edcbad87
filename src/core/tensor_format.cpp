// Tensors as text (fmt, error messages) and as JSON (trackers).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/tensor_text.hpp"
#include "xlr8/format.hpp"

namespace xlr8 {

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
  }
}

namespace {

constexpr int64_t kSummaryThreshold = 1000;  // PyTorch's print threshold
constexpr int64_t kEdgeItems = 3;

std::string element_text(const at::Tensor& scalar, const std::string& spec) {
  if (scalar.scalar_type() == at::kBool) return scalar.item<bool>() ? "true" : "false";
  if (at::isFloatingType(scalar.scalar_type())) {
    double v = scalar.item<double>();
    return spec.empty() ? fmt::format("{:.6g}", v) : fmt::format(fmt::runtime("{" + spec + "}"), v);
  }
  if (at::isComplexType(scalar.scalar_type())) {
    auto v = scalar.item<c10::complex<double>>();
    return fmt::format("{}{:+}j", element_text(at::scalar_tensor(v.real()), spec), v.imag());
  }
  return std::to_string(scalar.item<int64_t>());
}

void append_values(std::string& out, const at::Tensor& t, bool summarise, const std::string& spec) {
  if (t.dim() == 0) {
    out += element_text(t, spec);
    return;
  }
  out += '[';
  const int64_t n = t.size(0);
  const bool elide = summarise && n > 2 * kEdgeItems;
  for (int64_t i = 0; i < n; ++i) {
    if (elide && i == kEdgeItems) {
      out += "..., ";
      i = n - kEdgeItems;
    }
    append_values(out, t.select(0, i), summarise, spec);
    if (i + 1 < n) out += ", ";
  }
  out += ']';
}

}  // namespace

std::string tensor_text(const at::Tensor& tensor, const std::string& element_spec) {
  if (!tensor.defined()) return "tensor(undefined)";
  // The spec arrives as ":.3f" from the formatter (or empty).
  std::string spec = element_spec.empty() || element_spec.front() == ':' ? element_spec : ":" + element_spec;
  auto values = tensor.detach().to(at::kCPU);
  if (values.dim() == 0) return element_text(values, spec);
  std::string out = "tensor(";
  append_values(out, values, values.numel() > kSummaryThreshold, spec);
  const auto type = values.scalar_type();
  if (type != at::kFloat && type != at::kLong && type != at::kBool) out += ", dtype=" + dtype_name(type);
  if (!tensor.device().is_cpu()) out += ", device=" + tensor.device().str();
  return out + ")";
}

nlohmann::json tensor_json(const at::Tensor& tensor) {
  if (!tensor.defined()) return nullptr;
  auto values = tensor.detach().to(at::kCPU);
  if (values.dim() == 0) {
    if (values.scalar_type() == at::kBool) return values.item<bool>();
    if (at::isFloatingType(values.scalar_type())) return values.item<double>();
    if (at::isComplexType(values.scalar_type())) {
      auto v = values.item<c10::complex<double>>();
      return nlohmann::json::array({v.real(), v.imag()});
    }
    return values.item<int64_t>();
  }
  auto array = nlohmann::json::array();
  for (int64_t i = 0; i < values.size(0); ++i) array.push_back(tensor_json(values.select(0, i)));
  return array;
}

namespace core {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("{}{}", dtype_name(t.scalar_type()), t.sizes());
}

}  // namespace core
}  // namespace xlr8
