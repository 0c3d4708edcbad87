#pragma once
// One micro-batch's backward through a pipeline stage in two parts, for the zero-bubble schedules: the inputs'
// gradients first (what the previous stage waits for), the parameters' gradients later (what fills the bubble).
//
// Nothing is computed twice: the input part runs the autograd graph only as far as the stage's inputs need, each node
// computing only the gradients asked of it. Where the parameters' part of the graph leaves that path, a hook keeps
// the gradient the boundary node received; the weight part runs those nodes again with it, now for their other
// gradients, and on towards the parameters only, accumulating into their .grad as a backward does (their hooks
// run). The boundary nodes are grouped so that each group's parameters are reached from its own nodes only; a group
// whose parameters are also reached through the input path (a weight used at two depths of one stage) runs from the
// stage's outputs instead, for those parameters alone. A checkpointed region on the input path splits too: its node
// recomputes the region in the input part and runs the region's own input part there, and the weight part runs the
// region's weight part (the recomputed graph is held in between, where a whole backward would free it). Where no
// input needs a gradient (the first stage) the weight part is the whole backward; where a node the weight part would
// run again is not one of LibTorch's derivative formulas without hooks, the input part is (whole_backwards()).
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace xlr8::pp {

class SplitBackward {
 public:
  // outputs: the stage's outputs of one micro-batch; gradients: theirs (undefined for a scalar loss: 1);
  // inputs: the stage's inputs (leaves; those not requiring gradients are skipped). The weight part accumulates
  // every other leaf's gradient, a checkpointed region's parameters' included. Returns each input's gradient
  // (undefined where none flows) and keeps what backward_weight needs.
  std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& gradients,
                                         const std::vector<at::Tensor>& inputs);
  // The parameters' gradients of the same micro-batch, accumulated; then the graph is let go.
  void backward_weight();
  // How many backwards of this object's micro-batches, or of checkpointed regions inside them, were not split: a
  // node the weight part would run again could count something twice (a custom Function's, one with hooks, a
  // checkpointed region's where its weights are also reached through the input path), so backward_input ran that
  // backward whole and backward_weight had nothing left of it.
  int whole_backwards() const { return whole_backwards_; }
  // How many checkpointed regions' backwards were split (a region inside another counted too).
  int split_regions() const { return split_regions_; }

  struct Group;    // a set of boundary edges and the parameters only they reach
  struct Regions;  // the checkpointed regions' own splits, in the order their input parts ran

 private:
  std::vector<std::shared_ptr<Group>> groups_;
  std::vector<torch::autograd::Edge> roots_;  // edge_list, which edge.h does not declare in every LibTorch
  std::vector<at::Tensor> root_gradients_;
  std::shared_ptr<Regions> regions_;
  bool whole_in_weight_part_ = false;  // no input needs a gradient (the first stage): one backward, later
  bool ran_whole_ = false;             // the last backward_input ran this backward whole
  int whole_backwards_ = 0, split_regions_ = 0;

  std::vector<at::Tensor> whole_backward(const std::vector<at::Tensor>& inputs);
};

}  // namespace xlr8::pp
