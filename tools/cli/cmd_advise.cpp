// `xlr8 advise [launch options] [--max_memory_per_rank SIZE] [--budget_s S] [--output F] program [args]`: the
// strategies that fit, each run for a few timed steps of the user's own program, ranked by throughput; the
// winner written as an Accelerate config. The workers measure through the Accelerator
// (src/train/advise_recorder.hpp); what cannot fit is pruned by the formulas of `xlr8 estimate-memory`.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "checkpoint/hf_export.hpp"
#include "cli/commands.hpp"
#include "cli/memory_formulas.hpp"
#include "cli/scratch_dir.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace xlr8::cli {

namespace {

struct AdviseOptions {
  std::string max_memory;  // per rank; default: this machine's available memory / processes
  double budget_s = 300;
  int warmup = 2, steps = 3;
  double min_seconds = 2;
  std::string output;
};

// One strategy to try: the flags it adds to the user's launch, and its static-memory formula.
struct Candidate {
  std::string name, formula;  // formula: ddp, zero1, zero2, zero3 (memory_formulas.hpp)
  bool use_fsdp = false, use_deepspeed = false;
  std::map<std::string, std::string> fsdp, deepspeed;
  std::string mixed_precision;  // empty: the launch's
};

std::vector<Candidate> candidates() {
  const std::map<std::string, std::string> full{{"fsdp_sharding_strategy", "FULL_SHARD"},
                                                {"fsdp_backward_prefetch", "NO_PREFETCH"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    auto m = full;
    for (auto& [k, v] : extra) m[k] = v;
    return m;
  };
  return {
      {.name = "DDP", .formula = "ddp"},
      {.name = "DDP, bf16", .formula = "ddp", .mixed_precision = "bf16"},
      {.name = "ZeRO-1", .formula = "zero1", .use_deepspeed = true, .deepspeed = {{"zero_stage", "1"}}},
      {.name = "SHARD_GRAD_OP (ZeRO-2)", .formula = "zero2", .use_fsdp = true,
       .fsdp = {{"fsdp_sharding_strategy", "SHARD_GRAD_OP"}}},
      {.name = "FULL_SHARD (ZeRO-3)", .formula = "zero3", .use_fsdp = true, .fsdp = full},
      {.name = "FULL_SHARD, prefetch", .formula = "zero3", .use_fsdp = true,
       .fsdp = with({{"fsdp_backward_prefetch", "BACKWARD_PRE"}, {"fsdp_forward_prefetch", "true"}})},
      {.name = "FULL_SHARD, activation checkpointing", .formula = "zero3", .use_fsdp = true,
       .fsdp = with({{"fsdp_activation_checkpointing", "true"}})},
      {.name = "FULL_SHARD, bf16", .formula = "zero3", .use_fsdp = true, .fsdp = full, .mixed_precision = "bf16"},
  };
}

// The user's launch under the candidate: their FSDP keys (wrap policy, block class) stay unless it sets them.
LaunchRequest with_candidate(LaunchRequest r, const Candidate& c) {
  r.use_fsdp = c.use_fsdp;
  r.use_deepspeed = c.use_deepspeed;
  for (const auto& [k, v] : c.fsdp) r.fsdp[k] = v;
  if (!c.use_fsdp) r.fsdp.clear();
  r.deepspeed = c.deepspeed;
  if (!c.mixed_precision.empty()) r.mixed_precision = c.mixed_precision;
  r.max_restarts = 0;
  return r;
}

double available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return std::stod(line.substr(13)) * 1024;
  return 0;
}

// Runs `o` with the recorder on, until every rank is done or `deadline`; the rank-0 file it wrote.
std::optional<nlohmann::json> measure(LaunchOptions o, const fs::path& dir, int warmup, int steps, double min_seconds,
                                      Clock::time_point deadline, const std::string& file, std::string& failure) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  o.extra_env["XLR8_ADVISE_DIR"] = dir.string();
  o.extra_env["XLR8_ADVISE_WARMUP"] = std::to_string(warmup);
  o.extra_env["XLR8_ADVISE_STEPS"] = std::to_string(steps);
  o.extra_env["XLR8_ADVISE_MIN_SECONDS"] = std::to_string(min_seconds);
  const int ranks = o.world_size();
  o.stop_check = [dir, ranks, deadline]() -> std::string {
    if (Clock::now() > deadline) return "out of time (--budget_s)";
    return every_rank_done(dir, ranks) ? "every rank measured its steps" : "";
  };
  const auto outcome = launch_with_outcome(o);
  if (outcome.interrupted_by) throw Error(fmt::format("interrupted (signal {})", outcome.interrupted_by));
  failure = outcome.exit_code == 0 ? ""
            : outcome.failure && !(outcome.failure->error_message.empty() && outcome.failure->headline.empty())
                ? (outcome.failure->error_message.empty() ? outcome.failure->headline : outcome.failure->error_message)
                : fmt::format("exit code {}", outcome.exit_code);
  std::ifstream in(dir / file);
  if (!in) return std::nullopt;
  return nlohmann::json::parse(in);
}

struct Row {
  const Candidate* candidate = nullptr;
  double predicted = 0, measured = 0, peak_rss = 0, throughput = 0;
  std::string unit, verdict;
  bool ran = false;
};

void write_config(const std::string& path, const LaunchOptions& base, const Candidate& c, int processes) {
  std::string mixed = c.mixed_precision;
  if (mixed.empty()) mixed = base.settings.mixed_precision == MixedPrecision::BF16 ? "bf16"
                             : base.settings.mixed_precision == MixedPrecision::FP16 ? "fp16" : "no";
  std::string text = fmt::format("# written by xlr8 advise: {}\ncompute_environment: LOCAL_MACHINE\n", c.name);
  text += fmt::format("distributed_type: {}\nnum_machines: 1\nnum_processes: {}\nmixed_precision: {}\n",
                      c.use_fsdp ? "FSDP" : c.use_deepspeed ? "DEEPSPEED" : "MULTI_CPU", processes, mixed);
  if (c.use_fsdp) {
    text += "fsdp_config:\n";
    for (const auto& [k, v] : c.fsdp) text += fmt::format("  {}: {}\n", k, v);
  }
  if (c.use_deepspeed) {
    text += "deepspeed_config:\n";
    for (const auto& [k, v] : c.deepspeed) text += fmt::format("  {}: {}\n", k, v);
  }
  std::ofstream out(path);
  if (!(out << text)) throw Error(fmt::format("--output {:?}: cannot write it", path));
}

int advise(const LaunchRequest& request, const AdviseOptions& a) {
  const auto started = Clock::now();
  const auto deadline = started + std::chrono::milliseconds(static_cast<int64_t>(a.budget_s * 1000));
  // At least one warm-up step: the first one allocates, and the clock starts at a step's end.
  if (a.steps < 1 || a.warmup < 1) throw ConfigError("--steps and --warmup must be 1 or more");
  const LaunchOptions base = plan_launch(request);
  if (base.elastic || !base.mpirun_hostfile.empty() || base.num_machines > 1)
    throw ConfigError("xlr8 advise measures on this machine: give --num_processes N alone");
  const int n = base.world_size();
  const double limit = a.max_memory.empty() ? available_memory_bytes() / n
                                            : static_cast<double>(checkpoints::parse_size(a.max_memory));
  const ScratchDir scratch("advise");
  const fs::path& work = scratch.path();

  const auto all = candidates();
  // The model's size, from the least memory-hungry candidate's prepare().
  std::string failure;
  fmt::print(stderr, "xlr8 advise: measuring the model (prepare() under FULL_SHARD on {} processes)\n", n);
  const auto probe =
      measure(plan_launch(with_candidate(request, all[4])), work / "probe", 0, 0, 0, deadline, "probe.json", failure);
  if (!probe)
    throw Error(fmt::format("the program did not reach Accelerator::prepare(model){}", failure.empty() ? "" : ": " + failure));
  const double psi = (*probe)["parameters"];
  fmt::print(stderr, "xlr8 advise: {:.0f} parameters; memory per rank: {} ({}); budget {:.0f} s\n", psi, human(limit),
             a.max_memory.empty() ? "available memory / processes" : "--max_memory_per_rank", a.budget_s);

  std::vector<Row> rows;
  for (const auto& c : all) {
    Row row{.candidate = &c};
    row.predicted = per_rank(c.formula, dtype_bytes("fp32"), psi, n);
    if (row.predicted > limit) {
      row.verdict = fmt::format("cannot fit: needs {} per rank for parameters, gradients and AdamW state", human(row.predicted));
    } else if (Clock::now() > deadline) {
      row.verdict = "not tried: out of --budget_s";
    } else {
      fmt::print(stderr, "xlr8 advise: {}: {} warm-up + {} timed steps\n", c.name, a.warmup, a.steps);
      std::optional<nlohmann::json> result;
      try {
        result = measure(plan_launch(with_candidate(request, c)), work / fmt::format("c{}", rows.size()), a.warmup, a.steps,
                         a.min_seconds, deadline, "result.json", failure);
      } catch (const ConfigError& e) {
        row.verdict = fmt::format("failed: {}", e.what());
      }
      if (result) {
        row.ran = true;
        const double seconds = std::max((*result)["seconds"].get<double>(), 1e-9);
        const double samples = (*result)["samples_per_step"];
        row.throughput = (samples > 0 ? samples : 1.0) * (*result)["steps"].get<double>() / seconds;
        row.unit = samples > 0 ? "samples/s" : "steps/s";
        row.measured = (*result)["static_bytes"];
        row.peak_rss = (*result)["peak_rss"];
        row.verdict = row.measured > limit ? "exceeds the memory per rank (measured)" : "fits";
      } else if (row.verdict.empty()) {
        row.verdict = Clock::now() > deadline ? "not finished within --budget_s"
                      : failure.empty()
                          ? fmt::format("ended before {} steps", a.warmup + a.steps)
                          : fmt::format("failed: {}", failure);
      }
    }
    rows.push_back(row);
  }
  std::vector<Row*> ranked;
  for (auto& r : rows)
    if (r.ran && r.verdict == "fits") ranked.push_back(&r);
  std::sort(ranked.begin(), ranked.end(), [](Row* x, Row* y) { return x->throughput > y->throughput; });
  for (auto& r : rows)
    if (std::find(ranked.begin(), ranked.end(), &r) == ranked.end()) ranked.push_back(&r);

  const double best = ranked.empty() || !ranked.front()->ran ? 0 : ranked.front()->throughput;
  fmt::print("{:<38} {:>14} {:>7} {:>12} {:>12} {:>7} {:>11}  {}\n", "strategy", "samples/s", "x best", "predicted",
             "measured", "error", "peak RSS", "verdict");
  for (const Row* r : ranked) {
    if (r->ran)
      fmt::print("{:<38} {:>9.1f}{:<5} {:>7.2f} {:>12} {:>12} {:>6.1f}% {:>11}  {}\n", r->candidate->name, r->throughput,
                 r->unit == "samples/s" ? "" : " st/s", r->throughput / best, human(r->predicted), human(r->measured),
                 100.0 * (r->predicted - r->measured) / std::max(r->measured, 1.0), human(r->peak_rss),
                 r == ranked.front() && r->verdict == "fits" ? "best" : r->verdict);
    else
      fmt::print("{:<38} {:>14} {:>7} {:>12} {:>12} {:>7} {:>11}  {}\n", r->candidate->name, "-", "-", human(r->predicted),
                 "-", "-", "-", r->verdict);
  }
  fmt::print("(throughput: at least {} timed steps and {} s after {} warm-up; predicted: parameters, gradients and AdamW state by the "
             "formulas of xlr8 estimate-memory; measured: what a rank held after its last step; advise took {:.0f} s)\n",
             a.steps, a.min_seconds, a.warmup, std::chrono::duration<double>(Clock::now() - started).count());
  if (ranked.empty() || ranked.front()->verdict != "fits") {
    fmt::print("xlr8 advise: no strategy ran within the memory per rank\n");
    return 1;
  }
  const Row& winner = *ranked.front();
  fmt::print("xlr8 advise: {} on {} processes", winner.candidate->name, n);
  if (!a.output.empty()) {
    write_config(a.output, base, *winner.candidate, n);
    fmt::print(": written to {} (xlr8 launch --config_file {} program ...)", a.output, a.output);
  }
  fmt::print("\n");
  return 0;
}

}  // namespace

Handler add_advise(CLI::App& app) {
  auto* cmd = app.add_subcommand("advise", "Try the strategies that fit on the program itself and pick the fastest");
  auto req = std::make_shared<LaunchRequest>();
  auto a = std::make_shared<AdviseOptions>();
  add_launch_options(cmd, req);
  cmd->add_option("--max_memory_per_rank", a->max_memory,
                  "Training state (parameters, gradients, optimizer state) one rank may hold, e.g. 2GB (default: "
                  "available memory / N); peak RSS, which adds the runtime, activations and data, is shown beside it");
  cmd->add_option("--budget_s", a->budget_s, "Time for the whole search, seconds (default 300)");
  cmd->add_option("--warmup", a->warmup, "Untimed optimizer steps per strategy (default 2)");
  cmd->add_option("--steps", a->steps, "Timed optimizer steps per strategy, at least (default 3)");
  cmd->add_option("--min_seconds", a->min_seconds, "...and at least this long (default 2)");
  cmd->add_option("--output", a->output, "Write the winner as an Accelerate config file");
  cmd->footer("Usage: xlr8 advise [launch options] [--max_memory_per_rank SIZE] [--output advised.yaml] program [args]");
  return [req, a]() { return advise(*req, *a); };
}

}  // namespace xlr8::cli
