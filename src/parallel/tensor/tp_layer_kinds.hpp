#pragma once
// Which modules a tensor-parallel plan may name (tp_plan.cpp and tp_auto.cpp agree on it here), and the
// gradient sum sequence parallelism needs for what it keeps whole.
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::tp::detail {

// LibTorch's own Linear or Embedding (a plan refuses them by name: their forward takes no collectives).
bool is_plain_torch_layer(const torch::nn::Module& m);
// Ours or LibTorch's Linear or Embedding.
bool is_layer(const torch::nn::Module& m);

// The widths of the parts a Colwise entry stacks in an output of `out_features` ({out_features} when not
// fused). The entry was checked (tensor_parallel_problem) before.
std::vector<int64_t> fused_part_widths(const PlanEntry& entry, int64_t out_features);
// PlanEntry::head_dim on a Linear of these features (its fused parts checked already): "" when every width
// the entry splits is whole heads that `tp_size` ranks share equally, else why not, naming the widths, the
// head size and tp.
std::string heads_problem(const PlanEntry& entry, int64_t in_features, int64_t out_features, int tp_size);
// Whether the last component of a module path names an attention projection (AutoTP's q/k/v, fused q/k/v
// and attention output names): the layers a model-wide head size applies to.
bool is_attention_projection(const std::string& path);
// This rank's share of `whole` on dim 0, made of parts of the given widths each split on its own over
// `size` ranks (every width divisible by it): the parts' slices stacked in order.
at::Tensor slice_of_parts(const at::Tensor& whole, const std::vector<int64_t>& parts, int rank, int size);

// Under sequence parallelism a parameter kept whole (a norm's, a row-wise bias) sees only this rank's
// share of the sequence: its gradient is completed over `group` as backward produces it (before DDP or
// FSDP reduce it over dp).
void sum_gradient_over(at::Tensor& parameter, const Communicator& group);

// While one is alive on this thread, slicing a layer keeps the whole tensor it slices: the main process
// building a model (Accelerator::build_model) whose plan is applied inside the build, and whose whole
// values the other ranks receive at prepare().
class KeepWholeValues {
 public:
  KeepWholeValues();
  ~KeepWholeValues();
  KeepWholeValues(const KeepWholeValues&) = delete;
  KeepWholeValues& operator=(const KeepWholeValues&) = delete;
  // The whole value `tensor` held before it was sliced, or `tensor` itself when it was not.
  at::Tensor whole_of(const at::Tensor& tensor) const;
  // Called by the slicing code just before `tensor` becomes a slice of itself.
  static void record(const at::Tensor& tensor);

 private:
  std::unordered_map<const c10::TensorImpl*, at::Tensor> wholes_;
  KeepWholeValues* outer_;
};

// Collective over `world`: every rank's parameters and buffers (sliced by a plan or not) take their
// values from the main process's (rank 0's) whole ones, `wholes` by name (read on rank 0 only). The other
// ranks built `model` in an EmptyInitScope (meta): it gets memory on `device` for its slices only, and
// one whole tensor at a time is sent. A model whose names, whole shapes or dtypes differ on some rank is a
// ConfigError on every rank, before anything is sent.
void take_whole_values_from_main(torch::nn::Module& model, const Communicator& world,
                                 const std::map<std::string, at::Tensor>& wholes, const at::Device& device);

}  // namespace xlr8::tp::detail
