// Pipeline schedules as lists of actions, and the cut of a sequence of layers into stages (xlr8/pipeline.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8::pp {

std::string to_string(Schedule schedule) { return schedule == Schedule::GPipe ? "GPipe" : "1F1B"; }

Schedule parse_schedule(const std::string& name) {
  const auto lower = text::lower(name);
  if (lower == "gpipe") return Schedule::GPipe;
  if (lower == "1f1b") return Schedule::OneFOneB;
  throw ConfigError(fmt::format("pipeline schedule {:?} is not one xlr8 has; use GPipe or 1F1B", name));
}

std::vector<Action> actions(Schedule schedule, int stages, int micro_batches, int stage) {
  if (stages < 1 || micro_batches < 1 || stage < 0 || stage >= stages)
    throw Error(fmt::format("pipeline: stage {} of {} stages with {} micro-batches does not exist", stage, stages,
                            micro_batches));
  std::vector<Action> out;
  const int m = micro_batches;
  if (schedule == Schedule::GPipe) {
    for (int k = 0; k < m; ++k) out.push_back({Action::Forward, k});
    for (int k = 0; k < m; ++k) out.push_back({Action::Backward, k});
    return out;
  }
  // 1F1B: the later a stage, the sooner its first backward can start.
  const int warmup = std::min(stages - 1 - stage, m);
  for (int k = 0; k < warmup; ++k) out.push_back({Action::Forward, k});
  for (int k = 0; k < m - warmup; ++k) {
    out.push_back({Action::Forward, warmup + k});
    out.push_back({Action::Backward, k});
  }
  for (int k = m - warmup; k < m; ++k) out.push_back({Action::Backward, k});
  return out;
}

double bubble_fraction(Schedule, int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

std::vector<std::pair<size_t, size_t>> partition(const std::vector<int64_t>& layer_parameters, int stages,
                                                 Partition how) {
  const size_t layers = layer_parameters.size();
  if (stages < 1 || static_cast<size_t>(stages) > layers)
    throw ConfigError(fmt::format("pipeline: {} stages for a model of {} layers; every stage needs a layer, so use at "
                                  "most {} stages",
                                  stages, layers, layers));
  std::vector<std::pair<size_t, size_t>> out;
  if (how == Partition::Uniform) {  // the first layers % stages stages take one more
    size_t begin = 0;
    for (int s = 0; s < stages; ++s) {
      const size_t count = layers / stages + (static_cast<size_t>(s) < layers % stages ? 1 : 0);
      out.emplace_back(begin, begin + count);
      begin += count;
    }
    return out;
  }
  // By parameters: each boundary where the running total first reaches s/stages of the whole, keeping at least
  // one layer for each stage after it.
  std::vector<double> running(layers + 1, 0);
  for (size_t i = 0; i < layers; ++i)
    running[i + 1] = running[i] + static_cast<double>(std::max<int64_t>(layer_parameters[i], 1));
  size_t begin = 0;
  for (int s = 0; s < stages; ++s) {
    // The latest end that leaves a layer for each later stage.
    size_t end = layers - static_cast<size_t>(stages - 1 - s);
    if (s + 1 < stages) {
      const double target = running[layers] * (s + 1) / stages;
      size_t cut = begin + 1;
      while (cut < end && running[cut] + 0.5 * (running[cut + 1] - running[cut]) < target) ++cut;
      end = cut;
    }
    out.emplace_back(begin, end);
    begin = end;
  }
  return out;
}

torch::nn::Sequential stage_of(const torch::nn::Sequential& whole, int stages, int stage, Partition how) {
  std::vector<int64_t> counts;
  for (const auto& layer : whole->children()) {
    int64_t n = 0;
    for (const auto& p : layer->parameters()) n += p.numel();
    counts.push_back(n);
  }
  const auto cuts = partition(counts, stages, how);
  if (stage < 0 || stage >= stages) throw Error(fmt::format("pipeline: stage {} of {} does not exist", stage, stages));
  // The same modules under the whole model's names ("3.weight" stays "3.weight"), as the type-erased layers the
  // Sequential holds.
  torch::nn::Sequential out;
  const auto named = whole->named_children();
  size_t i = 0;
  for (const auto& layer : *whole) {
    if (i >= cuts[stage].first && i < cuts[stage].second) out->push_back(named[i].key(), layer);
    ++i;
  }
  return out;
}

}  // namespace xlr8::pp
