#pragma once
// Tensors, sizes, devices and dtypes in fmt and JSON, so that Accelerator::print and log() take them:
//   accelerator.print("loss {:.4f} on {} with input {}", loss, loss.device(), x.sizes());
//   accelerator.log({{"loss", loss}, {"per_class", accuracy}}, step);
// A one-element tensor of no dimensions prints as its number; others as PyTorch writes them,
// "tensor([[0.5, 1], [2, 3]], dtype=bfloat16)", summarised ("...") past 1000 elements. A format
// specification ("{:.3f}") applies to each floating-point element. In JSON a scalar tensor is a number
// and any other tensor nested arrays of numbers.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <string>

namespace xlr8 {

// PyTorch's name of a dtype: float32, bfloat16, int64 ...
std::string dtype_name(at::ScalarType type);
// The text the fmt formatter writes; `element_spec` is the format specification for floating elements.
std::string tensor_text(const at::Tensor& tensor, const std::string& element_spec = "");
nlohmann::json tensor_json(const at::Tensor& tensor);

}  // namespace xlr8

template <>
struct fmt::formatter<at::Tensor> {
  char spec[32] = {};  // the element format ("" or e.g. ".3f"), kept as characters for a constexpr parse
  constexpr auto parse(format_parse_context& ctx) {
    auto it = ctx.begin();
    size_t n = 0;
    for (; it != ctx.end() && *it != '}'; ++it) {
      if (n + 1 >= sizeof(spec)) throw format_error("tensor format specification too long");
      spec[n++] = *it;
    }
    return it;
  }
  template <class Context>
  auto format(const at::Tensor& tensor, Context& ctx) const {
    auto text = xlr8::tensor_text(tensor, spec);
    return std::copy(text.begin(), text.end(), ctx.out());
  }
};

template <>
struct fmt::formatter<c10::IntArrayRef> : fmt::formatter<std::string> {
  template <class Context>
  auto format(c10::IntArrayRef sizes, Context& ctx) const {
    return fmt::formatter<std::string>::format(fmt::format("[{}]", fmt::join(sizes.begin(), sizes.end(), ", ")), ctx);
  }
};

template <>
struct fmt::formatter<c10::Device> : fmt::formatter<std::string> {
  template <class Context>
  auto format(const c10::Device& device, Context& ctx) const {
    return fmt::formatter<std::string>::format(device.str(), ctx);
  }
};

template <>
struct fmt::formatter<c10::ScalarType> : fmt::formatter<std::string> {
  template <class Context>
  auto format(c10::ScalarType type, Context& ctx) const {
    return fmt::formatter<std::string>::format(xlr8::dtype_name(type), ctx);
  }
};

template <>
struct nlohmann::adl_serializer<at::Tensor> {
  static void to_json(nlohmann::json& j, const at::Tensor& tensor) { j = xlr8::tensor_json(tensor); }
};
