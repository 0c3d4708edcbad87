#include "diagnostics/verify_recorder.hpp"

#include <fmt/format.h>
#include <torch/nn/module.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "checkpoint/files.hpp"
#include "step/training_view.hpp"
#include "xlr8/tensor_parallel.hpp"
#include "xlr8/error.hpp"
#include "xlr8/safetensors.hpp"
#include "xlr8/env.hpp"

namespace xlr8::diagnostics {

namespace {

// Before the parameter names of every model but the first, as cmd_verify.cpp names what it loads.
std::string model_prefix(int model) { return model == 0 ? "" : fmt::format("model {}: ", model); }

}  // namespace

std::unique_ptr<VerifyRecorder> VerifyRecorder::from_env() {
  const auto dir = env_var("XLR8_VERIFY_DIR");
  if (!dir) return nullptr;
  auto r = std::make_unique<VerifyRecorder>();
  r->dir_ = *dir;
  if (const auto k = env_var("XLR8_VERIFY_STEPS")) r->steps_ = std::max(1L, std::strtol(k->c_str(), nullptr, 10));
  if (const auto m = env_var("XLR8_VERIFY_MICRO_SPLIT"))
    r->micro_split_ = static_cast<int>(std::max(1L, std::strtol(m->c_str(), nullptr, 10)));
  r->record_ = {{"steps", nlohmann::json::array()},
                {"differs_at_start", nlohmann::json::array()},
                {"dropout", nlohmann::json::array()},
                {"batchnorm", nlohmann::json::array()}};
  std::filesystem::create_directories(r->dir_);
  return r;
}

void VerifyRecorder::on_prepare(const step::TrainingView& training, torch::nn::Module& module, bool values_everywhere) {
  const std::string prefix = model_prefix(models_);
  ++models_;
  for (const auto& item : module.named_modules()) {
    const std::string type = item.value()->name();
    const std::string name = prefix + (item.key().empty() ? "(the model)" : item.key());
    if (type.find("Dropout") != std::string::npos && item.value()->is_training())
      record_["dropout"].push_back(fmt::format("{} ({})", name, type));
    if (type.find("BatchNorm") != std::string::npos) record_["batchnorm"].push_back(fmt::format("{} ({})", name, type));
  }
  // Two sums per parameter, compared by MIN and MAX over the ranks: equal everywhere, or not. A tensor-parallel
  // slice is compared with the same slice on the other replicas only (the ranks outside its tp group). Under pp a
  // rank holds its stage's parameters and empty stand-ins for the others': only holders take part (one that does
  // not offers +inf to MIN and -inf to MAX), and every rank's verdicts are joined.
  auto params = module.named_parameters();
  if (params.size() == 0 || !values_everywhere) return;
  const auto sliced = tp::sliced_parameters(module);
  std::vector<at::Tensor> sums, held, held_sliced;
  for (const auto& p : params) {
    auto values = p.value().detach().to(at::kCPU, at::kDouble);
    sums.push_back(at::stack({values.sum(), values.pow(2).sum()}));
    const bool holds = values.numel() > 0, slice = sliced.contains(p.value());
    held.push_back(at::full({2}, holds && !slice, at::kBool));
    held_sliced.push_back(at::full({2}, holds && slice, at::kBool));
  }
  const double inf = std::numeric_limits<double>::infinity();
  const auto mine = at::stack(sums);
  auto differs_over = [&](Communicator& group, const std::vector<at::Tensor>& holding) {
    const auto holds = at::stack(holding);
    auto low = at::where(holds, mine, inf).to(training.device), high = at::where(holds, mine, -inf).to(training.device);
    group.all_reduce(low, ReduceOp::MIN);
    group.all_reduce(high, ReduceOp::MAX);
    return low.ne(high).logical_and(low.le(high)).any(1);  // nobody holds it: low +inf above high -inf
  };
  auto& mesh = training.process.mesh();
  auto differs = differs_over(training.world(), held);
  if (mesh.size(MeshDim::tp) > 1) differs.logical_or_(differs_over(mesh.group(MeshDim::dp_cp), held_sliced));
  auto verdicts = differs.to(at::kInt);
  training.world().all_reduce(verdicts, ReduceOp::MAX);
  verdicts = verdicts.cpu();
  for (size_t i = 0; i < params.size(); ++i)
    if (verdicts[static_cast<int64_t>(i)].item<int>() != 0) record_["differs_at_start"].push_back(prefix + params[i].key());
}

void VerifyRecorder::on_backward(const at::Tensor& loss) {
  pending_loss_ += loss.detach().to(at::kDouble).sum().item<double>();
  pending_micro_ += 1;
}

void VerifyRecorder::before_update(const step::TrainingView& training, const std::vector<at::Tensor>& parameters,
                                 ParallelStrategy* owner) {
  auto mean = at::full({1}, pending_micro_ ? pending_loss_ / pending_micro_ : 0.0, at::kDouble).to(training.device);
  micro_steps_ = pending_micro_;
  pending_loss_ = 0;
  pending_micro_ = 0;
  training.world().all_reduce(mean, ReduceOp::SUM);
  loss_ = mean.item<double>() / training.world().size();
  // The epoch's last global batch, when the ranks cannot share it evenly: a loss averaged per rank weighs its
  // samples unequally there (even_batches pads with repeated samples; without it, shares of a short batch differ).
  short_batch_ = 0;
  if (!training.loaders.empty()) {  // the first prepared loader's
    const auto& loader = training.loaders.front();
    const int64_t ranks = loader->sharding().num_processes;
    const int64_t global = loader->options().batch_size * (training.plan.split_batches ? 1 : ranks);
    const int64_t rest = global > 0 ? loader->dataset_size() % global : 0;
    const bool uneven = rest % ranks != 0 || !loader->sharding().even_batches;
    if (loader->batches_yielded() == loader->size() && rest != 0 && uneven) short_batch_ = rest;
  }
  if (training.world().size() == 1)  // the reference: whole gradients on the module's own parameters
    for (size_t i = 0; i < training.models.size(); ++i)
      for (const auto& item : training.models[i]->module()->named_parameters()) {
        const auto& g = item.value().grad();
        if (!g.defined() || !g.sizes().equals(item.value().sizes())) continue;
        const auto name = model_prefix(static_cast<int>(i)) + item.key();
        auto magnitude = g.detach().abs().to(at::kCPU, at::kFloat);
        auto& held = grad_max_[name];
        held = held.defined() ? at::maximum(held, magnitude) : magnitude;
      }
  // The norm the program clipped from, else the gradients' own (an infinite max_norm measures without clipping).
  const double inf = std::numeric_limits<double>::infinity();
  if (clipped_from_) grad_norm_ = *clipped_from_;
  else if (training.pipeline_grad_norm) grad_norm_ = training.pipeline_grad_norm(2.0);  // every stage's gradients
  else
    grad_norm_ = (owner ? owner->clip_grad_norm(parameters, inf, 2.0)
                        : tp::clip_grad_norm(parameters, tp::SlicedParameters{}, inf, 2.0)).value();
  clipped_from_.reset();
}

void VerifyRecorder::after_update(const step::TrainingView& training, int64_t step) {
  if (step > steps_) return;
  record_["steps"].push_back({{"step", step},
                              {"loss", loss_},
                              {"grad_norm", grad_norm_},
                              {"short_batch", short_batch_},
                              {"micro_steps", micro_steps_}});
  const bool last = step == steps_;
  if (last) {
    for (size_t i = 0; i < training.models.size(); ++i)
      training.write_full_model(*training.models[i]->module(), fmt::format("{}/model_{}", dir_, i));
    if (!grad_max_.empty())
      save_safetensors(dir_ + "/grad_max.safetensors", NamedTensors(grad_max_.begin(), grad_max_.end()));
  }
  const int rank = training.process.rank();
  if (rank == 0) {
    record_["world_size"] = training.world().size();
    record_["data_parallel"] = training.process.mesh().size(MeshDim::dp);  // the ranks that share each global batch
    record_["complete"] = last;
    files::write_durably(dir_ + "/record.json", record_.dump(1));
  }
  if (last) std::ofstream(fmt::format("{}/done.{}", dir_, rank)) << "done\n";
}

}  // namespace xlr8::diagnostics
