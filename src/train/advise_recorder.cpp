#include "train/advise_recorder.hpp"

#include <fmt/format.h>
#include <torch/nn/module.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <sstream>

#include "checkpoint/files.hpp"
#include "checkpoint/optimizer_state.hpp"
#include "train/accelerator_impl.hpp"

namespace xlr8::detail {

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
double static_bytes(const AcceleratorImpl& impl) {
  std::set<const void*> seen;
  double total = 0;
  auto count = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const auto& storage = t.storage();
    if (storage.nbytes() == 0 || !seen.insert(storage.data()).second) return;
    total += static_cast<double>(storage.nbytes());
  };
  for (const auto& model : impl.models)
    for (const auto& p : model->module()->parameters()) count(p), count(p.grad());
  for (const auto& o : impl.optimizers) {
    const bool portable = checkpoints::portable_optimizer_kind(*o->optimizer).has_value();
    for (const auto& group : o->optimizer->param_groups())
      for (const auto& p : group.params()) {
        count(p);
        count(p.grad());
        if (!portable) continue;
        if (auto state = checkpoints::read_parameter_state(*o->optimizer, p))
          for (const auto& [name, t] : state->tensors) count(t);
      }
  }
  return total;
}

// Samples per optimizer step over every rank (the first prepared loader's); 0 without a prepared loader.
double samples_per_step(const AcceleratorImpl& impl) {
  for (const auto& weak : impl.loaders)
    if (auto loader = weak.lock()) {
      const auto& o = loader->options();
      return static_cast<double>(o.batch_size) * (impl.options.split_batches ? 1 : loader->sharding().num_processes) *
             impl.gradient_state->num_steps;
    }
  return 0;
}

}  // namespace

std::unique_ptr<AdviseRecorder> AdviseRecorder::from_env() {
  const char* dir = std::getenv("XLR8_ADVISE_DIR");
  if (!dir || !*dir) return nullptr;
  auto r = std::make_unique<AdviseRecorder>();
  r->dir_ = dir;
  if (const char* w = std::getenv("XLR8_ADVISE_WARMUP"); w && *w) r->warmup_ = std::max(0L, std::strtol(w, nullptr, 10));
  if (const char* t = std::getenv("XLR8_ADVISE_STEPS"); t && *t) r->steps_ = std::max(0L, std::strtol(t, nullptr, 10));
  if (const char* s = std::getenv("XLR8_ADVISE_MIN_SECONDS"); s && *s) r->min_seconds_ = std::max(0.0, std::strtod(s, nullptr));
  if (const char* c = std::getenv("XLR8_ADVISE_CUT_BELOW"); c && *c) r->cut_below_ = std::max(0.0, std::strtod(c, nullptr));
  std::filesystem::create_directories(r->dir_);
  r->started_ = std::chrono::steady_clock::now();
  return r;
}

void AdviseRecorder::finish(AcceleratorImpl& impl, const std::string& file, const std::string& text) {
  const int rank = impl.state->rank();
  if (rank == 0) files::write_durably(fmt::format("{}/{}", dir_, file), text);
  std::ofstream(fmt::format("{}/done.{}", dir_, rank)) << "done\n";
}

void AdviseRecorder::on_prepare(AcceleratorImpl& impl, torch::nn::Module& module) {
  for (const auto& p : module.parameters()) parameters_ += static_cast<double>(p.numel());
  if (std::exchange(probed_, true)) return;
  const std::string probe = nlohmann::json{{"parameters", parameters_}}.dump();
  if (steps_ == 0) return finish(impl, "probe.json", probe);
  if (impl.state->rank() == 0) files::write_durably(fmt::format("{}/probe.json", dir_), probe);
}

void AdviseRecorder::after_step(AcceleratorImpl& impl, int64_t step) {
  if (steps_ == 0 || measured_) return;
  if (step == warmup_) started_ = std::chrono::steady_clock::now();
  if (step <= warmup_) return;
  const int64_t timed = step - warmup_;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  const double samples = samples_per_step(impl);
  const double throughput = (samples > 0 ? samples : 1.0) * static_cast<double>(timed) / std::max(seconds, 1e-9);
  // Rank 0's clock decides for all: 2 stops after the timed steps, 1 stops early (too slow to win).
  double verdict = 0;
  if (impl.state->rank() == 0)
    verdict = timed >= steps_ && seconds >= min_seconds_ ? 2 : cut_below_ > 0 && throughput < cut_below_ ? 1 : 0;
  auto flag = at::full({1}, verdict, at::kDouble).to(impl.device);
  impl.world().all_reduce(flag, ReduceOp::MAX);
  verdict = flag.item<double>();
  if (verdict == 0) return;
  measured_ = true;
  auto measured = at::tensor({static_bytes(impl), peak_rss_bytes()}, at::kDouble).to(impl.device);
  impl.world().all_reduce(measured, ReduceOp::MAX);
  measured = measured.cpu();
  finish(impl, "result.json",
         nlohmann::json{{"parameters", parameters_},
                        {"seconds", seconds},
                        {"steps", timed},
                        {"samples_per_step", samples},
                        {"cut", verdict == 1},
                        {"static_bytes", measured[0].item<double>()},
                        {"peak_rss", measured[1].item<double>()}}
             .dump());
}

}  // namespace xlr8::detail
