// Pipeline schedules as lists of actions, and the cut of a sequence of layers into stages (xlr8/pipeline.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8::pp {

std::string to_string(Schedule schedule) {
  switch (schedule) {
    case Schedule::GPipe: return "GPipe";
    case Schedule::OneFOneB: return "1F1B";
    case Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case Schedule::InterleavedZeroBubble: return "InterleavedZeroBubble";
  }
  return "?";
}

Schedule parse_schedule(const std::string& name) {
  const auto lower = text::lower(name);
  if (lower == "gpipe") return Schedule::GPipe;
  if (lower == "1f1b") return Schedule::OneFOneB;
  if (lower == "interleaved1f1b") return Schedule::Interleaved1F1B;
  if (lower == "interleavedzerobubble") return Schedule::InterleavedZeroBubble;
  throw ConfigError(fmt::format("pipeline schedule {:?} is not one xlr8 has; use GPipe, 1F1B, Interleaved1F1B or "
                                "InterleavedZeroBubble",
                                name));
}

namespace {

// Megatron's interleaved 1F1B: the rank's forwards (and backwards) visit its chunks in turn, `stages` micro-batches
// at a time; it fills the pipe with more forwards the earlier the rank, then alternates one forward and one backward.
std::vector<Action> interleaved(int stages, int micro_batches, int stage, int chunks, Schedule schedule) {
  if (micro_batches % stages != 0)
    throw ConfigError(fmt::format("pipeline schedule {}: {} micro-batches are not a multiple of the {} "
                                  "stages (the micro-batches pass each rank's virtual stages in groups of the stage "
                                  "count); use a multiple",
                                  to_string(schedule), micro_batches, stages));
  const int total = micro_batches * chunks, group = stages * chunks;
  auto action = [&](Action::Kind kind, int i) {
    const int chunk = (i % group) / stages;
    return Action{kind, (i / group) * stages + i % stages, kind == Action::Forward ? chunk : chunks - 1 - chunk};
  };
  const int warmup = micro_batches == stages ? total : std::min((stages - stage - 1) * 2 + (chunks - 1) * stages, total);
  std::vector<Action> out;
  for (int i = 0; i < warmup; ++i) out.push_back(action(Action::Forward, i));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(action(Action::Forward, warmup + i));
    out.push_back(action(Action::Backward, i));
  }
  for (int i = total - warmup; i < total; ++i) out.push_back(action(Action::Backward, i));
  return out;
}

std::vector<Action> one_f_one_b(int stages, int micro_batches, int stage) {
  // The later a stage, the sooner its first backward can start.
  std::vector<Action> out;
  const int m = micro_batches, warmup = std::min(stages - 1 - stage, m);
  for (int k = 0; k < warmup; ++k) out.push_back({Action::Forward, k});
  for (int k = 0; k < m - warmup; ++k) {
    out.push_back({Action::Forward, warmup + k});
    out.push_back({Action::Backward, k});
  }
  for (int k = m - warmup; k < m; ++k) out.push_back({Action::Backward, k});
  return out;
}

// Each backward's weights `lag` backwards later, the rest at the end.
std::vector<Action> with_deferred_weights(const std::vector<Action>& order, int lag) {
  std::vector<Action> out, waiting;
  for (const auto& action : order) {
    out.push_back(action);
    if (action.kind != Action::Backward) continue;
    waiting.push_back({Action::Weight, action.micro_batch, action.chunk});
    if (static_cast<int>(waiting.size()) > lag) {
      out.push_back(waiting.front());
      waiting.erase(waiting.begin());
    }
  }
  out.insert(out.end(), waiting.begin(), waiting.end());
  return out;
}

}  // namespace

std::vector<Action> actions(Schedule schedule, int stages, int micro_batches, int stage, int chunks) {
  if (stages < 1 || micro_batches < 1 || stage < 0 || stage >= stages || chunks < 1)
    throw Error(fmt::format("pipeline: stage {} of {} stages ({} chunks each) with {} micro-batches does not exist",
                            stage, stages, chunks, micro_batches));
  if (schedule != Schedule::InterleavedZeroBubble && (chunks > 1) != (schedule == Schedule::Interleaved1F1B))
    throw ConfigError(fmt::format("pipeline schedule {} with {} virtual stages a rank: Interleaved1F1B runs 2 or more "
                                  "(parallelism_config_pp_virtual_stages), InterleavedZeroBubble 1 or more, the "
                                  "others 1",
                                  to_string(schedule), chunks));
  if (schedule == Schedule::InterleavedZeroBubble) {
    const auto order = chunks > 1 ? interleaved(stages, micro_batches, stage, chunks, schedule)
                                  : one_f_one_b(stages, micro_batches, stage);
    return with_deferred_weights(order, stage);
  }
  if (schedule == Schedule::Interleaved1F1B) return interleaved(stages, micro_batches, stage, chunks, schedule);
  if (schedule == Schedule::OneFOneB) return one_f_one_b(stages, micro_batches, stage);
  std::vector<Action> out;
  for (int k = 0; k < micro_batches; ++k) out.push_back({Action::Forward, k});
  for (int k = 0; k < micro_batches; ++k) out.push_back({Action::Backward, k});
  return out;
}

double bubble_fraction(Schedule schedule, int stages, int micro_batches, int chunks) {
  // Idle (p - 1) / v of the m stage-times each rank computes (Megatron's interleaving divides the ramp by v); the
  // zero-bubble placement leaves one part's time of each of the p - 1 ramp steps where 1F1B leaves three.
  const int parts = schedule == Schedule::InterleavedZeroBubble ? 3 : 1;
  return static_cast<double>(stages - 1) / static_cast<double>(parts * chunks * micro_batches + stages - 1);
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

std::vector<std::pair<size_t, size_t>> parts_of(const torch::nn::Sequential& whole, int stages, int chunks,
                                                Partition how) {
  const size_t layers = whole->size(), parts = static_cast<size_t>(stages * chunks);
  const auto* partitioned = dynamic_cast<const PartitionedSequentialImpl*>(whole.get());
  if (!partitioned || partitioned->part_starts.empty()) {
    std::vector<int64_t> counts;
    for (const auto& layer : whole->children()) {
      int64_t n = 0;
      for (const auto& p : layer->parameters()) n += p.numel();
      counts.push_back(n);
    }
    if (chunks > 1 && parts > layers)  // partition() would speak of N x V stages, not the pp size given
      throw ConfigError(fmt::format("pipeline: {} stages x {} chunks a stage (parallelism_config_pp_virtual_stages) "
                                    "cut the model into {} parts, but it has {} layers; every part needs a layer, so "
                                    "use fewer virtual stages (1 runs a non-interleaved schedule) or fewer stages",
                                    stages, chunks, parts, layers));
    return partition(counts, static_cast<int>(parts), how);
  }
  const auto& starts = partitioned->part_starts;
  if (chunks > 1 && starts.size() == static_cast<size_t>(stages))
    throw ConfigError(fmt::format("pipeline: an interleaved schedule runs {} chunks a stage, {} parts in all, but the model's "
                                  "part starts cut it into {} parts, one a stage (as a deepspeed::PipelineModule always "
                                  "does: it builds only its stage's layers): set parallelism_config_pp_virtual_stages 1 (one chunk a "
                                  "stage; InterleavedZeroBubble runs so too) or choose GPipe or 1F1B "
                                  "(parallelism_config_pp_schedule), or give a whole Sequential or a PartitionedSequential "
                                  "with {} part starts",
                                  chunks, parts, stages, parts));
  const bool ascending = std::adjacent_find(starts.begin(), starts.end(), std::greater_equal<>()) == starts.end();
  if (starts.size() != parts || starts.front() != 0 || !ascending || starts.back() >= layers)
    throw ConfigError(fmt::format("pipeline: the model's part starts [{}] do not cut its {} layers into {} parts "
                                  "({} stages x {} chunks): give one start a part, 0 first, ascending, each below {}",
                                  fmt::join(starts, ", "), layers, parts, stages, chunks, layers));
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t p = 0; p < parts; ++p) out.emplace_back(starts[p], p + 1 < parts ? starts[p + 1] : layers);
  return out;
}

StageLayers stage_layers(const torch::nn::Sequential& whole, int stages, int stage, int chunks, Partition how) {
  if (stage < 0 || stage >= stages || chunks < 1)
    throw Error(fmt::format("pipeline: stage {} of {} ({} chunks each) does not exist", stage, stages, chunks));
  // Virtual stage c * stages + stage is this rank's chunk c.
  const auto cuts = parts_of(whole, stages, chunks, how);
  // The same modules under the whole model's names ("3.weight" stays "3.weight"), as the type-erased layers the
  // Sequential holds.
  StageLayers out;
  out.parts = cuts;
  const auto named = whole->named_children();
  for (int c = 0; c < chunks; ++c) {
    const auto [begin, end] = cuts[static_cast<size_t>(c * stages + stage)];
    for (size_t i = begin; i < end; ++i) out.layers->push_back(named[i].key(), *(whole->begin() + static_cast<long>(i)));
    out.chunk_sizes.push_back(end - begin);
  }
  return out;
}

torch::nn::Sequential stage_of(const torch::nn::Sequential& whole, int stages, int stage, Partition how) {
  return stage_layers(whole, stages, stage, 1, how).layers;
}

}  // namespace xlr8::pp
