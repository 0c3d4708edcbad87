#pragma once
// One micro-batch's backward through a pipeline stage in two parts, for the zero-bubble schedules: the inputs'
// gradients first (what the previous stage waits for), the parameters' gradients later (what fills the bubble).
//
// Nothing is computed twice. The input part runs the autograd graph only as far as the stage's inputs need: a node
// there computes only its inputs' gradients (autograd asks each node for the outputs that lead somewhere needed).
// Where the parameters' part of the graph leaves that path, a hook keeps the gradient the node received; the weight
// part starts from those nodes with those gradients and runs only towards the parameters, accumulating into their
// .grad as a backward does (their hooks run). The boundary nodes are grouped so that each group's parameters are
// reached from its own nodes only; a group whose parameters are also reached through the input path (a weight used
// at two depths of one stage) runs from the stage's outputs instead, for those parameters alone. Where no input needs
// a gradient (the first stage) the weight part is the whole backward.
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace xlr8::pp {

class SplitBackward {
 public:
  // outputs: the stage's outputs of one micro-batch; gradients: theirs (undefined for a scalar loss: 1);
  // inputs: the stage's inputs (leaves; those not requiring gradients are skipped). The weight part accumulates
  // every other leaf's gradient (a checkpointed region's parameters get theirs from the nested backward its node
  // runs in the input part). Returns each input's gradient (undefined where none flows) and keeps what
  // backward_weight needs.
  std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& gradients,
                                         const std::vector<at::Tensor>& inputs);
  // The parameters' gradients of the same micro-batch, accumulated; then the graph is let go.
  void backward_weight();

  struct Group;  // a set of boundary edges and the parameters only they reach

 private:
  std::vector<std::shared_ptr<Group>> groups_;
  std::vector<torch::autograd::Edge> roots_;  // edge_list, which edge.h does not declare in every LibTorch
  std::vector<at::Tensor> root_gradients_;
  bool whole_in_weight_part_ = false;  // no input needs a gradient (the first stage): one backward, later
};

}  // namespace xlr8::pp
