// `xlr8 advise`'s runs of one candidate and what they tell about the model (advise_measure.hpp).
#include "cli/advise_measure.hpp"

#include <fmt/format.h>

#include <fstream>

#include "checkpoint/hf_export.hpp"
#include "cli/memory_formulas.hpp"
#include "cli/scratch_dir.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace fs = std::filesystem;

namespace xlr8::cli::advise_runs {

double available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return std::stod(line.substr(13)) * 1024;
  return 0;
}

double memory_limit(const std::string& size) {
  try {
    if (const auto bytes = checkpoints::parse_size(size); bytes > 0) return static_cast<double>(bytes);
  } catch (const Error&) {  // its message names max_shard_size, another option's
  }
  throw ConfigError(fmt::format("--max_memory_per_rank {:?} must be a size above 0, such as 40GB or 512MB", size));
}

std::optional<nlohmann::json> read_json(const fs::path& file) {
  std::ifstream in(file);
  if (!in) return std::nullopt;
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<nlohmann::json> measure(LaunchOptions o, const fs::path& dir, const Measurement& m, std::string& failure) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  o.extra_env["XLR8_ADVISE_DIR"] = dir.string();
  o.extra_env["XLR8_ADVISE_WARMUP"] = std::to_string(m.warmup);
  o.extra_env["XLR8_ADVISE_STEPS"] = std::to_string(m.steps);
  o.extra_env["XLR8_ADVISE_MIN_SECONDS"] = fmt::format("{}", m.min_seconds);
  o.extra_env["XLR8_ADVISE_CUT_BELOW"] = fmt::format("{}", m.cut_below);
  const int ranks = o.nproc_per_node;  // this machine's: each writes done.<local rank>
  o.stop_check = [dir, ranks, &m]() -> std::string {
    if (Clock::now() > m.deadline) return "out of time (--budget_s)";
    if (every_rank_done(dir, ranks)) return "every rank measured its steps";
    return m.stop_early ? m.stop_early() : "";
  };
  const auto outcome = launch_with_outcome(o);
  if (outcome.interrupted_by) throw Error(fmt::format("interrupted (signal {})", outcome.interrupted_by));
  failure = outcome.exit_code == 0 ? ""
            : outcome.failure && !(outcome.failure->error_message.empty() && outcome.failure->headline.empty())
                ? (outcome.failure->error_message.empty() ? outcome.failure->headline : outcome.failure->error_message)
                : fmt::format("exit code {}", outcome.exit_code);
  return read_json(dir / "result.json");
}

ModelFacts facts_of(const nlohmann::json& probe) {
  return {.parameters = probe["parameters"],
          .tensor_parallel = probe["tensor_parallel"],
          .pipeline = probe.value("pipeline", nlohmann::json::object())};
}

void learn_from_steps(ModelFacts& facts, const nlohmann::json& result) {
  if (!facts.attention) facts.attention = result["attention_calls"].get<int64_t>() > 0;
  if (!facts.pipeline_step) facts.pipeline_step = result.value("pipeline_steps", int64_t{0}) > 0;
}

double predicted_bytes(const Candidate& c, const ModelFacts& m, int n) {
  double psi = m.parameters;
  if (const auto pp = std::to_string(c.pp); c.pp > 1 && m.pipeline.contains(pp))
    psi = m.pipeline[pp].get<double>();  // the largest stage's (a tied copy's apart)
  if (const auto tp = std::to_string(c.tp); c.tp > 1 && m.tensor_parallel.contains(tp)) {
    const double sliced = m.tensor_parallel[tp]["sliced"];
    psi += sliced / c.tp - sliced;
  }
  return per_rank(c.formula, dtype_bytes("fp32"), psi, c.formula_ranks > 0 ? c.formula_ranks : n);
}

std::string unmet_need(const Candidate& c, const ModelFacts& m) {
  if (c.tp > 1 && !m.tensor_parallel.contains(std::to_string(c.tp)))
    return m.tensor_parallel.contains("error")
               ? fmt::format("not tried: {}", text::first_line(m.tensor_parallel["error"].get<std::string>()))
               : fmt::format("not tried: tp {} does not divide the processes", c.tp);
  if (c.pp > 1 && !m.pipeline.contains(std::to_string(c.pp)))
    return fmt::format("not tried: a pipeline cuts a torch::nn::Sequential into stages of a layer or more, and the "
                       "model is not a Sequential of {} or more layers",
                       c.pp);
  if (c.pp > 1 && m.pipeline_step == false)
    return "not tried: the program does not step through Accelerator::pipeline_step, which pipeline parallelism needs";
  if (c.needs_attention && m.attention == false)
    return "not tried: the model's attention does not call xlr8::attention, which context and sequence parallelism need";
  return "";
}

}  // namespace xlr8::cli::advise_runs
