// DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest, and building them from a
// config's section.
#include "xlr8/deepspeed_schedulers.hpp"

#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/log.hpp"
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

// DeepSpeed warns about another warm-up type and warms up logarithmically.
std::string checked_type(const std::string& type, const char* where) {
  if (type == "log" || type == "linear") return type;
  log::warning("{}: unknown warmup_type {:?}: warming up with log (the types are log and linear)", where, type);
  return "log";
}

// As DeepSpeed, which still trains: the decay starts where the warm-up ends.
void warn_if_total_within_warmup(int64_t total, int64_t warmup, const char* where) {
  if (total < warmup)
    log::warning("{}: total_num_steps {} is less than warmup_num_steps {}: there is no decay", where, total, warmup);
}

// log(i + 1) / log(W), or i / W.
double warmup_fraction(int64_t iteration, int64_t steps, const std::string& type) {
  if (type == "linear") return static_cast<double>(iteration) / static_cast<double>(steps);
  return std::log(static_cast<double>(iteration + 1)) / std::log(static_cast<double>(steps));
}

}  // namespace

std::vector<double> PerGroup::for_groups(size_t groups, const std::string& key) const {
  if (!listed_) return std::vector<double>(groups, values_.front());
  if (values_.size() != groups)
    throw ConfigError(fmt::format("DeepSpeed scheduler: scheduler.params.{} lists {} values but the optimizer has {} "
                                  "parameter groups: give one value for all, or one per group",
                                  key, values_.size(), groups));
  return values_;
}

WarmupLR::WarmupLR(torch::optim::Optimizer& optimizer, WarmupOptions options)
    : LRScheduler(optimizer),
      warmup_num_steps_(std::max<int64_t>(2, options.warmup_num_steps)),
      warmup_type_(checked_type(options.warmup_type, "WarmupLR")) {
  if (options.warmup_num_steps <= 0)
    throw ConfigError(fmt::format("WarmupLR: warmup_num_steps must be a positive integer, got {}", options.warmup_num_steps));
  // Without warmup_max_lr, each group warms up to its own lr (DeepSpeed 0.19.4 on).
  const auto initial = current_lrs(optimizer);
  min_lrs_ = options.warmup_min_lr.for_groups(initial.size(), "warmup_min_lr");
  const auto max_lrs = options.warmup_max_lr ? options.warmup_max_lr->for_groups(initial.size(), "warmup_max_lr") : initial;
  for (size_t i = 0; i < initial.size(); ++i) delta_lrs_.push_back(max_lrs[i] - min_lrs_[i]);
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
      total_num_steps_(total_num_steps) {
  warn_if_total_within_warmup(total_num_steps_, warmup_num_steps_, "WarmupDecayLR");
}

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
  warn_if_total_within_warmup(total_num_steps_, warmup_num_steps_, "WarmupCosineLR");
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

// ------------------------------------------------------------------------------------------ OneCycle

namespace {
// The group's Adam betas, or null for optimizers without them ("betas" not in DeepSpeed's defaults).
std::tuple<double, double>* betas_of(torch::optim::OptimizerOptions& options) {
  if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) return &adamw->betas();
  if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) return &adam->betas();
  return nullptr;
}
}  // namespace

OneCycle::OneCycle(torch::optim::Optimizer& optimizer, OneCycleOptions options)
    : LRScheduler(optimizer), optimizer_(optimizer), o_(options) {
  const size_t groups = optimizer.param_groups().size();
  min_lrs_ = o_.cycle_min_lr.for_groups(groups, "cycle_min_lr");
  max_lrs_ = o_.cycle_max_lr.for_groups(groups, "cycle_max_lr");
  first_ = static_cast<double>(o_.cycle_first_step_size);
  second_ = o_.cycle_second_step_size ? static_cast<double>(*o_.cycle_second_step_size) : first_;
  if (first_ <= 0) throw ConfigError(fmt::format("OneCycle: cycle_first_step_size must be positive, got {}", first_));
  if (second_ < 0) throw ConfigError(fmt::format("OneCycle: cycle_second_step_size must be non-negative, got {}", second_));
  total_ = first_ + second_;
  ratio_ = first_ / total_;
  first_stairs_ = o_.cycle_first_stair_count;
  second_stairs_ = o_.cycle_second_stair_count.value_or(first_stairs_);
  set_lrs(optimizer, min_lrs_);
  cycle_momentum_ = o_.cycle_momentum;
  for (auto& group : optimizer.param_groups())
    if (cycle_momentum_ && !betas_of(group.options())) {
      cycle_momentum_ = false;
      log::warning("xlr8: OneCycle: cycle_momentum is disabled: the optimizer has no betas");
    }
  // As DeepSpeed, the momenta (and their lists' lengths) count only when they cycle.
  min_moms_.assign(groups, 0.0);
  max_moms_.assign(groups, 0.0);
  if (cycle_momentum_) {
    min_moms_ = o_.cycle_min_mom.for_groups(groups, "cycle_min_mom");
    max_moms_ = o_.cycle_max_mom.for_groups(groups, "cycle_max_mom");
    set_beta1(min_moms_);
  }
}

void OneCycle::set_beta1(const std::vector<double>& beta1) {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) *betas_of(groups[i].options()) = {beta1[i], 0.99};
}

double OneCycle::scale_factor(int64_t iteration) const {
  const double batch = static_cast<double>(iteration + 1);
  const double cycle = std::floor(1 + batch / total_);
  const double x = 1.0 + batch / total_ - cycle;
  double factor = x <= ratio_ ? x / ratio_ : (x - 1) / (ratio_ - 1);
  const int64_t stairs = x <= ratio_ ? first_stairs_ : second_stairs_;
  if (stairs > 0) {
    const double within = std::fmod(batch, total_);
    const double position = within <= first_ ? within * static_cast<double>(stairs) / first_
                                              : (total_ - within) * static_cast<double>(stairs) / second_;
    factor = std::floor(position) / static_cast<double>(stairs);
  }
  return factor;
}

std::vector<double> OneCycle::get_lrs() {
  const auto iteration = static_cast<int64_t>(step_count_);
  std::vector<double> lrs = min_lrs_, beta1 = max_moms_;
  if (static_cast<double>(iteration) < total_) {
    const double f = scale_factor(iteration);
    for (size_t i = 0; i < lrs.size(); ++i) {
      lrs[i] = min_lrs_[i] + (max_lrs_[i] - min_lrs_[i]) * f;
      beta1[i] = max_moms_[i] - (max_moms_[i] - min_moms_[i]) * f;
    }
  } else if (o_.decay_step_size != 0) {
    const double interval = (static_cast<double>(iteration) - total_ + 1) / static_cast<double>(o_.decay_step_size);
    for (size_t i = 0; i < lrs.size(); ++i) {
      if (o_.decay_lr_rate != 0) lrs[i] = min_lrs_[i] / (1 + o_.decay_lr_rate * interval);
      if (o_.decay_mom_rate != 0) beta1[i] = max_moms_[i] * (1 + o_.decay_mom_rate * interval);
    }
  }
  if (cycle_momentum_) set_beta1(beta1);
  return lrs;
}

LRRangeTest::LRRangeTest(torch::optim::Optimizer& optimizer, const PerGroup& min_lr, int64_t step_size,
                         double step_rate, bool staircase)
    : LRScheduler(optimizer),
      min_lrs_(min_lr.for_groups(optimizer.param_groups().size(), "lr_range_test_min_lr")),
      step_rate_(step_rate),
      step_size_(step_size),
      staircase_(staircase) {
  if (step_size <= 0)
    throw ConfigError(fmt::format("LRRangeTest: lr_range_test_step_size must be a positive integer, got {}", step_size));
  set_lrs(optimizer, min_lrs_);
}

std::vector<double> LRRangeTest::get_lrs() {
  double interval = static_cast<double>(step_count_ + 1) / static_cast<double>(step_size_);
  if (staircase_) interval = std::floor(interval);
  std::vector<double> lrs;
  for (double lr : min_lrs_) lrs.push_back(lr * (1 + step_rate_ * interval));
  return lrs;
}

// ------------------------------------------------------------------------------------------ from a config

namespace {

// A scheduler section's params, read with DeepSpeed's types: numbers, whole numbers where it counts steps.
struct SchedulerParams {
  const nlohmann::json& p;
  double number(const char* key, double fallback) const {
    if (!p.contains(key)) return fallback;
    if (!p.at(key).is_number())
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a number", key, p.at(key).dump()));
    return p.at(key).get<double>();
  }
  // A number, or DeepSpeed's list of one number per parameter group.
  PerGroup per_group(const char* key, double fallback) const {
    if (p.contains(key) && !p.at(key).is_array() && !p.at(key).is_number())
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a number or a list of numbers "
                                    "(one per parameter group)",
                                    key, p.at(key).dump()));
    if (!p.contains(key) || !p.at(key).is_array()) return number(key, fallback);
    std::vector<double> values;
    for (const auto& v : p.at(key)) {
      if (!v.is_number())
        throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a number or a list of numbers "
                                      "(one per parameter group)",
                                      key, p.at(key).dump()));
      values.push_back(v.get<double>());
    }
    if (values.empty())
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} is an empty list: give one number per "
                                    "parameter group, or one number for all",
                                    key));
    return values;
  }
  int64_t whole(const char* key, int64_t fallback) const {
    const double v = number(key, static_cast<double>(fallback));
    if (std::floor(v) != v)
      throw ConfigError(fmt::format("DeepSpeed config: scheduler.params.{} = {} must be a whole number", key, v));
    return static_cast<int64_t>(v);
  }
};

OneCycleOptions one_cycle_options(const SchedulerParams& r) {
  const auto& p = r.p;
  for (const char* required : {"cycle_min_lr", "cycle_max_lr"})
    if (!p.contains(required)) throw ConfigError(fmt::format("DeepSpeed config: scheduler OneCycle needs params.{}", required));
  OneCycleOptions o;
  o.cycle_min_lr = r.per_group("cycle_min_lr", 0.0);
  o.cycle_max_lr = r.per_group("cycle_max_lr", 0.0);
  o.decay_lr_rate = r.number("decay_lr_rate", 0.0);
  o.cycle_first_step_size = r.whole("cycle_first_step_size", 2000);
  if (p.contains("cycle_second_step_size") && !p.at("cycle_second_step_size").is_null())
    o.cycle_second_step_size = r.whole("cycle_second_step_size", 0);
  o.cycle_first_stair_count = r.whole("cycle_first_stair_count", 0);
  if (p.contains("cycle_second_stair_count") && !p.at("cycle_second_stair_count").is_null())
    o.cycle_second_stair_count = r.whole("cycle_second_stair_count", 0);
  o.decay_step_size = r.whole("decay_step_size", 0);
  o.cycle_momentum = p.value("cycle_momentum", true);
  o.cycle_min_mom = r.per_group("cycle_min_mom", 0.8);
  o.cycle_max_mom = r.per_group("cycle_max_mom", 0.9);
  o.decay_mom_rate = r.number("decay_mom_rate", 0.0);
  return o;
}

}  // namespace

std::shared_ptr<torch::optim::LRScheduler> make_scheduler(const TypedSection& section, torch::optim::Optimizer& optimizer) {
  const auto& p = section.params;
  const SchedulerParams reader{p};
  auto number = [&](const char* key, double fallback) { return reader.number(key, fallback); };
  auto whole = [&](const char* key, int64_t fallback) { return reader.whole(key, fallback); };
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
  auto warmup_type = [&] {  // DeepSpeed warms up with log when the type is not one it knows
    return p.contains("warmup_type") && p.at("warmup_type").is_string() ? p.at("warmup_type").get<std::string>()
                                                                         : std::string(p.contains("warmup_type") ? p.at("warmup_type").dump() : "log");
  };
  auto warmup = [&] {
    WarmupOptions o;
    o.warmup_min_lr = reader.per_group("warmup_min_lr", 0.0);
    // null: each group's own lr, as when absent
    if (p.contains("warmup_max_lr") && !p.at("warmup_max_lr").is_null())
      o.warmup_max_lr = reader.per_group("warmup_max_lr", 0.0);
    o.warmup_num_steps = whole("warmup_num_steps", 1000);
    o.warmup_type = warmup_type();
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
                                            warmup_type());
  }
  if (section.type == "OneCycle") {
    check({"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
           "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",
           "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"});
    return std::make_shared<OneCycle>(optimizer, one_cycle_options(reader));
  }
  if (section.type == "LRRangeTest") {
    check({"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase",
           "last_batch_iteration"});
    return std::make_shared<LRRangeTest>(optimizer, reader.per_group("lr_range_test_min_lr", 1e-3),
                                         whole("lr_range_test_step_size", 2000), number("lr_range_test_step_rate", 1.0),
                                         p.value("lr_range_test_staircase", false));
  }
  throw ConfigError(fmt::format("DeepSpeed config: scheduler.type {:?} is not a DeepSpeed scheduler{}; use WarmupLR, "
                                "WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest",
                                section.type,
                                text::suggestion(section.type, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                                                "LRRangeTest"})));
}

}  // namespace xlr8::deepspeed
