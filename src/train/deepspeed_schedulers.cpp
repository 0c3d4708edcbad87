// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, and building them from a config's section.
#include "xlr8/deepspeed_schedulers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deepspeed {
namespace {

void set_lrs(torch::optim::Optimizer& optimizer, const std::vector<double>& lrs) {
  auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

std::vector<double> current_lrs(torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

std::string checked_type(const std::string& type, const char* where) {
  if (type == "log" || type == "linear") return type;
  throw ConfigError(fmt::format("{}: warmup_type {:?} is not a warm-up; use log or linear", where, type));
}

// log(i + 1) / log(W), or i / W.
double warmup_fraction(int64_t iteration, int64_t steps, const std::string& type) {
  if (type == "linear") return static_cast<double>(iteration) / static_cast<double>(steps);
  return std::log(static_cast<double>(iteration + 1)) / std::log(static_cast<double>(steps));
}

}  // namespace

WarmupLR::WarmupLR(torch::optim::Optimizer& optimizer, WarmupOptions options)
    : LRScheduler(optimizer),
      warmup_num_steps_(std::max<int64_t>(2, options.warmup_num_steps)),
      warmup_type_(checked_type(options.warmup_type, "WarmupLR")) {
  if (options.warmup_num_steps <= 0)
    throw ConfigError(fmt::format("WarmupLR: warmup_num_steps must be a positive integer, got {}", options.warmup_num_steps));
  // Without warmup_max_lr, DeepSpeed takes the first group's lr for every group.
  const auto initial = current_lrs(optimizer);
  const double max_lr = options.warmup_max_lr.value_or(initial.empty() ? 0.0 : initial.front());
  min_lrs_.assign(initial.size(), options.warmup_min_lr);
  delta_lrs_.assign(initial.size(), max_lr - options.warmup_min_lr);
  set_lrs(optimizer, min_lrs_);  // DeepSpeed starts every group at warmup_min_lr
}

double WarmupLR::warmup_gamma(int64_t iteration) const {
  return warmup_fraction(iteration, warmup_num_steps_, warmup_type_);
}

double WarmupLR::gamma(int64_t iteration) const {
  return iteration < warmup_num_steps_ ? warmup_gamma(iteration) : 1.0;
}

// LibTorch's step() asks for the rates before counting the step: step_count_ is the iteration.
std::vector<double> WarmupLR::get_lrs() {
  const double g = gamma(static_cast<int64_t>(step_count_));
  std::vector<double> lrs;
  for (size_t i = 0; i < min_lrs_.size(); ++i) lrs.push_back(min_lrs_[i] + delta_lrs_[i] * g);
  return lrs;
}

WarmupDecayLR::WarmupDecayLR(torch::optim::Optimizer& optimizer, int64_t total_num_steps, WarmupOptions options)
    : WarmupLR(optimizer, [&] {
        if (!options.warmup_max_lr) options.warmup_max_lr = 0.001;  // DeepSpeed's default here, not the optimizer's
        return options;
      }()),
      total_num_steps_(total_num_steps) {}

double WarmupDecayLR::gamma(int64_t iteration) const {
  if (iteration < warmup_num_steps_) return warmup_gamma(iteration);
  return std::max(0.0, static_cast<double>(total_num_steps_ - iteration) /
                           std::max(1.0, static_cast<double>(total_num_steps_ - warmup_num_steps_)));
}

WarmupCosineLR::WarmupCosineLR(torch::optim::Optimizer& optimizer, int64_t total_num_steps, double warmup_min_ratio,
                               int64_t warmup_num_steps, double cos_min_ratio, std::string warmup_type)
    : LRScheduler(optimizer),
      total_num_steps_(total_num_steps),
      warmup_num_steps_(std::max<int64_t>(2, warmup_num_steps)),
      warmup_min_ratio_(warmup_min_ratio),
      cos_min_ratio_(cos_min_ratio),
      warmup_type_(checked_type(warmup_type, "WarmupCosineLR")),
      initial_lrs_(current_lrs(optimizer)) {
  if (warmup_num_steps <= 0)
    throw ConfigError(fmt::format("WarmupCosineLR: warmup_num_steps must be a positive integer, got {}", warmup_num_steps));
  set_lrs(optimizer, std::vector<double>(initial_lrs_.size(), 0.0));  // DeepSpeed's rate before the first step
}

double WarmupCosineLR::ratio(int64_t iteration) const {
  if (iteration < warmup_num_steps_)
    return warmup_min_ratio_ + warmup_fraction(iteration, warmup_num_steps_, warmup_type_) * (1.0 - warmup_min_ratio_);
  const double progress = std::min(1.0, static_cast<double>(iteration - warmup_num_steps_ + 1) /
                                            static_cast<double>(std::max<int64_t>(1, total_num_steps_ - warmup_num_steps_)));
  const double cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
  return std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * cosine);
}

std::vector<double> WarmupCosineLR::get_lrs() {
  const double r = ratio(static_cast<int64_t>(step_count_));
  std::vector<double> lrs;
  for (double lr : initial_lrs_) lrs.push_back(lr * r);
  return lrs;
}

std::shared_ptr<torch::optim::LRScheduler> make_scheduler(const TypedSection& section, torch::optim::Optimizer& optimizer) {
  const auto& p = section.params;
  auto number = [&](const char* key, double fallback) {
    if (!p.contains(key)) return fallback;
    if (!p.at(key).is_number())
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a number", key, p.at(key).dump()));
    return p.at(key).get<double>();
  };
  auto whole = [&](const char* key, int64_t fallback) {
    const double v = number(key, static_cast<double>(fallback));
    if (std::floor(v) != v)
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a whole number", key, v));
    return static_cast<int64_t>(v);
  };
  auto check = [&](const std::vector<std::string>& known) {
    check_section_params(section, "scheduler", known);
    if (whole("last_batch_iteration", -1) != -1)
      throw ConfigError("DeepSpeed config: scheduler.params.last_batch_iteration other than -1 is not implemented; "
                        "resume with load_state instead");
  };
  auto total = [&] {
    if (!p.contains("total_num_steps"))
      throw ConfigError(fmt::format("DeepSpeed config: scheduler {} needs params.total_num_steps", section.type));
    return whole("total_num_steps", 0);
  };
  auto warmup = [&] {
    WarmupOptions o;
    o.warmup_min_lr = number("warmup_min_lr", 0.0);
    if (p.contains("warmup_max_lr")) o.warmup_max_lr = number("warmup_max_lr", 0.0);
    o.warmup_num_steps = whole("warmup_num_steps", 1000);
    if (p.contains("warmup_type")) o.warmup_type = p.at("warmup_type").get<std::string>();
    return o;
  };
  const std::vector<std::string> warmup_keys = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                                "last_batch_iteration"};
  if (section.type == "WarmupLR") {
    check(warmup_keys);
    return std::make_shared<WarmupLR>(optimizer, warmup());
  }
  if (section.type == "WarmupDecayLR") {
    auto keys = warmup_keys;
    keys.push_back("total_num_steps");
    check(keys);
    return std::make_shared<WarmupDecayLR>(optimizer, total(), warmup());
  }
  if (section.type == "WarmupCosineLR") {
    check({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
           "last_batch_iteration"});
    return std::make_shared<WarmupCosineLR>(optimizer, total(), number("warmup_min_ratio", 0.0),
                                            whole("warmup_num_steps", 1000), number("cos_min_ratio", 0.0001),
                                            p.value("warmup_type", std::string("log")));
  }
  if (section.type == "OneCycle" || section.type == "LRRangeTest")
    throw ConfigError(fmt::format("DeepSpeed config: scheduler.type {:?} is not built by xlr8 yet; use WarmupLR, "
                                  "WarmupDecayLR or WarmupCosineLR, or pass a torch::optim::LRScheduler to initialize()",
                                  section.type));
  throw ConfigError(fmt::format("DeepSpeed config: scheduler.type {:?} is not a DeepSpeed scheduler{}; use WarmupLR, "
                                "WarmupDecayLR or WarmupCosineLR",
                                section.type,
                                text::suggestion(section.type, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"})));
}

}  // namespace xlr8::deepspeed
