#include "parallel/state_dict_check.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

namespace detail {

void check_state_dict(const StateDict& expected, const StateDict& state) {
  std::map<std::string, at::Tensor> own(expected.begin(), expected.end());
  std::vector<std::string> missing, mismatched, unexpected;
  std::map<std::string, bool> seen;
  for (const auto& [name, tensor] : state) {
    auto it = own.find(name);
    seen[name] = true;
    if (it == own.end()) unexpected.push_back(name);
    else if (!it->second.sizes().equals(tensor.sizes()) || it->second.scalar_type() != tensor.scalar_type())
      mismatched.push_back(fmt::format("{} ({}{} in the state dict, {}{} in the model)", name,
                                       c10::toString(tensor.scalar_type()), c10::str(tensor.sizes()),
                                       c10::toString(it->second.scalar_type()), c10::str(it->second.sizes())));
  }
  for (const auto& [name, tensor] : own)
    if (!seen.count(name)) missing.push_back(name);
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty())
    throw ConfigError(fmt::format("load_state_dict: the state dict does not match the model: missing {}, mismatched "
                                  "{}, unexpected {}{}; nothing was loaded",
                                  text::listing(missing), text::listing(mismatched), text::listing(unexpected),
                                  text::prefix_hint(missing, unexpected)));
}

}  // namespace detail

}  // namespace xlr8
