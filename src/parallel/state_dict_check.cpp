#include "parallel/state_dict_check.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

namespace parallel {

void check_state_dict(const StateDict& expected, const StateDict& state) {
  std::map<std::string, at::Tensor> own(expected.begin(), expected.end());
  std::vector<std::string> problems, missing, unexpected;
  std::map<std::string, bool> seen;
  for (const auto& [name, tensor] : state) {
    auto it = own.find(name);
    seen[name] = true;
    if (it == own.end()) {
      unexpected.push_back(name);
      problems.push_back(fmt::format("unexpected {:?}", name));
    } else if (!it->second.sizes().equals(tensor.sizes()) || it->second.scalar_type() != tensor.scalar_type()) {
      problems.push_back(fmt::format("{:?} is {}{} in the model but {}{} in the state dict", name,
                                     c10::toString(it->second.scalar_type()), c10::str(it->second.sizes()),
                                     c10::toString(tensor.scalar_type()), c10::str(tensor.sizes())));
    }
  }
  for (const auto& [name, tensor] : own)
    if (!seen.count(name)) {
      missing.push_back(name);
      problems.push_back(fmt::format("missing {:?}", name));
    }
  if (problems.empty()) return;
  // Only what differs, at most ten entries, and the likely cause when names differ by a prefix.
  throw ConfigError(fmt::format("load_state_dict: the state dict does not match the model ({}{}); nothing was loaded",
                                text::capped(problems), text::prefix_hint(missing, unexpected)));
}

}  // namespace parallel

}  // namespace xlr8
