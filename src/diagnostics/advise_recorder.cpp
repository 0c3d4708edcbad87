#include "diagnostics/advise_recorder.hpp"

#include <fmt/format.h>
#include <torch/nn/module.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "checkpoint/files.hpp"
#include "checkpoint/optimizer_state.hpp"
#include "distributed/collective_timing.hpp"
#include "parallel/sequence/cp_ring.hpp"
#include "parallel/tensor/tp_layer_kinds.hpp"
#include "step/training_view.hpp"
#include "diagnostics/memory_meter.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/tensor_parallel.hpp"
#include "xlr8/env.hpp"

namespace xlr8::diagnostics {

namespace {

// The process' peak resident set (VmHWM), in bytes.
double peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024;  // "VmHWM:   123 kB"
  return 0;
}

// Bytes of parameters, gradients and optimizer state this rank holds now: each storage once (a DDP
// gradient is a view of its bucket; a sharded strategy's optimizer steps flat shards).
double static_bytes(const step::TrainingView& training) {
  std::set<const void*> seen;
  double total = 0;
  auto count = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const auto& storage = t.storage();
    if (storage.nbytes() == 0 || !seen.insert(storage.data()).second) return;
    total += static_cast<double>(storage.nbytes());
  };
  for (const auto& model : training.models)
    for (const auto& p : model->module()->parameters()) count(p), count(p.grad());
  for (const auto* optimizer : training.optimizers) {
    const bool portable = checkpoints::portable_optimizer_kind(*optimizer).has_value();
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) {
        count(p);
        count(p.grad());
        if (!portable) continue;
        if (auto state = checkpoints::read_parameter_state(*optimizer, p))
          for (const auto& [name, t] : state->tensors) count(t);
      }
  }
  return total;
}

// Samples per optimizer step over every rank (the first prepared loader's); 0 without a prepared loader.
double samples_per_step(const step::TrainingView& training) {
  if (training.loaders.empty()) return 0;
  const auto& loader = training.loaders.front();
  return static_cast<double>(loader->options().batch_size) *
         (training.plan.split_batches ? 1 : loader->sharding().num_processes) * training.accumulation_steps;
}

// What tensor parallelism of each size the world allows would do to this (whole) model: the parameters
// AutoTP's plan slices ({"2": {"sliced": N}, ...}), or why it cannot ({"error": ...}).
nlohmann::json tensor_parallel_options(const torch::nn::Module& module, int world) {
  nlohmann::json out = nlohmann::json::object();
  if (const auto layouts = tp::slice_layouts(module); !layouts.empty()) {  // split already (this run has tp)
    double sliced = 0;
    for (const auto& [name, layout] : layouts)
      sliced += static_cast<double>(layout.placement.whole_numel());
    for (int tp : {2, 4})
      if (tp <= world && world % tp == 0) out[std::to_string(tp)] = {{"sliced", sliced}};
    return out;
  }
  for (int tp : {2, 4}) {
    if (tp > world || world % tp != 0) continue;
    try {
      const auto plan = tp::auto_plan(module, tp);
      double sliced = 0;
      for (const auto& item : module.named_modules())
        for (const auto& entry : plan) {
          if (!tp::path_matches(entry.pattern, item.key())) continue;
          if (tp::detail::is_plain_torch_layer(*item.value()))
            return {{"error", fmt::format("'{}' is LibTorch's own {}, which tensor parallelism cannot split (use the "
                                          "xlr8::nn layer of that name)",
                                          item.key(), item.value()->name())}};
          if (entry.style == tp::Style::Colwise || entry.style == tp::Style::VocabParallel)
            for (const auto& p : item.value()->parameters(/*recurse=*/false)) sliced += static_cast<double>(p.numel());
          if (entry.style == tp::Style::Rowwise)  // the bias stays whole
            if (const auto own = item.value()->named_parameters(/*recurse=*/false); own.contains("weight"))
              sliced += static_cast<double>(own["weight"].numel());
          break;
        }
      if (sliced == 0) return {{"error", "AutoTP finds no layer to split (tensor parallelism needs xlr8::nn layers)"}};
      out[std::to_string(tp)] = {{"sliced", sliced}};
    } catch (const std::exception& e) {
      if (out.empty()) return {{"error", e.what()}};
    }
  }
  return out;
}

// For each pp size the world allows (2 and 4, dividing it, at most the layers): the largest stage's parameters when
// a pipeline cuts the model, a torch::nn::Sequential, by parameters ({"2": N, ...}); empty for another model. Under
// a pipeline (`stages`: its group) each layer's count comes from the stage that holds it.
nlohmann::json pipeline_options(const torch::nn::Module& module, int world, Communicator* stages, at::Device device) {
  nlohmann::json out = nlohmann::json::object();
  const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(&module);
  if (!sequential) return out;
  std::vector<int64_t> counts;
  for (const auto& layer : sequential->children()) {
    int64_t n = 0;
    for (const auto& p : layer->parameters()) n += p.numel();
    counts.push_back(n);
  }
  if (stages && !counts.empty()) {
    auto summed = at::tensor(counts, at::kLong).to(device);
    stages->all_reduce(summed, ReduceOp::SUM);
    summed = summed.cpu();
    counts.assign(summed.data_ptr<int64_t>(), summed.data_ptr<int64_t>() + summed.numel());
  }
  for (int stages : {2, 4}) {
    if (world % stages != 0 || stages > static_cast<int>(counts.size())) continue;
    int64_t largest = 0;
    for (const auto& [first, last] : pp::partition(counts, stages, pp::Partition::Parameters))
      largest = std::max(largest, std::accumulate(counts.begin() + static_cast<long>(first),
                                                  counts.begin() + static_cast<long>(last), int64_t{0}));
    out[std::to_string(stages)] = largest;
  }
  return out;
}

}  // namespace

std::unique_ptr<AdviseRecorder> AdviseRecorder::from_env() {
  const auto dir = env_var("XLR8_ADVISE_DIR");
  if (!dir) return nullptr;
  auto r = std::make_unique<AdviseRecorder>();
  r->dir_ = *dir;
  if (const auto w = env_var("XLR8_ADVISE_WARMUP")) r->warmup_ = std::max(0L, std::strtol(w->c_str(), nullptr, 10));
  if (const auto t = env_var("XLR8_ADVISE_STEPS")) r->steps_ = std::max(0L, std::strtol(t->c_str(), nullptr, 10));
  if (const auto s = env_var("XLR8_ADVISE_MIN_SECONDS")) r->min_seconds_ = std::max(0.0, std::strtod(s->c_str(), nullptr));
  if (const auto c = env_var("XLR8_ADVISE_CUT_BELOW")) r->cut_below_ = std::max(0.0, std::strtod(c->c_str(), nullptr));
  std::filesystem::create_directories(r->dir_);
  r->started_ = std::chrono::steady_clock::now();
  return r;
}

// Each machine's advise reads its own folder: the first rank of each machine writes there (the figures are
// the world's, all-reduced), every rank its done.<local rank>. Then the rank waits to be stopped: a rank that
// went on would enter a collective whose peers on another machine are being stopped, and fail.
void AdviseRecorder::finish(const step::TrainingView& training, const std::string& file, const std::string& text) {
  const int local_rank = training.process.local_rank();
  if (local_rank == 0) files::write_durably(fmt::format("{}/{}", dir_, file), text);
  std::ofstream(fmt::format("{}/done.{}", dir_, local_rank)) << "done\n";
  std::this_thread::sleep_for(std::chrono::seconds(60));
  throw Error(fmt::format("rank {}: xlr8 advise did not stop this run within 60 s of its measurement (XLR8_ADVISE_DIR={})",
                          training.process.rank(), dir_));
}

void AdviseRecorder::on_prepare(const step::TrainingView& training, torch::nn::Module& module, bool) {
  if (steps_ > 0) memory_meter::install(training.device);  // before the strategy allocates its buffers
  // Whole sizes: a tensor-parallel run holds slices; a pipeline's stage holds its layers (the others' are empty
  // stand-ins), so its stages' counts are summed.
  auto& mesh = training.process.mesh();
  Communicator* stages = mesh.size(MeshDim::pp) > 1 ? &mesh.group(MeshDim::pp) : nullptr;
  double own = 0;
  for (const auto& [name, placement] : tp::parameter_placements(module)) own += static_cast<double>(placement.whole_numel());
  if (stages) {
    auto sum = at::full({1}, own, at::kDouble).to(training.device);
    stages->all_reduce(sum, ReduceOp::SUM);
    own = sum.item<double>();
  }
  parameters_ += own;
  if (std::exchange(probed_, true)) return;
  const std::string probe =
      nlohmann::json{{"parameters", parameters_},
                     {"tensor_parallel", tensor_parallel_options(module, training.world().size())},
                     {"pipeline", pipeline_options(module, training.world().size(), stages, training.device)}}
          .dump();
  if (steps_ == 0) return finish(training, "probe.json", probe);
  if (training.process.local_rank() == 0) files::write_durably(fmt::format("{}/probe.json", dir_), probe);
}

void AdviseRecorder::optimizer_step_begins() {
  optimizer_began_ = std::chrono::steady_clock::now();
  optimizer_wait_began_ = distributed::collective_wait_ns();
}

// Optimizer steps follow one another on the training thread. A step skipped for an fp16 overflow counts too:
// its time is the optimizer's, and the forward and backward before it stay in the window without a step to show.
void AdviseRecorder::optimizer_step_ends() {
  if (!in_window_) return;
  optimizer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - optimizer_began_).count();
  optimizer_waited_ns_ += distributed::collective_wait_ns() - optimizer_wait_began_;
}

void AdviseRecorder::after_update(const step::TrainingView& training, int64_t step) {
  if (steps_ == 0 || measured_) return;
  const auto now = std::chrono::steady_clock::now();
  const int64_t waited_now = distributed::collective_wait_ns();
  if (step == warmup_) start_window(training);
  if (step <= warmup_) return;
  const int64_t timed = step - warmup_;
  const double seconds = std::chrono::duration<double>(now - started_).count();
  const double waited_outside = static_cast<double>(waited_now - waited_at_start_ - optimizer_waited_ns_) / 1e9;
  const double compute_seconds = std::max(0.0, seconds - optimizer_seconds_ - waited_outside);
  const double samples = samples_per_step(training);
  const double throughput = (samples > 0 ? samples : 1.0) * static_cast<double>(timed) / std::max(seconds, 1e-9);
  double verdict = 0;
  if (training.process.rank() == 0)
    verdict = timed >= steps_ && seconds >= min_seconds_ ? 2 : cut_below_ > 0 && throughput < cut_below_ ? 1 : 0;
  conclude(training, verdict, timed, seconds, compute_seconds);
}

void AdviseRecorder::start_window(const step::TrainingView& training) {
  state_at_start_ = static_bytes(training);
  memory_meter::reset_peak(training.device);
  live_at_start_ = memory_meter::read(training.device).live;
  waited_at_start_ = distributed::collective_wait_ns();
  optimizer_waited_ns_ = 0;
  optimizer_seconds_ = 0;
  in_window_ = true;
  started_ = std::chrono::steady_clock::now();
}

void AdviseRecorder::conclude(const step::TrainingView& training, double verdict, int64_t timed, double seconds,
                              double compute_seconds) {
  // Rank 0's clock decides for all: 2 stops after the timed steps, 1 stops early (too slow to win).
  auto flag = at::full({1}, verdict, at::kDouble).to(training.device);
  training.world().all_reduce(flag, ReduceOp::MAX);
  verdict = flag.item<double>();
  if (verdict == 0) return;
  measured_ = true;
  const double peak_tensors = state_at_start_ + static_cast<double>(memory_meter::read(training.device).peak - live_at_start_);
  // One MAX over the world; the compute time negated, so that it comes back as the smallest.
  auto measured =
      at::tensor({static_bytes(training), peak_rss_bytes(), peak_tensors, -compute_seconds}, at::kDouble).to(training.device);
  training.world().all_reduce(measured, ReduceOp::MAX);
  measured = measured.cpu();
  finish(training, "result.json",
         nlohmann::json{{"parameters", parameters_},
                        {"seconds", seconds},
                        {"steps", timed},
                        {"samples_per_step", samples_per_step(training)},
                        {"cut", verdict == 1},
                        {"attention_calls", cp::detail::entry_calls()},
                        {"pipeline_steps", training.pipeline_steps},
                        {"static_bytes", measured[0].item<double>()},
                        {"peak_rss", measured[1].item<double>()},
                        {"peak_tensor_bytes", measured[2].item<double>()},
                        {"compute_seconds", -measured[3].item<double>()}}
             .dump());
}

}  // namespace xlr8::diagnostics
