#pragma once
// Drop-in layers for tensor parallelism. LibTorch's forward is not virtual and has no hooks, so a
// row-wise layer's all-reduce cannot be put into torch::nn::Linear from outside: a model that may run
// under tensor parallelism builds these instead. Until xlr8::tp::parallelize() assigns them a style they
// are LibTorch's layers (same parameter names, shapes and initialisation), so checkpoints do not change.
// Linear computes as Python's F.linear (at::linear: the bias inside the GEMM for inputs of any rank),
// which for 3-D inputs is faster than torch::nn::Linear's matmul-then-add and may round differently.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/options/embedding.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::fp8 {
class LinearState;
}  // namespace xlr8::fp8

namespace xlr8::nn {

// What parallelize() gives a layer: its style, its group, and where its slice starts in the whole.
struct TensorParallelSlot {
  tp::Style style;
  Communicator group;
  bool gather_output = false;
  int64_t offset = 0;  // first output feature (Colwise; within the first fused part), input feature (Rowwise) or row
  std::vector<int64_t> parts;  // Colwise: the widths of the output's fused parts, each split on its own ({out} if one)
  bool sequence_parallel = false;  // activations around the layer split on the sequence (PlanEntry)
};

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features) : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);

  // Why this layer cannot take `style` on a tp group of `tp_size` ranks, or "" when it can.
  std::string tensor_parallel_problem(const tp::PlanEntry& entry, int tp_size) const;
  // Called by tp::parallelize (after tensor_parallel_problem found none): keeps this rank's slice of
  // weight and bias (the same tensors, resized).
  void parallelize(const tp::PlanEntry& entry, const Communicator& group);
  const std::optional<TensorParallelSlot>& tensor_parallel() const { return slot_; }

  // fp8 training (xlr8/float8.hpp): the recipe and amax state convert_to_float8_training gave, or null.
  const std::shared_ptr<fp8::LinearState>& float8() const { return float8_; }
  void use_float8(std::shared_ptr<fp8::LinearState> state) { float8_ = std::move(state); }

  torch::nn::LinearOptions options;
  at::Tensor weight;
  at::Tensor bias;

 private:
  std::string colwise_problem(const tp::PlanEntry& entry, int tp_size) const;
  // input @ weight^T + `with_bias` (if defined): in fp8 when the layer has a recipe and is training (or its recipe
  // evaluates in fp8 too), else as at::linear.
  at::Tensor product(const at::Tensor& input, const at::Tensor& with_bias);
  std::optional<TensorParallelSlot> slot_;
  std::shared_ptr<fp8::LinearState> float8_;
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);

  // The embedding as an output layer: input @ weight^T, logits over the whole vocabulary (a head tied to
  // this embedding). Vocabulary-parallel: each rank scores its rows and the logits are gathered, so the
  // tied head stays consistent with its sliced embedding.
  at::Tensor attend(const at::Tensor& input);

  std::string tensor_parallel_problem(const tp::PlanEntry& entry, int tp_size) const;
  // Called by tp::parallelize (VocabParallel): keeps this rank's rows of the weight.
  void parallelize(const tp::PlanEntry& entry, const Communicator& group);
  const std::optional<TensorParallelSlot>& tensor_parallel() const { return slot_; }

  torch::nn::EmbeddingOptions options;
  at::Tensor weight;

 private:
  std::optional<TensorParallelSlot> slot_;
};
TORCH_MODULE(Embedding);

}  // namespace xlr8::nn
