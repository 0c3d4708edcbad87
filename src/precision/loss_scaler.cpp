#include "xlr8/loss_scaler.hpp"

#include <fmt/format.h>

#include <cmath>

#include "xlr8/error.hpp"

namespace xlr8 {

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options)
    : options_(options),
      scale_(options.static_scale > 0 ? options.static_scale : std::pow(2.0, options.initial_scale_power)),
      hysteresis_(options.hysteresis) {
  if (options.static_scale > 0) return;
  if (options.scale_window <= 0 || options.min_scale <= 0 || options.hysteresis < 1)
    throw ConfigError(fmt::format("fp16 dynamic loss scaling needs loss_scale_window > 0, min_loss_scale > 0 and "
                                  "hysteresis >= 1 (got {}, {}, {})",
                                  options.scale_window, options.min_scale, options.hysteresis));
}

void DynamicLossScaler::update(bool overflow) {
  if (options_.static_scale > 0) {
    iteration_ += 1;
    return;
  }
  if (overflow) {
    if (options_.hysteresis == 1 || hysteresis_ == 1) {
      if (scale_ == options_.min_scale && options_.raise_error_at_min_scale)
        throw Error(fmt::format("fp16 loss scale is already at its minimum ({}) and gradients still overflow: the model "
                                "diverged or needs bf16/fp32",
                                options_.min_scale));
      scale_ = std::max(scale_ / 2, options_.min_scale);
    } else {
      hysteresis_ -= 1;
    }
    last_overflow_iteration_ = iteration_;
  } else {
    if (options_.consecutive_hysteresis) hysteresis_ = options_.hysteresis;
    int64_t stable = iteration_ - last_overflow_iteration_ - 1;
    if (stable > 0 && stable % options_.scale_window == 0) {
      if (!options_.consecutive_hysteresis) hysteresis_ = options_.hysteresis;
      scale_ *= 2;
    }
  }
  iteration_ += 1;
}

nlohmann::json DynamicLossScaler::state() const {
  return {{"scale", scale_}, {"hysteresis", hysteresis_}, {"iteration", iteration_},
          {"last_overflow_iteration", last_overflow_iteration_}};
}

void DynamicLossScaler::load_state(const nlohmann::json& s) {
  scale_ = s.at("scale").get<double>();
  hysteresis_ = s.at("hysteresis").get<int>();
  iteration_ = s.at("iteration").get<int64_t>();
  last_overflow_iteration_ = s.at("last_overflow_iteration").get<int64_t>();
}

}  // namespace xlr8
