#pragma once
// prepare()'s tensor-parallel step: a model the mesh says to split is split (by the program's plan, the plan
// file XLR8_TP_PLAN_FILE names, or AutoTP) and checked against the attention head size.
#include <cstdint>
#include <optional>

namespace torch::nn {
class Module;
}

namespace xlr8 {
class DeviceMesh;
namespace detail {

// parallelism_config_tp_size: a model the program split already (tp::parallelize) keeps its plan; any
// other is split here by the plan file XLR8_TP_PLAN_FILE names or by AutoTP, or refused by name. Never
// trains whole while the mesh says tp, nor with a rank holding part of an attention head of `head_dim`.
void split_for_tensor_parallel(torch::nn::Module& module, DeviceMesh& mesh, std::optional<bool> sequence_parallel_option,
                               int64_t head_dim);

}  // namespace detail
}  // namespace xlr8
