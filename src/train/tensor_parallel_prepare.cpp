#include "train/tensor_parallel_prepare.hpp"

#include <fmt/format.h>

#include "core/log.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::detail {

void split_for_tensor_parallel(torch::nn::Module& module, DeviceMesh& mesh, std::optional<bool> sequence_parallel_option,
                               int64_t head_dim) {
  const int tp = mesh.size("tp");
  const auto sliced = tp::sliced_parameters(module);
  if (sliced.group && sliced.group->size() != tp)
    throw ConfigError(fmt::format("prepare(): the model was split over a tp group of {} ranks but "
                                  "parallelism_config_tp_size is {}; make them equal",
                                  sliced.group->size(), tp));
  if (sliced.group) {
    try {
      tp::check_whole_heads(module, head_dim);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("prepare(): {}", e.what()));
    }
  }
  if (tp == 1 || sliced.group) return;
  if (head_dim == 0)  // AutoTP and a plan file check divisibility only; a head cut in two fails in the forward
    log::info("prepare(): parallelism_config_tp_size {} without a head size: a split that cuts an attention head is "
              "not refused before training (give AcceleratorOptions::tp_head_dim or --parallelism_config_tp_head_dim)",
              tp);
  // AcceleratorOptions::tp_sequence_parallel: the plan made here is Megatron's sequence parallelism.
  const bool sequence_parallel =
      sequence_parallel_option.value_or(Env::current().get_bool("XLR8_TP_SEQUENCE_PARALLEL").value_or(false));
  const char* sp_note = sequence_parallel ? ", with sequence parallelism" : "";
  if (auto file = Env::current().get("XLR8_TP_PLAN_FILE"); file && !file->empty()) {
    auto plan = tp::plan_from_file(*file, module, tp, head_dim);
    if (sequence_parallel) plan = tp::with_sequence_parallel(std::move(plan), module);
    tp::parallelize(module, mesh.group("tp"), plan, /*strict=*/false);
    log::info("prepare(): parallelism_config_tp_size {}: the model split by the plan file {}{}", tp, *file, sp_note);
    return;
  }
  try {
    tp::parallelize(module, mesh.group("tp"), tp::auto_plan(module, tp, head_dim, sequence_parallel), /*strict=*/true);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("prepare(): parallelism_config_tp_size is {} and the program applied no plan "
                                  "(xlr8::tp::parallelize), so AutoTP tried: {}",
                                  tp, e.what()));
  }
  log::info("prepare(): parallelism_config_tp_size {}: AutoTP split the model's layers (no plan was applied){}", tp,
            sp_note);
}

}  // namespace xlr8::detail
