// DeepSpeed's elasticity (deepspeed/elasticity/elasticity.py, 0.19.7): candidate global batches are each
// micro batch (and their lcm) times the largest highly composite number that keeps them within
// max_train_batch_size; the one with the most valid world sizes wins, ties to the larger (or smaller) batch.
// Version 0.2 runs that per node (num_gpus_per_node / model_parallel_size data-parallel ranks each) and,
// for a world size outside the list, falls back to the largest (smallest) multiple of micro x world size.
#include "xlr8/deepspeed_elasticity.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <set>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deepspeed {

namespace {

// Highly composite numbers up to 720720 (OEIS A002182), DeepSpeed's HCN_LIST.
constexpr int64_t kHighlyComposite[] = {1,     2,      4,      6,      12,     24,     36,     48,     60,     120,
                                        180,   240,    360,    720,    840,    1260,   1680,   2520,   5040,   7560,
                                        10080, 15120,  20160,  25200,  27720,  45360,  50400,  55440,  83160,  110880,
                                        166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720};

const std::vector<std::string> kKeys = {"enabled",      "max_train_batch_size", "micro_batch_sizes",
                                        "min_gpus",     "max_gpus",             "min_time",
                                        "version",      "prefer_larger_batch",  "ignore_non_elastic_batch_info",
                                        "model_parallel_size", "num_gpus_per_node"};

struct Candidate {
  int64_t batch = 0;
  std::optional<std::vector<int64_t>> valid;  // none: no candidate had a valid world size (prefer smaller)
};

int64_t largest_highly_composite_at_most(int64_t n) {
  int64_t best = 1;
  for (int64_t h : kHighlyComposite)
    if (h <= n) best = h;
  return best;
}

// World sizes g in [lo, hi] such that some micro batch m has m x g dividing `batch`.
std::vector<int64_t> valid_world_sizes(int64_t batch, const std::vector<int64_t>& micro, int64_t lo, int64_t hi) {
  std::set<int64_t> valid;
  for (int64_t m : micro) {
    if (batch % m != 0) continue;
    const int64_t per = batch / m;
    for (int64_t g = std::max<int64_t>(lo, 1); g <= std::min(hi, per); ++g)
      if (per % g == 0) valid.insert(g);
  }
  return {valid.begin(), valid.end()};
}

// Version 0.1: the candidate batch with the most valid world sizes.
Candidate best_batch(const std::vector<int64_t>& micro, int64_t max_batch, int64_t lo, int64_t hi, bool prefer_larger) {
  if (std::any_of(micro.begin(), micro.end(), [&](int64_t m) { return m > max_batch; }))
    throw ConfigError(fmt::format("elasticity.micro_batch_sizes {} must each be at most max_train_batch_size {} (per "
                                  "node under version 0.2)",
                                  micro, max_batch));
  std::vector<int64_t> bases = micro;
  bases.push_back(std::accumulate(micro.begin(), micro.end(), int64_t{1}, [](int64_t a, int64_t b) { return std::lcm(a, b); }));
  std::set<int64_t> candidates;
  for (int64_t b : bases) {
    if (b > max_batch) continue;
    candidates.insert(b == max_batch ? b : b * largest_highly_composite_at_most(max_batch / b));
  }
  Candidate best{.batch = *std::min_element(micro.begin(), micro.end())};
  size_t best_count = 0;
  for (int64_t batch : candidates) {
    auto valid = valid_world_sizes(batch, micro, lo, hi);
    const bool wins = valid.size() > best_count ||
                      (valid.size() == best_count && (prefer_larger ? batch > best.batch : batch < best.batch));
    if (!wins) continue;
    best_count = valid.size();
    best = {.batch = batch, .valid = std::move(valid)};
  }
  return best;
}

// Version 0.2: version 0.1 over nodes, then scaled to data-parallel ranks; a world size outside the list
// falls back to a batch for that size alone (DeepSpeed's floating-point arithmetic, kept to match it).
Candidate best_batch_v02(const ElasticityConfig& e, int64_t world) {
  const auto& L = e.micro_batch_sizes;
  if (e.num_gpus_per_node % e.model_parallel_size != 0)
    throw ConfigError(fmt::format("elasticity.num_gpus_per_node {} must be divisible by model_parallel_size {} "
                                  "(version 0.2)",
                                  e.num_gpus_per_node, e.model_parallel_size));
  const int64_t per_node = e.num_gpus_per_node / e.model_parallel_size;
  const auto max_node_batch = static_cast<int64_t>(static_cast<double>(e.max_train_batch_size) / static_cast<double>(per_node));
  int64_t lo = static_cast<int64_t>(static_cast<double>(e.min_gpus) / static_cast<double>(e.num_gpus_per_node));
  int64_t hi = static_cast<int64_t>(static_cast<double>(e.max_gpus) / static_cast<double>(e.num_gpus_per_node));
  if (lo == 0) lo = 1;
  if (hi == 0) hi = max_node_batch / *std::min_element(L.begin(), L.end());
  Candidate nodes = best_batch(L, max_node_batch, lo, hi, e.prefer_larger_batch);
  if (!nodes.valid) return nodes;  // no node count fits at all (DeepSpeed fails there too)
  Candidate out{.batch = nodes.batch * per_node, .valid = std::vector<int64_t>{}};
  for (int64_t n : *nodes.valid) out.valid->push_back(n * per_node);
  if (std::find(out.valid->begin(), out.valid->end(), world / e.model_parallel_size) != out.valid->end()) return out;
  const double ranks = static_cast<double>(world) / static_cast<double>(e.num_gpus_per_node) * static_cast<double>(per_node);
  std::vector<double> fits;
  for (int64_t m : L) {
    const double step = static_cast<double>(m) * ranks;
    fits.push_back(std::floor(static_cast<double>(e.max_train_batch_size) / step) * step);
  }
  const double batch = e.prefer_larger_batch ? *std::max_element(fits.begin(), fits.end())
                                             : *std::min_element(fits.begin(), fits.end());
  return {.batch = static_cast<int64_t>(batch), .valid = std::vector<int64_t>{static_cast<int64_t>(ranks)}};
}

ConfigError bad(const std::string& origin, const std::string& key, const std::string& what) {
  return ConfigError(fmt::format("{}: elasticity.{} {}", origin, key, what));
}

int64_t whole(const nlohmann::json& s, const std::string& origin, const std::string& key, int64_t fallback) {
  if (!s.contains(key)) return fallback;
  const auto& v = s.at(key);
  if (!v.is_number_integer()) throw bad(origin, key, fmt::format("must be a whole number, not {}", v.dump()));
  return v.get<int64_t>();
}

std::vector<int64_t> micro_batches(const nlohmann::json& s, const std::string& origin) {
  if (!s.contains("micro_batch_sizes"))
    throw bad(origin, "micro_batch_sizes", "is required when elasticity is enabled (e.g. [2, 4, 6])");
  const auto& v = s.at("micro_batch_sizes");
  if (!v.is_array() || v.empty() || !std::all_of(v.begin(), v.end(), [](const auto& m) { return m.is_number_integer(); }))
    throw bad(origin, "micro_batch_sizes", fmt::format("must be a non-empty list of whole numbers, not {}", v.dump()));
  auto out = v.get<std::vector<int64_t>>();
  if (std::any_of(out.begin(), out.end(), [](int64_t m) { return m <= 0; }))
    throw bad(origin, "micro_batch_sizes", fmt::format("must hold positive numbers only, not {}", v.dump()));
  return out;
}

// "0.1", 0.1, 0.2 ... as DeepSpeed's float(version); only 0.1 and 0.2 have logic.
double version_of(const nlohmann::json& s, const std::string& origin, int64_t model_parallel) {
  double version = 0.2;
  if (s.contains("version")) {
    const auto& v = s.at("version");
    char* end = nullptr;
    const std::string text = v.is_string() ? v.get<std::string>() : v.dump();
    version = std::strtod(text.c_str(), &end);
    if (!(v.is_number() || v.is_string()) || text.empty() || *end != '\0')
      throw bad(origin, "version", fmt::format("must be a number (0.1 or 0.2), not {}", v.dump()));
  }
  if (model_parallel > 1 && version != 0.2)
    throw bad(origin, "version", fmt::format("{} does not support model_parallel_size {} (give version 0.2)", version, model_parallel));
  if (version != 0.1 && version != 0.2)
    throw bad(origin, "version", fmt::format("{} has no elasticity logic; DeepSpeed's are 0.1 and 0.2", version));
  return version;
}

}  // namespace

ElasticityConfig read_elasticity(const nlohmann::json& s, const std::string& origin) {
  if (!s.is_object()) throw ConfigError(fmt::format("{}: elasticity must be a JSON object", origin));
  for (const auto& [key, value] : s.items())
    if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
      const auto hint = text::closest(key, kKeys);
      throw ConfigError(fmt::format("{}: DeepSpeed has no key \"elasticity.{}\"{}", origin, key,
                                    hint.empty() ? fmt::format("; the keys here are {}", text::join(kKeys))
                                                 : fmt::format(" (did you mean \"elasticity.{}\"?)", hint)));
    }
  ElasticityConfig e;
  auto flag = [&](const char* key, bool& into) {
    if (!s.contains(key)) return;
    if (!s.at(key).is_boolean()) throw bad(origin, key, fmt::format("must be true or false, not {}", s.at(key).dump()));
    into = s.at(key).get<bool>();
  };
  flag("enabled", e.enabled);
  flag("prefer_larger_batch", e.prefer_larger_batch);
  flag("ignore_non_elastic_batch_info", e.ignore_non_elastic_batch_info);
  if (!e.enabled) return e;
  if (!s.contains("max_train_batch_size"))
    throw bad(origin, "max_train_batch_size", "is required when elasticity is enabled (the largest global batch)");
  e.max_train_batch_size = whole(s, origin, "max_train_batch_size", 0);
  e.micro_batch_sizes = micro_batches(s, origin);
  e.min_gpus = whole(s, origin, "min_gpus", 1);
  e.max_gpus = whole(s, origin, "max_gpus", 10000);
  if (e.min_gpus < 1 || e.max_gpus < 1)
    throw bad(origin, "min_gpus", fmt::format("and max_gpus must be > 0, given {} and {}", e.min_gpus, e.max_gpus));
  if (e.min_gpus > e.max_gpus)
    throw bad(origin, "min_gpus", fmt::format("{} cannot be greater than max_gpus {}", e.min_gpus, e.max_gpus));
  e.model_parallel_size = whole(s, origin, "model_parallel_size", 1);
  if (e.model_parallel_size < 1) throw bad(origin, "model_parallel_size", "must be at least 1");
  e.num_gpus_per_node = whole(s, origin, "num_gpus_per_node", 1);
  if (e.num_gpus_per_node < 1) throw bad(origin, "num_gpus_per_node", "must be at least 1");
  if (s.contains("min_time")) {
    if (!s.at("min_time").is_number()) throw bad(origin, "min_time", "must be a number of minutes");
    e.min_time = s.at("min_time").get<double>();
    if (e.min_time < 0) throw bad(origin, "min_time", fmt::format("must be >= 0, given {}", e.min_time));
  }
  e.version = version_of(s, origin, e.model_parallel_size);
  return e;
}

ElasticBatch compute_elastic_batch(const ElasticityConfig& e, int64_t world) {
  if (!e.enabled) throw ConfigError("elasticity is disabled: set elasticity.enabled to true for an elastic batch");
  const Candidate c = e.version == 0.1
      ? best_batch(e.micro_batch_sizes, e.max_train_batch_size, e.min_gpus, e.max_gpus, e.prefer_larger_batch)
      : best_batch_v02(e, world);
  if (!c.valid || std::find(c.valid->begin(), c.valid->end(), world) == c.valid->end())
    throw ConfigError(fmt::format("elasticity: world size {} (data-parallel ranks) is not valid for max_train_batch_size "
                                  "{} and micro_batch_sizes {}; the valid ones are {} (DeepSpeed's "
                                  "ElasticityIncompatibleWorldSize): run on one of them, or widen min_gpus/max_gpus",
                                  world, e.max_train_batch_size, e.micro_batch_sizes,
                                  c.valid ? fmt::format("{}", *c.valid) : std::string("none")));
  std::vector<int64_t> micro(e.micro_batch_sizes);
  std::sort(micro.rbegin(), micro.rend());
  const auto fits = std::find_if(micro.begin(), micro.end(), [&](int64_t m) { return c.batch / world % m == 0; });
  if (fits == micro.end())
    throw ConfigError(fmt::format("elasticity: no micro batch of {} divides {} samples per rank", micro, c.batch / world));
  return {.train_batch_size = c.batch,
          .micro_batch_size = *fits,
          .gradient_accumulation_steps = c.batch / (*fits * world),
          .valid_world_sizes = *c.valid};
}

}  // namespace xlr8::deepspeed
