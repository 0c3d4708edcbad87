// `xlr8 verify [launch options] program [args]`: the program on N processes as configured and on one process,
// both for K optimizer steps on the same global batch (split_batches) and seed; compares the loss each
// step gave backward(), the global gradient norm and, after step K, every parameter (gathered from shards).
// When they differ and only rounding could part them, a third run on one process that repeats the ranks'
// arithmetic decides (ranks_arithmetic_on_one_process). The workers record through the Accelerator
// (src/diagnostics/verify_recorder.hpp).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/commands.hpp"
#include "cli/scratch_dir.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/safetensors.hpp"
#include "xlr8/env.hpp"

namespace fs = std::filesystem;

namespace xlr8::cli {

namespace {

struct VerifyOptions {
  int steps = 5;
  std::optional<double> rtol;
  std::string keep;  // the runs' records stay here
};

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

// Both runs' steps side by side. The norm is the one before the program's clipping (what its clip_grad_norm
// returned): after it every clipped step reads max_norm.
void print_steps(const nlohmann::json& sa, const nlohmann::json& sb, int world_size) {
  const std::string norm_n = fmt::format("({} processes)", world_size);
  fmt::print("step  loss (1 process)  loss ({} processes)  rel. diff   grad norm before clipping (1)  {}  rel. diff\n",
             world_size, norm_n);
  for (size_t i = 0; i < std::max(sa.size(), sb.size()); ++i) {
    if (i >= sa.size() || i >= sb.size()) {
      fmt::print("{:>4}  {}\n", i + 1, i >= sa.size() ? "(no step on N processes)" : "(no step on 1 process)");
      continue;
    }
    const double la = sa[i]["loss"], lb = sb[i]["loss"], ga = sa[i]["grad_norm"], gb = sb[i]["grad_norm"];
    fmt::print("{:>4}  {:>16.8g}  {:>19.8g}  {:>9.2e}   {:>29.8g}  {:>{}.8g}  {:>9.2e}\n", sb[i]["step"].get<int>(), lb,
               la, relative(la, lb), gb, ga, norm_n.size(), relative(ga, gb));
  }
}

// The relative tolerance for the precision: float32 sums in another order drift by about 1e-6 per step;
// bf16/fp16 round every product.
double default_rtol(MixedPrecision p) { return p == MixedPrecision::NO ? 1e-4 : p == MixedPrecision::BF16 ? 5e-2 : 2e-2; }

struct Recorded {
  nlohmann::json record;
  std::map<std::string, at::Tensor> params;    // "<model>.<name>"
  std::map<std::string, at::Tensor> grad_max;  // one process only: largest |gradient| per element over the steps
  int exit_code = 0;
};

Recorded run_recording(LaunchOptions o, const fs::path& dir, int steps, const std::string& what) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  o.extra_env["XLR8_VERIFY_DIR"] = dir.string();
  o.extra_env["XLR8_VERIFY_STEPS"] = std::to_string(steps);
  o.extra_env["XLR8_SPLIT_BATCHES"] = "1";
  const int ranks = o.world_size();
  o.stop_check = [dir, ranks]() -> std::string {
    return every_rank_done(dir, ranks) ? "every rank recorded its steps" : "";
  };
  fmt::print(stderr, "xlr8 verify: {}: {} process(es), {} step(s)\n", what, ranks, steps);
  Recorded r;
  const auto outcome = launch_with_outcome(o);
  if (outcome.interrupted_by) throw Error(fmt::format("{} was interrupted (signal {})", what, outcome.interrupted_by));
  r.exit_code = outcome.exit_code;
  std::ifstream in(dir / "record.json");
  if (!in && r.exit_code != 0)
    throw Error(fmt::format("{} failed (exit code {}) before its first optimizer step; the launcher's report above "
                            "names the rank and its error",
                            what, r.exit_code));
  if (!in)
    throw Error(fmt::format("{} ended without recording a step: does the program train through xlr8::Accelerator "
                            "(prepare, backward, a prepared optimizer's step)?",
                            what));
  r.record = nlohmann::json::parse(in);
  for (int i = 0; fs::exists(dir / fmt::format("model_{}", i)); ++i)
    for (const auto& entry : fs::directory_iterator(dir / fmt::format("model_{}", i)))
      if (entry.path().extension() == ".safetensors")
        for (auto& [name, t] : load_safetensors(entry.path().string()).tensors)
          r.params[fmt::format("{}{}", i == 0 ? "" : fmt::format("model {}: ", i), name)] = t.to(at::kDouble);
  if (fs::exists(dir / "grad_max.safetensors"))
    for (auto& [name, t] : load_safetensors((dir / "grad_max.safetensors").string()).tensors) r.grad_max[name] = t;
  return r;
}

// Steps whose loss or gradient norm differ beyond rtol; the first such step, or -1.
int first_divergence(const Recorded& a, const Recorded& b, double rtol) {
  const auto& x = a.record["steps"];
  const auto& y = b.record["steps"];
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i)
    if (relative(x[i]["loss"], y[i]["loss"]) > rtol || relative(x[i]["grad_norm"], y[i]["grad_norm"]) > rtol)
      return x[i]["step"];
  return -1;
}

struct ParamDiff {
  std::string name;
  double diff = 0;
};

struct ParamDiffs {
  std::vector<ParamDiff> largest_first;
  int64_t skipped_elements = 0, skipped_tensors = 0;
};

// ||N - 1|| / ||1|| per tensor (L2: one flipped element does not dominate), over the elements whose gradient in
// the one-process run rose above `noise` x the tensor's largest at some step, or stayed exactly zero. The others
// get only rounding for a gradient (an attention key bias: softmax ignores it), which Adam turns into steps of
// the learning rate's size in each run, in directions no two runs share: they cannot be compared, and are
// counted instead.
ParamDiffs param_diffs(const Recorded& a, const Recorded& b, double noise) {
  ParamDiffs out;
  for (const auto& [name, t] : b.params) {
    auto it = a.params.find(name);
    if (it == a.params.end() || !it->second.sizes().equals(t.sizes())) {
      out.largest_first.push_back({name, std::numeric_limits<double>::infinity()});
      continue;
    }
    at::Tensor one = t, many = it->second;
    if (auto g = b.grad_max.find(name); g != b.grad_max.end() && g->second.sizes().equals(t.sizes())) {
      // A gradient of exactly zero (an embedding row no batch used) moves both runs alike: compared.
      const auto compared = g->second.gt(noise * g->second.max().item<double>()).logical_or(g->second.eq(0));
      const int64_t skipped = t.numel() - compared.sum().item<int64_t>();
      if (skipped > 0) {
        out.skipped_elements += skipped, out.skipped_tensors += 1;
        one = t.masked_select(compared), many = many.masked_select(compared);
      }
    }
    const double scale = std::max(one.norm().item<double>(), 1e-12);
    out.largest_first.push_back({name, one.numel() == 0 ? 0.0 : (many - one).norm().item<double>() / scale});
  }
  std::sort(out.largest_first.begin(), out.largest_first.end(), [](auto& x, auto& y) { return x.diff > y.diff; });
  return out;
}

// The parameters one run has and the other lacks (or has in another shape): the program built two models, and
// comparing their values means nothing. "" when both runs built the same names and shapes.
std::string different_models(const Recorded& many, const Recorded& one) {
  std::vector<std::string> only_many, only_one;
  for (const auto& [name, t] : many.params)
    if (auto it = one.params.find(name); it == one.params.end() || !it->second.sizes().equals(t.sizes()))
      only_many.push_back(name);
  for (const auto& [name, t] : one.params)
    if (!many.params.count(name)) only_one.push_back(name);
  if (only_many.empty() && only_one.empty()) return "";
  auto some = [](const std::vector<std::string>& names) {
    return names.empty() ? std::string("none")
                         : fmt::format("{}{}", fmt::join(names.begin(), names.begin() + std::min<long>(3, names.size()), ", "),
                                       names.size() > 3 ? fmt::format(" and {} more", names.size() - 3) : "");
  };
  return fmt::format("the two runs built different models (parameters of run 1 that run 2 lacks or has in another "
                     "shape: {}; only in run 2: {}): the program chooses its model by the launch's layout; give it "
                     "an option that builds the same model on one process (examples/gpt: --pipeline)",
                     some(only_many), some(only_one));
}

std::string listed(const nlohmann::json& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", " : "") + names[i].get<std::string>();
  if (names.size() > 5) out += fmt::format(" and {} more", names.size() - 5);
  return out;
}

// What parts run 1 from a one-process reference: the first step whose loss or gradient norm differ, missing
// steps, the largest parameter difference (`diffs`, largest first).
std::vector<std::string> disagreements(const Recorded& a, const Recorded& ref, const std::vector<ParamDiff>& diffs,
                                       int steps, double rtol) {
  std::vector<std::string> problems;
  const auto& sa = a.record["steps"];
  const auto& sr = ref.record["steps"];
  if (const int diverged = first_divergence(a, ref, rtol); diverged >= 0)
    problems.push_back(
        fmt::format("step {} is the first whose loss or gradient norm differ by more than {:.0e}", diverged, rtol));
  if (sa.size() != sr.size() || static_cast<int>(sr.size()) < steps)
    problems.push_back(fmt::format("the runs recorded {} and {} of {} steps", sa.size(), sr.size(), steps));
  if (!diffs.empty() && diffs.front().diff > rtol)
    problems.push_back(
        fmt::format("parameter {} differs by {:.2e} after step {}", diffs.front().name, diffs.front().diff, steps));
  if (diffs.empty() && static_cast<int>(sr.size()) >= steps) problems.push_back("no parameters were recorded");
  return problems;
}

int print_pass(const Recorded& a, int processes, int steps, double rtol, const std::string& against) {
  fmt::print("xlr8 verify: PASS: {} processes train as one process for {} steps (against {}; relative tolerance "
             "{:.0e}; --rtol to change)\n",
             processes, steps, against, rtol);
  if (!a.record["differs_at_start"].empty())
    fmt::print("xlr8 verify: note: parameters differed across ranks before prepare() ({}); the strategy made them "
               "equal, but a program that uses them before prepare() would not\n",
               listed(a.record["differs_at_start"]));
  return 0;
}

// The largest relative difference of loss or gradient norm between two runs, and its step.
std::pair<double, int> largest_step_difference(const Recorded& x, const Recorded& y) {
  std::pair<double, int> out{0.0, 0};
  const auto& sx = x.record["steps"];
  const auto& sy = y.record["steps"];
  for (size_t i = 0; i < std::min(sx.size(), sy.size()); ++i)
    for (const char* key : {"loss", "grad_norm"})
      if (const double d = relative(sx[i][key], sy[i][key]); d > out.first) out = {d, sx[i]["step"].get<int>()};
  return out;
}

struct ThirdRun {
  bool agrees = false;
  std::string finding;  // what it showed, for the verdict
};

// How far rounding by batch size may move a step's loss or gradient norm, in units of rtol (the Fashion-MNIST
// example's ReLU/max-pool near-tie on an AVX2 CPU moved a gradient norm by 9.1e-4: 9 x 1e-4).
constexpr double kRoundingBound = 100;

// Run 3, when nothing but rounding may part runs 1 and 2 (no dropout, BatchNorm or unevenly shared last batch,
// whose effects it would repeat, and ranks that share batches): one process that repeats the ranks' arithmetic,
// each global batch as the N ranks' shares in rank order, accumulated into one step (XLR8_VERIFY_MICRO_SPLIT).
// Convolution and GEMM kernels round by batch size, so one process on the whole batch may differ from N ranks by
// more than a sum's order (near a ReLU or max-pool tie, by far more); run 3 differs from them only by the order
// of the gradient sum.
ThirdRun ranks_arithmetic_on_one_process(LaunchOptions one, const fs::path& dir, const Recorded& a, const Recorded& b,
                                         int steps, double rtol) {
  const int ranks = a.record.value("data_parallel", 1);
  const auto& sa = a.record["steps"];
  const bool uneven = std::any_of(sa.begin(), sa.end(), [](const auto& s) { return s.value("short_batch", 0) > 0; });
  if (ranks < 2 || !a.record["dropout"].empty() || !a.record["batchnorm"].empty() || uneven) return {};
  one.extra_env["XLR8_VERIFY_MICRO_SPLIT"] = std::to_string(ranks);
  const std::string what =
      fmt::format("run 3 (one process, each global batch as the {} ranks' shares, accumulated)", ranks);
  Recorded c;
  try {
    c = run_recording(one, dir, steps, what);
  } catch (const Error& e) {
    return {false, fmt::format("{} could not run: {}", what, e.what())};
  }
  const auto& sc = c.record["steps"];
  for (size_t i = 0; i < std::min(sa.size(), sc.size()); ++i)  // N x the ranks' micro-steps make each of its steps
    if (const int m = sa[i].value("micro_steps", 0); sc[i].value("micro_steps", 0) != ranks * m)
      return {false, fmt::format("{} could not repeat the ranks' arithmetic: its step {} took {} micro-batches, not "
                                 "{} x {} (does the program step inside Accelerator::accumulate()?)",
                                 what, i + 1, sc[i].value("micro_steps", 0), ranks, m)};
  const auto diffs = param_diffs(a, c, rtol / 10).largest_first;
  if (const auto problems = disagreements(a, c, diffs, steps, rtol); !problems.empty())
    return {false, fmt::format("{} differs from run 1 as well: {}; so not the rounding of the batch size", what,
                               fmt::join(problems, "; "))};
  // The rounding floor: how far one process on the whole batch lies from one on the ranks' shares.
  const auto [worst, worst_step] = largest_step_difference(b, c);
  // Run 3 shares the ranks' batch sharding: beyond rounding's size it would hide a sharding bug, not a kernel's.
  if (worst > kRoundingBound * rtol)
    return {false, fmt::format("{} agrees with run 1, but run 2 (the whole global batch at once) differs from it by "
                               "{:.2e} at step {}, more than rounding ({} x {:.0e}): the ranks' shares may not add up "
                               "to the global batch",
                               what, worst, worst_step, kRoundingBound, rtol)};
  std::string in_params;
  if (const auto d = param_diffs(b, c, rtol / 10).largest_first; !d.empty())
    in_params = fmt::format(", {} by {:.2e} after step {}", d.front().name, d.front().diff, steps);
  return {true, fmt::format("run 2 (one process, the whole global batch at once) differs from run 3 by up to {:.2e} "
                            "(step {}){}: the rounding floor here (convolution and GEMM kernels round by batch size), "
                            "not the strategy; run 1 agrees with run 3 within {:.0e}",
                            worst, worst_step, in_params, rtol)};
}

// Why runs 1 and 2 differ: the usual causes, most certain first. A program with dropout runs once more on one
// process, to tell randomness that differs by rank from a program that is not deterministic at all.
std::vector<std::string> usual_causes(const Recorded& a, const Recorded& b, const LaunchOptions& one,
                                      const fs::path& base, int steps, double rtol, int processes) {
  const auto& sa = a.record["steps"];
  const int diverged = first_divergence(a, b, rtol);
  std::vector<std::string> causes;
  if (diverged >= 0 && diverged <= static_cast<int>(sa.size()))
    if (const int64_t rest = sa[static_cast<size_t>(diverged - 1)].value("short_batch", int64_t{0}); rest > 0)
      causes.push_back(fmt::format("step {} ends an epoch whose last global batch has {} samples, which {} ranks cannot "
                                   "share evenly: a loss averaged per rank weighs their samples unequally (and "
                                   "even_batches repeats samples to fill the shares); average the loss over the global "
                                   "batch, or drop the last batch (drop_last)",
                                   diverged, rest, processes));
  if (!a.record["differs_at_start"].empty())
    causes.push_back(fmt::format("the model differs across ranks at start: {} (initialise it from one seed on every "
                                 "rank: Accelerator::set_seed before building it)",
                                 listed(a.record["differs_at_start"])));
  if (!a.record["batchnorm"].empty())
    causes.push_back(fmt::format("BatchNorm normalises each rank's share of the batch by that share's statistics, and "
                                 "keeps running statistics per rank: {} (SyncBatchNorm, or GroupNorm/LayerNorm)",
                                 listed(a.record["batchnorm"])));
  if (!a.record["dropout"].empty()) {
    const auto again =
        run_recording(one, base / "one-again", steps, "run 3 (one process again, to tell randomness from divergence)");
    const bool deterministic = first_divergence(again, b, 1e-12) < 0;
    causes.push_back(deterministic
                         ? fmt::format("dropout draws its masks from each rank's generator, so N ranks drop other "
                                       "elements than one process does: {} (verify with dropout off, p = 0)",
                                       listed(a.record["dropout"]))
                         : fmt::format("the program is not deterministic on one process (two runs differ), so no "
                                       "comparison can pass: seed every generator (Accelerator::set_seed) or turn off "
                                       "dropout ({})",
                                       listed(a.record["dropout"])));
  }
  return causes;
}

// The reference: one process, nothing split; the same precision, accumulation and program.
LaunchOptions one_process(LaunchRequest single) {
  single.num_processes = 1;
  single.nproc_per_node.reset();
  single.nnodes.reset();
  single.num_machines = 1;
  single.machine_rank.reset();
  single.parallelism.clear();
  single.max_restarts = 0;
  return plan_launch(single);
}

int verify(const LaunchRequest& request, const VerifyOptions& v) {
  if (v.steps < 1) throw ConfigError(fmt::format("--steps {} must be 1 or more", v.steps));
  LaunchOptions many = plan_launch(request);
  resolve_program(many.command.front());  // a missing program is named before the process counts
  if (many.elastic || !many.mpirun_hostfile.empty() || many.num_machines > 1)
    throw ConfigError("xlr8 verify runs both programs on this machine: give --num_processes N alone (no machines, "
                      "rendezvous or mpirun host file)");
  if (many.world_size() < 2)
    throw ConfigError(fmt::format("xlr8 verify compares N processes with one; this launch has {}: give "
                                  "--num_processes 2 or more",
                                  many.world_size()));
  LaunchOptions one = one_process(request);
  many.max_restarts = 0;
  // The same intra-op threads in every process of both runs: float sums over another number of threads
  // differ in the last bits, which AdamW's first steps amplify.
  if (!many.extra_env.count("OMP_NUM_THREADS")) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    many.extra_env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(many.world_size())));
  }
  one.extra_env["OMP_NUM_THREADS"] = many.extra_env["OMP_NUM_THREADS"];

  const double rtol = v.rtol.value_or(default_rtol(many.settings.mixed_precision));
  if (!(rtol >= 0 && std::isfinite(rtol)))  // a NaN bound compares false with every difference: all would pass
    throw ConfigError(fmt::format("--rtol {} must be a finite relative tolerance of 0 or more (e.g. 1e-4)", rtol));
  const auto scratch = v.keep.empty() ? std::make_unique<ScratchDir>("verify") : std::make_unique<ScratchDir>();
  const fs::path base = v.keep.empty() ? scratch->path() : fs::path(v.keep);

  const auto a = run_recording(many, base / "n", v.steps, fmt::format("run 1 (as configured)"));
  auto b = run_recording(one, base / "one", v.steps, "run 2 (one process, the same global batch)");
  // Tests only: run 2's gradient norms as on a CPU whose kernels round the whole batch far off.
  if (const auto nudge = env_var("XLR8_TEST_ONLY_VERIFY_NUDGE_RUN_2"))
    for (auto& step : b.record["steps"]) step["grad_norm"] = step["grad_norm"].get<double>() * (1 + std::atof(nudge->c_str()));
  print_steps(a.record["steps"], b.record["steps"], many.world_size());
  // Only runs that recorded their models (a run that stopped early has none: disagreements() names that).
  if (const auto differ = a.params.empty() || b.params.empty() ? "" : different_models(a, b); !differ.empty()) {
    fmt::print("xlr8 verify: FAIL: {}\n", differ);
    return 1;
  }
  // Gradients below this share of their tensor's largest are rounding at this precision.
  const double noise = rtol / 10;
  const auto compared = param_diffs(a, b, noise);
  const auto& diffs = compared.largest_first;
  if (!diffs.empty()) {
    fmt::print("largest parameter differences after step {} (||N - 1|| / ||1||):\n", v.steps);
    for (size_t i = 0; i < diffs.size() && i < 5; ++i) fmt::print("  {:<40} {:.2e}\n", diffs[i].name, diffs[i].diff);
  }
  if (compared.skipped_elements > 0)
    fmt::print("not compared: {} element(s) of {} tensor(s) whose gradient on one process was never zero nor above {:.0e} x "
               "their tensor's largest (rounding: Adam turns it into steps of the learning rate's size in each run)\n",
               compared.skipped_elements, compared.skipped_tensors, noise);

  const auto problems = disagreements(a, b, diffs, v.steps, rtol);
  if (problems.empty())
    return print_pass(a, many.world_size(), v.steps, rtol, "run 2, one process on the whole global batch");
  const auto causes = usual_causes(a, b, one, base, v.steps, rtol, many.world_size());
  // Only rounding may part the runs: does one process that repeats the ranks' arithmetic agree?
  const auto third = ranks_arithmetic_on_one_process(one, base / "ranks", a, b, v.steps, rtol);
  if (third.agrees) {
    print_pass(a, many.world_size(), v.steps, rtol, "run 3, one process on the ranks' shares accumulated");
    fmt::print("xlr8 verify: note: {}\n", third.finding);
    return 0;
  }
  fmt::print("xlr8 verify: FAIL: {}\n", fmt::join(problems, "; "));
  if (!third.finding.empty()) fmt::print("xlr8 verify: {}\n", third.finding);
  for (const auto& c : causes) fmt::print("xlr8 verify: likely cause: {}\n", c);
  if (causes.empty())
    fmt::print("xlr8 verify: no usual cause found (dropout, BatchNorm, a model that differs across ranks, an uneven "
               "last batch): a strategy bug, or randomness of the program's own; rerun with --keep DIR to keep the "
               "records\n");
  return 1;
}

}  // namespace

Handler add_verify(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify", "Check that the program trains on N processes as on one (same global batch)");
  auto req = std::make_shared<LaunchRequest>();
  auto v = std::make_shared<VerifyOptions>();
  add_launch_options(cmd, req);
  cmd->add_option("--steps", v->steps, "Optimizer steps to compare (default 5)");
  cmd->add_option("--rtol", v->rtol,
                  "Relative tolerance for losses, gradient norms and parameters (default 1e-4; bf16 5e-2; fp16 2e-2)");
  cmd->add_option("--keep", v->keep, "Keep the runs' records (record.json, model_<i>/) in this folder");
  cmd->footer("Usage: xlr8 verify [launch options] [--steps K] program [args...]\n"
              "Runs the program as configured and on one process, each for K optimizer steps, with the batch split\n"
              "between the processes (the program's batch size is the global batch: it must divide by N) and the\n"
              "same intra-op threads per process, and compares them step by step: the loss given to backward()\n"
              "(averaged as over the global batch), the global gradient norm, and after step K every parameter\n"
              "(||N - 1|| / ||1|| per tensor, over the elements whose gradient on one process rose above rtol/10\n"
              "x the tensor's largest). Tensor- and context-parallel launches are compared with one process\n"
              "without a mesh.\n"
              "When they differ with none of the usual causes, a third run on one process repeats the ranks'\n"
              "arithmetic (each global batch as the N ranks' shares, accumulated): kernels round by batch size, so\n"
              "when it agrees with the N processes the verdict passes against it and shows the rounding floor.\n"
              "Exit code 0 when all agree within --rtol, 1 otherwise, naming the first step that differs and the\n"
              "usual causes it finds (dropout, BatchNorm, a model that differs across ranks at start).");
  return [req, v]() { return verify(*req, *v); };
}

}  // namespace xlr8::cli
