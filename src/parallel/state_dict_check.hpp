#pragma once
#include "xlr8/parallel_strategy.hpp"

namespace xlr8::parallel {

// ConfigError naming every missing, unexpected or differently shaped / typed entry of `state`
// against `expected` (only names, dtypes and shapes of `expected` are read).
void check_state_dict(const StateDict& expected, const StateDict& state);

}  // namespace xlr8::parallel
