#pragma once
// What `xlr8 advise` does with one candidate's launch: run it with the recorder on and read what its workers wrote
// (src/diagnostics/advise_recorder.hpp), and what the first run tells about the model: its training state per rank by
// the formulas of `xlr8 estimate-memory`, and the meshes it cannot take.
#include <chrono>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/advise_candidates.hpp"
#include "xlr8/launcher.hpp"

namespace xlr8::cli::advise_runs {

using Clock = std::chrono::steady_clock;

// This machine's available memory (MemAvailable), bytes; 0 when unknown.
double available_memory_bytes();
// --max_memory_per_rank's size in bytes (40GB, 512MB), or a ConfigError naming that option.
double memory_limit(const std::string& size);

// A JSON file a run wrote (files::write_durably renames it into place); nullopt while it is not there.
std::optional<nlohmann::json> read_json(const std::filesystem::path& file);

// What one launch of a candidate is asked for. The run stops once every rank is done, at the deadline, or
// when `stop_early` says why (it is polled while the workers run).
struct Measurement {
  int warmup = 0, steps = 0;
  double min_seconds = 0, cut_below = 0;  // cut_below: samples/s
  Clock::time_point deadline;
  std::function<std::string()> stop_early;
};

// Runs `o` with the recorder on; the result file rank 0 wrote (none when stopped before).
std::optional<nlohmann::json> measure(LaunchOptions o, const std::filesystem::path& dir, const Measurement& m,
                                      std::string& failure);

// What the first candidate's run tells about the model.
struct ModelFacts {
  double parameters = 0;
  nlohmann::json tensor_parallel = nlohmann::json::object();  // by tp size: {"sliced": N}, or {"error": why}
  std::optional<bool> attention;  // a forward went through xlr8::attention (known once a run measured steps)
  nlohmann::json pipeline = nlohmann::json::object();  // by pp size: the largest stage's parameters (a Sequential)
  std::optional<bool> pipeline_step;  // the program steps through Accelerator::pipeline_step (likewise)
};

ModelFacts facts_of(const nlohmann::json& probe);
// What a run that measured steps tells (its result.json): whether attention and pipeline_step were used.
void learn_from_steps(ModelFacts& facts, const nlohmann::json& result);

// Training state per rank by the formulas; tensor parallelism divides the parameters AutoTP slices.
double predicted_bytes(const Candidate& c, const ModelFacts& m, int n);

// Why the model cannot take the candidate's mesh, or "".
std::string unmet_need(const Candidate& c, const ModelFacts& m);

}  // namespace xlr8::cli::advise_runs
