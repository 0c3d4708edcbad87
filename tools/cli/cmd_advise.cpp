// `xlr8 advise [launch options] [--max_memory_per_rank SIZE] [--budget_s S] [--output F] program [args]`: the
// strategies that fit, each run for a few timed steps of the user's own program, ranked by throughput; the
// winner written as an Accelerate config. The workers measure through the Accelerator
// (src/diagnostics/advise_recorder.hpp); what cannot fit is pruned by the formulas of `xlr8 estimate-memory`.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/hf_export.hpp"
#include "cli/advise_candidates.hpp"
#include "cli/advise_measure.hpp"
#include "cli/commands.hpp"
#include "cli/machine_channel.hpp"
#include "cli/memory_formulas.hpp"
#include "cli/scratch_dir.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"

namespace fs = std::filesystem;

namespace xlr8::cli {

namespace {

using namespace advise_runs;

struct AdviseOptions {
  std::string max_memory;  // per rank; default: this machine's available memory / processes
  double budget_s = 300;
  int warmup = 2, steps = 3;
  double min_seconds = 2;
  double cut_below = 0.7;  // a candidate slower than this times the best so far is stopped early
  std::vector<std::string> only;  // --try: these candidates alone
  std::string output;
};

// A bound from one run allows the others of its kind this much less arithmetic time: its communication may have
// slowed the arithmetic it overlapped (on a CPU, copies and reductions share the cores).
constexpr double kComputeMargin = 0.85;

struct Row {
  const Candidate* candidate = nullptr;
  double predicted = 0, measured = 0, peak_rss = 0, throughput = 0;
  double peak_tensors = 0;  // measured: the most tensor bytes a rank held during the timed steps
  double predicted_peak = 0;  // its training state plus what a run of the same activations held above its own
  std::string unit, verdict;
  bool ran = false, cut = false;
};

void write_config(const std::string& path, const LaunchOptions& base, const Candidate& c, int processes) {
  std::string mixed = c.mixed_precision;
  if (mixed.empty()) mixed = xlr8::to_string(base.settings.mixed_precision);
  std::string text = fmt::format("# written by xlr8 advise: {}\ncompute_environment: LOCAL_MACHINE\n", c.name);
  text += fmt::format("distributed_type: {}\nnum_machines: {}\nnum_processes: {}\nmixed_precision: {}\n",
                      c.use_fsdp ? "FSDP" : c.use_deepspeed ? "DEEPSPEED" : "MULTI_CPU", base.num_machines, processes,
                      mixed);
  if (base.num_machines > 1)  // this machine's file: the others' differ in machine_rank alone
    text += fmt::format("machine_rank: {}\nmain_process_ip: {}\nmain_process_port: {}\n", base.machine_rank,
                        base.master_addr, base.master_port);
  if (c.use_fsdp) {
    text += "fsdp_config:\n";
    for (const auto& [k, v] : c.fsdp) text += fmt::format("  {}: {}\n", k, v);
  }
  if (c.use_deepspeed) {
    text += "deepspeed_config:\n";
    for (const auto& [k, v] : c.deepspeed) text += fmt::format("  {}: {}\n", k, v);
  }
  if (!c.parallelism.empty()) {
    text += "parallelism_config:\n";
    for (const auto& [k, v] : c.parallelism) text += fmt::format("  {}: {}\n", k, v);
  }
  std::ofstream out(path);
  if (!(out << text)) throw Error(fmt::format("--output {:?}: cannot write it", path));
}

// Runs the candidates one after another. The first one's prepare() tells the model's size (probe.json); until
// then nothing is pruned, and the first is stopped there if it cannot fit.
class Advisor {
 public:
  Advisor(const LaunchRequest& request, const AdviseOptions& a, int n, double limit, fs::path work,
          Clock::time_point deadline, MachineChannel* channel)
      : request_(request), a_(a), n_(n), limit_(limit), work_(std::move(work)), deadline_(deadline), channel_(channel) {}

  bool measured_the_model() const { return facts_.has_value(); }
  const std::string& last_failure() const { return last_failure_; }

  Row run(const Candidate& c) {
    Row row{.candidate = &c};
    const LaunchRequest changed = with_candidate(request_, c);
    if (facts_) row.predicted = predicted_bytes(c, *facts_, n_);
    if (auto [same, fresh] = tried_.emplace(launch_key(changed), c.name); !fresh) {
      row.verdict = fmt::format("the launch as {}", same->second);
      return row;
    }
    if (facts_ && !(row.verdict = unmet_need(c, *facts_)).empty()) return row;
    if (facts_ && row.predicted > limit_) return cannot_fit(row);
    LaunchOptions planned;
    try {
      planned = plan_launch(changed);
    } catch (const ConfigError& e) {
      row.verdict = fmt::format("failed: {}", e.what());
      if (!facts_) last_failure_ = row.verdict;
      return row;
    }
    if (!(row.verdict = not_tried(c, changed, planned)).empty()) return row;
    const MixedPrecision precision = planned.settings.mixed_precision;
    fmt::print(stderr, "xlr8 advise: {}: {} warm-up + {} timed steps{}\n", c.name, a_.warmup, a_.steps,
               facts_ ? "" : " (its prepare() measures the model)");
    const fs::path dir = work_ / fmt::format("c{}", runs_++);
    Measurement m{.warmup = a_.warmup, .steps = a_.steps, .min_seconds = a_.min_seconds, .cut_below = a_.cut_below * best_,
                  .deadline = deadline_};
    bool too_big = false;
    std::string elsewhere;  // another machine's failure to take part
    m.stop_early = [&]() -> std::string {
      if (channel_)
        if (auto why = channel_->failure_of_last()) return elsewhere = *why;
      if (facts_) return "";
      const auto probe = read_json(dir / "probe.json");
      if (!probe || predicted_bytes(c, facts_of(*probe), n_) <= limit_) return "";
      too_big = true;
      return "the model cannot fit under this strategy";
    };
    std::optional<nlohmann::json> result;
    std::string failure;
    // The other machines start their part of the launch; they check that their flags give the same one.
    if (channel_) {
      channel_->post(fmt::format("run:{}\n{}", c.name, nlohmann::json(settings_to_env(planned.settings)).dump()));
      planned.run_id = channel_->job_of_last();
    }
    try {
      result = measure(planned, dir, m, failure);
    } catch (const ConfigError& e) {
      failure = e.what();
    }
    if (!result && !elsewhere.empty()) failure = elsewhere;
    if (!facts_ && !learn(dir)) {  // it never reached prepare(): the next candidate measures the model
      row.verdict = failure.empty() ? "failed: the program did not reach Accelerator::prepare(model)"
                                    : fmt::format("failed: {}", failure);
      last_failure_ = row.verdict;
      return row;
    }
    if (result) learn_from_steps(*facts_, *result);
    row.predicted = predicted_bytes(c, *facts_, n_);
    const std::string kind = activation_kind(changed);
    if (excess_.count(kind)) row.predicted_peak = row.predicted + excess_.at(kind);
    // Stopped at prepare(), or ended (out of memory, say) before the check saw the model's size.
    if (too_big || (!result && row.predicted > limit_)) return cannot_fit(row);
    if (!result) {
      row.verdict = Clock::now() > deadline_ ? "not finished within --budget_s"
                    : failure.empty()        ? fmt::format("ended before {} + {} steps and {} s (more steps, or lower "
                                                               "--steps / --min_seconds)", a_.warmup, a_.steps, a_.min_seconds)
                                             : fmt::format("failed: {}", failure);
      return row;
    }
    record(row, *result, changed, precision);
    return row;
  }

 private:
  // Why a candidate that plans is not run, or "": what a run of it could not tell, or could not win.
  std::string not_tried(const Candidate& c, const LaunchRequest& changed, const LaunchOptions& planned) const {
    if (c.fsdp.count("fsdp_activation_checkpointing") && planned.settings.fsdp &&
        planned.settings.fsdp->auto_wrap_policy == "NO_WRAP")
      return "not tried: activation checkpointing recomputes the units of a wrap policy; give "
             "--fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap <block class>";
    if (const auto base = without_recompute(changed); base && ran_.count(launch_key(*base)))
      return fmt::format("not tried: {} ran without it; recomputing adds time and changes no training state",
                         ran_.at(launch_key(*base)));
    const Bound* bound = bound_of(changed, planned.settings.mixed_precision);
    if (bound && bound->throughput < a_.cut_below * best_)
      return fmt::format("not tried: at most {:.1f} {} (the forward and backward of {}, measured without its "
                         "communication and optimizer steps) is below {:.2f}x the best",
                         bound->throughput, bound->unit, bound->from, a_.cut_below);
    if (Clock::now() > deadline_) return "not tried: out of --budget_s";
    return "";
  }

  // A run that measured its steps: its throughput and memory, the calibrations it gives the others, its verdict.
  void record(Row& row, const nlohmann::json& result, const LaunchRequest& changed, MixedPrecision precision) {
    const Candidate& c = *row.candidate;
    const std::string kind = activation_kind(changed);
    row.ran = true;
    ran_.emplace(launch_key(changed), c.name);
    const double seconds = std::max(result["seconds"].get<double>(), 1e-9);
    const double samples = result["samples_per_step"];
    const double steps = result["steps"];
    row.throughput = (samples > 0 ? samples : 1.0) * steps / seconds;
    row.unit = samples > 0 ? "samples/s" : "steps/s";
    row.measured = result["static_bytes"];
    row.peak_rss = result["peak_rss"];
    row.peak_tensors = result["peak_tensor_bytes"];
    excess_.emplace(kind, row.peak_tensors - row.measured);  // the first run of its kind calibrates the others
    if (const double compute = result.value("compute_seconds", 0.0); compute > 0) {
      auto& bound = bounds_[compute_kind(changed, precision)];
      const double most = row.throughput * seconds / (kComputeMargin * compute);
      if (most > bound.throughput) bound = {most, row.unit, c.name};
    }
    row.cut = result["cut"];
    if (row.measured > limit_) row.verdict = "exceeds the memory per rank (measured)";
    else if (row.cut) row.verdict = fmt::format("slower: stopped after {:.0f} step(s) below {:.2f}x the best", steps, a_.cut_below);
    else row.verdict = "fits", best_ = std::max(best_, row.throughput);
  }

  Row& cannot_fit(Row& row) {
    row.verdict = fmt::format("cannot fit: needs {} per rank for parameters, gradients and AdamW state", human(row.predicted));
    return row;
  }

  struct Bound;
  // The bound the runs of the launch's compute kind gave, else those of the same without recomputation (which
  // only adds arithmetic): either is an upper bound; nullptr when neither ran.
  const Bound* bound_of(const LaunchRequest& launch, MixedPrecision precision) const {
    for (const auto& kind : {std::optional(launch), without_recompute(launch)})
      if (kind)
        if (const auto at = bounds_.find(compute_kind(*kind, precision)); at != bounds_.end()) return &at->second;
    return nullptr;
  }

  // The model's facts from the run in `dir`; false when it wrote none.
  bool learn(const fs::path& dir) {
    const auto probe = read_json(dir / "probe.json");
    if (!probe) return false;
    facts_ = facts_of(*probe);
    fmt::print(stderr, "xlr8 advise: {:.0f} parameters; memory per rank: {} ({}); budget {:.0f} s\n", facts_->parameters,
               human(limit_), a_.max_memory.empty() ? "available memory / processes" : "--max_memory_per_rank", a_.budget_s);
    return true;
  }

  const LaunchRequest& request_;
  const AdviseOptions& a_;
  const int n_;
  const double limit_;
  const fs::path work_;
  const Clock::time_point deadline_;
  MachineChannel* const channel_;  // several machines: this is machine 0, which tells the others what to launch
  std::optional<ModelFacts> facts_;
  std::map<std::string, std::string> tried_;  // launch key -> the candidate's name
  std::map<std::string, std::string> ran_;    // the same, of those that measured their steps
  std::map<std::string, double> excess_;      // activation kind -> peak tensor bytes above the state, measured
  // The most a strategy of a compute kind can do: a run of that kind's throughput had its steps been its forward
  // and backward alone (communication and optimizer steps are what the strategies of one kind change).
  struct Bound {
    double throughput = 0;
    std::string unit, from;
  };
  std::map<std::string, Bound> bounds_;  // compute kind -> the loosest bound its runs gave
  double best_ = 0;                           // the fastest throughput so far
  int runs_ = 0;
  std::string last_failure_;  // of a candidate that did not reach prepare()
};

// The rows that ran their measurement by throughput, then those stopped early, then the rest, printed as the
// table; the ranking.
std::vector<const Row*> print_table(const std::vector<Row>& rows, const AdviseOptions& a, double seconds) {
  std::vector<const Row*> ranked;
  for (const auto& r : rows) ranked.push_back(&r);
  auto order = [](const Row* r) { return r->ran && r->verdict == "fits" ? 0 : r->ran && r->cut ? 1 : 2; };
  std::stable_sort(ranked.begin(), ranked.end(), [&](const Row* x, const Row* y) {
    return order(x) != order(y) ? order(x) < order(y) : order(x) < 2 && x->throughput > y->throughput;
  });
  const double best = ranked.empty() || !ranked.front()->ran ? 0 : ranked.front()->throughput;
  auto error = [](double predicted, double measured) {
    return fmt::format("{:.1f}%", 100.0 * (predicted - measured) / std::max(measured, 1.0));
  };
  fmt::print("{:<38} {:>14} {:>7} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7} {:>11}  {}\n", "strategy", "samples/s", "x best",
             "predicted", "measured", "error", "peak pred.", "peak tensors", "error", "peak RSS", "verdict");
  for (const Row* r : ranked) {
    if (r->ran)
      fmt::print("{:<38} {:>9.1f}{:<5} {:>7.2f} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7} {:>11}  {}\n", r->candidate->name,
                 r->throughput, r->unit == "samples/s" ? "" : " st/s", r->throughput / best, human(r->predicted),
                 human(r->measured), error(r->predicted, r->measured), r->predicted_peak > 0 ? human(r->predicted_peak) : "-",
                 human(r->peak_tensors), r->predicted_peak > 0 ? error(r->predicted_peak, r->peak_tensors) : "-",
                 human(r->peak_rss), r == ranked.front() && r->verdict == "fits" ? "best" : r->verdict);
    else
      fmt::print("{:<38} {:>14} {:>7} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7} {:>11}  {}\n", r->candidate->name, "-", "-",
                 human(r->predicted), "-", "-", "-", "-", "-", "-", r->verdict);
  }
  fmt::print("(throughput: at least {} timed steps and {} s after {} warm-up, or fewer for one slower than {}x the best "
             "so far; predicted: parameters, gradients and AdamW state by the formulas of xlr8 estimate-memory; "
             "measured: what a rank held after its last step; peak tensors: the most tensor bytes a rank held during "
             "the timed steps, activations and gathered or communicated buffers included; peak pred.: the predicted "
             "state plus what the first run of the same precision, recomputation and tp/cp/sp held above its state "
             "(\"-\": the first of its kind); advise took {:.0f} s)\n",
             a.steps, a.min_seconds, a.warmup, a.cut_below, seconds);
  return ranked;
}

// The candidates advise tries: all, or those --try names.
std::vector<Candidate> chosen_candidates(const AdviseOptions& a, int n, int machines) {
  auto all = candidates(n, machines);
  if (a.only.empty()) return all;
  std::vector<std::string> names;
  for (const auto& c : all) names.push_back(c.name);
  for (const auto& name : a.only)
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw ConfigError(fmt::format("--try {:?} is not a candidate on {} processes over {} machine(s); the candidates: {}",
                                    name, n, machines, fmt::join(names, "; ")));
  std::erase_if(all, [&](const Candidate& c) { return std::find(a.only.begin(), a.only.end(), c.name) == a.only.end(); });
  return all;
}

// Machine 0 (or the only one): measures, prints the table; the winner, or nullptr when none ran within the memory.
const Candidate* lead(const LaunchRequest& request, const AdviseOptions& a, const LaunchOptions& base,
                      const std::vector<Candidate>& all, MachineChannel* channel) {
  const auto started = Clock::now();
  const auto deadline = started + std::chrono::milliseconds(static_cast<int64_t>(a.budget_s * 1000));
  const int n = base.world_size();
  const double limit = a.max_memory.empty() ? available_memory_bytes() / base.nproc_per_node : memory_limit(a.max_memory);
  const ScratchDir scratch("advise");
  Advisor advisor(request, a, n, limit, scratch.path(), deadline, channel);
  std::vector<Row> rows;
  for (const auto& c : all) rows.push_back(advisor.run(c));
  if (!advisor.measured_the_model())
    throw Error(fmt::format("no candidate's program reached Accelerator::prepare(model); the last one {}",
                            advisor.last_failure().empty() ? "was not tried" : advisor.last_failure()));
  const auto ranked = print_table(rows, a, std::chrono::duration<double>(Clock::now() - started).count());
  if (ranked.empty() || ranked.front()->verdict != "fits") return nullptr;
  return ranked.front()->candidate;
}

// Machines other than 0: start this machine's part of each launch machine 0 posts; its winner, or nullptr.
const Candidate* follow(const LaunchRequest& request, const AdviseOptions& a, const LaunchOptions& base,
                        const std::vector<Candidate>& all, MachineChannel& channel) {
  const ScratchDir scratch("advise");
  fmt::print(stderr, "xlr8 advise: machine {} of {}: machine 0 ({}) measures and decides; this one launches its part\n",
             base.machine_rank, base.num_machines, base.master_addr);
  auto named = [&](const std::string& name) -> const Candidate& {
    for (const auto& c : all)
      if (c.name == name) return c;
    throw Error(fmt::format("xlr8 advise: machine 0 launches {:?}, which this machine's flags do not give as a "
                            "candidate: run advise with the same flags on every machine",
                            name));
  };
  for (int runs = 0;; ++runs) {
    const std::string word = channel.next();
    const std::string what = word.substr(word.find(':') + 1);
    if (word.starts_with("error:") || word.starts_with("end:")) channel.acknowledge_end();
    if (word.starts_with("error:")) throw Error(fmt::format("xlr8 advise: machine 0 stopped: {}", what));
    if (word.starts_with("end:")) return what.empty() ? nullptr : &named(what);
    const std::string name = what.substr(0, what.find('\n'));
    fmt::print(stderr, "xlr8 advise: {}: this machine's ranks\n", name);
    // Machine 0's rank 0 times the steps and decides when they stop; this machine's part ends with them, or as
    // soon as machine 0 has moved on (its part ended otherwise: stopped early, failed, out of time).
    Measurement m{.warmup = a.warmup, .steps = a.steps, .min_seconds = a.min_seconds,
                  .deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(a.budget_s * 1000)),
                  .stop_early = [&]() -> std::string { return channel.next_is_posted() ? "machine 0 moved on" : ""; }};
    std::string failure;
    try {
      LaunchOptions planned = plan_launch(with_candidate(request, named(name)));
      // Machine 0's settings for this launch, as the variables its workers get: every machine's must agree.
      const auto theirs = nlohmann::json::parse(what.substr(std::min(what.size(), name.size() + 1)));
      const nlohmann::json ours = settings_to_env(planned.settings);
      for (const auto* side : {&ours, &theirs})
        for (const auto& item : side->items())
          if (ours.value(item.key(), std::string("(unset)")) != theirs.value(item.key(), std::string("(unset)")))
            throw Error(fmt::format("its flags differ from machine 0's: {} is {:?} here, {:?} there; give every "
                                    "machine the same flags",
                                    item.key(), ours.value(item.key(), std::string("(unset)")),
                                    theirs.value(item.key(), std::string("(unset)"))));
      planned.run_id = channel.job_of_last();
      measure(planned, scratch.path() / fmt::format("c{}", runs), m, failure);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (!failure.empty() && !channel.next_is_posted())  // machine 0 stops its part rather than wait for this one's
      channel.report_failure(fmt::format("machine {}: {}", base.machine_rank, text::first_line(failure)));
  }
}

int advise(const LaunchRequest& request, const AdviseOptions& a) {
  // At least one warm-up step: the first one allocates, and the clock starts at a step's end.
  if (a.steps < 1 || a.warmup < 1) throw ConfigError("--steps and --warmup must be 1 or more");
  const LaunchOptions base = plan_launch(without_strategy_hints(request));
  if (base.settings.mixed_precision == MixedPrecision::FP8) throw ConfigError("xlr8 advise: fp8 is not measured yet; advise in bf16");
  if (base.elastic || !base.mpirun_hostfile.empty())
    throw ConfigError("xlr8 advise starts each machine's processes itself: give --num_processes N (and on several "
                      "machines --num_machines, --machine_rank, --main_process_ip, --main_process_port on each)");
  const int n = base.world_size();
  const auto all = chosen_candidates(a, n, base.num_machines);
  std::optional<MachineChannel> channel;
  if (base.num_machines > 1)  // machine 0's last word may come a whole budget after its previous one
    channel.emplace(base.master_addr, base.master_port + 1, base.machine_rank, base.num_machines,
                    std::chrono::milliseconds(static_cast<int64_t>((a.budget_s + 120) * 1000)));
  const Candidate* winner = nullptr;
  if (channel && !channel->leader()) {
    winner = follow(request, a, base, all, *channel);
  } else {
    try {
      winner = lead(request, a, base, all, channel ? &*channel : nullptr);
    } catch (const std::exception& e) {
      if (channel) channel->end(fmt::format("error:{}", e.what()));
      throw;
    }
    if (channel) channel->end("end:" + (winner ? winner->name : std::string()));
  }
  if (!winner) {
    fmt::print("xlr8 advise: no strategy finished its measurement (within the memory per rank); rows above say why\n");
    return 1;
  }
  fmt::print("xlr8 advise: {} on {} processes", winner->name, n);
  if (base.num_machines > 1) fmt::print(" over {} machines", base.num_machines);
  if (!a.output.empty()) {
    write_config(a.output, base, *winner, n);
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
                  "available memory / processes on this machine); peak RSS, which adds the runtime, activations and data, is shown beside it");
  cmd->add_option("--budget_s", a->budget_s, "Time for the whole search, seconds (default 300)")->check(number_in(0, false));
  cmd->add_option("--warmup", a->warmup, "Untimed optimizer steps per strategy (default 2)");
  cmd->add_option("--steps", a->steps, "Timed optimizer steps per strategy, at least (default 3)");
  cmd->add_option("--min_seconds", a->min_seconds, "...and at least this long (default 2)")->check(number_in(0, true));
  cmd->add_option("--cut_below", a->cut_below,
                  "Stop a candidate early once its throughput is below this fraction of the best so far, and do not "
                  "launch one that a run of the same precision, recomputation and mesh shows cannot reach it "
                  "(its forward and backward alone, measured, would be slower) (default 0.7; 0: every candidate runs "
                  "its full measurement)")->check(number_in(0, true));
  cmd->add_option("--try", a->only, "Try only this candidate, by its name in the table (repeat for several)")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--output", a->output, "Write the winner as an Accelerate config file");
  cmd->footer("Usage: xlr8 advise [launch options] [--max_memory_per_rank SIZE] [--output advised.yaml] program [args]\n"
              "Several machines: run it on each with the same flags and its own --machine_rank (and --num_machines, "
              "--main_process_ip, --main_process_port): machine 0 measures, decides and prints the table, the others "
              "launch their part of each candidate (they talk over --main_process_port + 1); HYBRID_SHARD (sharded "
              "inside a machine, replicated across) joins the candidates, and each machine writes its own --output.");
  return [req, a]() { return advise(*req, *a); };
}

}  // namespace xlr8::cli
