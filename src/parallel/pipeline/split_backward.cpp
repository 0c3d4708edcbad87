// A micro-batch's backward in an input part and a weight part (split_backward.hpp).
#include "parallel/pipeline/split_backward.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "parallel/recompute/recompute.hpp"
#include "precision/float8_linear.hpp"
#include "xlr8/pure_backward.hpp"

namespace xlr8::pp {

// An Edge's node pointer: shared_ptr<Node> before LibTorch 2.15, intrusive_ptr<Node> since (compat::NodePtr).
using SplitNodeRef = decltype(torch::autograd::Edge::function);

struct SplitBackward::Group {
  std::vector<SplitNodeRef> nodes;  // boundary nodes on the input path
  std::vector<std::shared_ptr<torch::autograd::variable_list>> received;  // what each received in backward_input
  torch::autograd::edge_list root_edges;  // stage outputs off the input path, with their gradients
  std::vector<at::Tensor> root_gradients;
  torch::autograd::edge_list parameters;  // the leaves only this group reaches (their AccumulateGrad nodes)
  bool from_outputs = false;
};

struct SplitBackward::Regions {
  std::mutex mutex;  // a stage on two devices runs its nodes on two of the engine's threads
  std::vector<std::shared_ptr<SplitBackward>> splits;
};

namespace {

using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Keeps the gradients a node receives the first time it runs (backward_input's run; the weight part runs it again).
struct KeepReceived : torch::autograd::FunctionPreHook {
  explicit KeepReceived(std::weak_ptr<variable_list> slot) : slot(std::move(slot)) {}
  variable_list operator()(const variable_list& gradients) override {
    if (auto kept = slot.lock(); kept && kept->empty()) *kept = gradients;
    return gradients;
  }
  std::weak_ptr<variable_list> slot;
};

// The graph below the roots: every node, children before parents, and whether each reaches an input or a weight.
struct BackwardGraph {
  std::vector<Node*> order;
  std::unordered_map<Node*, SplitNodeRef> refs;
  std::unordered_set<Node*> weights, to_input, to_weight;

  BackwardGraph(const edge_list& roots, const std::unordered_set<Node*>& inputs) {
    std::vector<std::pair<Node*, size_t>> stack;
    auto visit = [&](const SplitNodeRef& ref) {
      if (ref && refs.emplace(ref.get(), ref).second) stack.emplace_back(ref.get(), 0);
    };
    for (const auto& root : roots) {
      visit(root.function);
      while (!stack.empty()) {
        auto& [node, next] = stack.back();
        if (next < node->next_edges().size()) {
          visit(node->next_edge(next++).function);
          continue;
        }
        order.push_back(node);
        stack.pop_back();
      }
    }
    for (Node* node : order) {
      bool input = inputs.count(node) > 0;
      for (const auto& edge : node->next_edges()) input = input || to_input.count(edge.function.get());
      if (input) to_input.insert(node);
    }
    // The leaves' accumulators, but the inputs' and the anchors of checkpointed regions on the input path (a region
    // off it keeps its anchor, so that the weight part runs its node once).
    std::unordered_set<Node*> anchors;
    for (Node* node : order)
      if (to_input.count(node) && recompute::is_checkpoint_node(*node) && !node->next_edges().empty())
        anchors.insert(node->next_edges().back().function.get());
    for (Node* node : order)
      if (!inputs.count(node) && !anchors.count(node) && node->name() == "torch::autograd::AccumulateGrad")
        weights.insert(node);
    for (Node* node : order) {
      bool weight = weights.count(node) > 0;
      for (const auto& edge : node->next_edges()) weight = weight || to_weight.count(edge.function.get());
      if (weight) to_weight.insert(node);
    }
  }

  bool off_path_to_weight(Node* node) const { return node && !to_input.count(node) && to_weight.count(node); }

  // The weights reached from `starts` through nodes off the input path.
  std::vector<Node*> weights_from(const std::vector<Node*>& starts) const {
    std::vector<Node*> stack(starts), found;
    std::unordered_set<Node*> seen(starts.begin(), starts.end());
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      if (weights.count(node)) found.push_back(node);
      for (const auto& edge : node->next_edges())
        if (Node* child = edge.function.get(); off_path_to_weight(child) && seen.insert(child).second)
          stack.push_back(child);
    }
    return found;
  }

  // Whether any of `group_weights` is reached from `node`'s children on the input path (a weight used at two
  // depths).
  bool reached_through_input_path(Node* node, const std::unordered_set<Node*>& group_weights) const {
    std::vector<Node*> stack;
    std::unordered_set<Node*> seen;
    for (const auto& edge : node->next_edges())
      if (Node* child = edge.function.get(); child && to_input.count(child) && seen.insert(child).second)
        stack.push_back(child);
    while (!stack.empty()) {
      Node* below = stack.back();
      stack.pop_back();
      if (group_weights.count(below)) return true;
      for (const auto& edge : below->next_edges())
        if (Node* child = edge.function.get(); child && to_weight.count(child) && seen.insert(child).second)
          stack.push_back(child);
    }
    return false;
  }
};

// The custom Functions declared pure (xlr8/pure_backward.hpp): a test per class.
std::mutex pure_mutex;
std::vector<std::function<bool(const Node&)>>& pure_backwards() {
  static std::vector<std::function<bool(const Node&)>> tests;
  return tests;
}

bool declared_pure(const Node& node) {
  std::lock_guard<std::mutex> lock(pure_mutex);
  const auto& tests = pure_backwards();
  return std::any_of(tests.begin(), tests.end(), [&](const auto& is_declared) { return is_declared(node); });
}

// Whether `node` can run in both parts without counting anything twice: one of LibTorch's derivative formulas
// (which compute only the gradients asked for), fp8's product (which does so too, and records once) or a custom
// Function declared pure, with no hooks. A checkpointed region's node would run its nested backward again, another
// custom Function may compute (or record) whatever it computes.
bool runs_twice_safely(Node* node, bool fp8_too = true) {
  // LibTorch names its generated nodes "<Op>Backward<N>" with no namespace; a custom Function's node is named by
  // its class, namespace included.
  const auto name = node->name();
  const auto formula = name.find("Backward");
  const bool generated = name == "torch::autograd::CopySlices" ||  // an in-place op on a view: its formula inside
                         (formula != std::string::npos && name.find(':') == std::string::npos &&
                          name.find_first_not_of("0123456789", formula + 8) == std::string::npos);
  const bool splits = generated || (fp8_too && fp8::is_float8_product(*node)) || declared_pure(*node);
  return splits && node->pre_hooks().empty() &&
         node->tensor_pre_hooks().empty() && node->retains_grad_hooks().empty() && node->post_hooks().empty();
}

// A boundary: a node on the input path with children off it that reach weights, or a root off the path.
struct WeightBoundary {
  Node* node;
  int root = -1;  // index into the roots for a root boundary
  std::vector<Node*> weights;
};

int set_root(std::vector<int>& parent, int i) {
  while (parent[i] != i) i = parent[i] = parent[parent[i]];
  return i;
}

std::vector<WeightBoundary> weight_boundaries(const BackwardGraph& graph, const edge_list& roots) {
  std::vector<WeightBoundary> out;
  for (Node* node : graph.order) {
    if (!graph.to_input.count(node)) continue;
    std::vector<Node*> off;
    for (const auto& edge : node->next_edges())
      if (graph.off_path_to_weight(edge.function.get())) off.push_back(edge.function.get());
    if (!off.empty()) out.push_back({node, -1, graph.weights_from(off)});
  }
  for (size_t r = 0; r < roots.size(); ++r)
    if (Node* node = roots[r].function.get(); graph.off_path_to_weight(node))
      out.push_back({node, static_cast<int>(r), graph.weights_from({node})});
  return out;
}

// Whether the nodes the weight part runs again can run twice: the boundaries, and under a run from the outputs every
// node of the input path (but the inputs' accumulators, which it does not run: it asks for parameters only). fp8's
// node splits only as a boundary: run again from the outputs it would be asked for its input's gradient again.
bool runs_again_safely(const BackwardGraph& graph, const std::vector<std::shared_ptr<SplitBackward::Group>>& groups,
                       const std::unordered_set<Node*>& input_nodes, bool any_from_outputs) {
  for (const auto& group : groups)
    for (const auto& node : group->nodes)
      if (!runs_twice_safely(node.get())) return false;
  if (any_from_outputs)
    for (Node* node : graph.order)
      if (graph.to_input.count(node) && !input_nodes.count(node) && !runs_twice_safely(node, /*fp8_too=*/false))
        return false;
  return true;
}

// While it lives, each checkpointed region on the input path splits its own backward, keeping the split in
// `regions`: its node recomputes the region in the input part, as it would anyway, and runs only the region's input
// part there.
class SplitRegionsOnInputPath {
 public:
  SplitRegionsOnInputPath(const BackwardGraph& graph, const std::shared_ptr<SplitBackward::Regions>& regions) {
    for (Node* node : graph.order) {
      if (!graph.to_input.count(node) || !recompute::is_checkpoint_node(*node)) continue;
      recompute::run_nested_backward_with(
          *node, [regions](const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& gradients,
                           const std::vector<at::Tensor>& inputs) {
            auto split = std::make_shared<SplitBackward>();
            auto input_gradients = split->backward_input(outputs, gradients, inputs);
            std::lock_guard<std::mutex> lock(regions->mutex);
            regions->splits.push_back(std::move(split));
            return input_gradients;
          });
      nodes_.push_back(graph.refs.at(node));
    }
  }
  ~SplitRegionsOnInputPath() {
    for (const auto& node : nodes_) recompute::run_nested_backward_with(*node, {});
  }
  SplitRegionsOnInputPath(const SplitRegionsOnInputPath&) = delete;
  SplitRegionsOnInputPath& operator=(const SplitRegionsOnInputPath&) = delete;

 private:
  std::vector<SplitNodeRef> nodes_;
};

}  // namespace

std::vector<at::Tensor> SplitBackward::backward_input(const std::vector<at::Tensor>& outputs,
                                                      const std::vector<at::Tensor>& gradients,
                                                      const std::vector<at::Tensor>& inputs) {
  groups_.clear();
  roots_.clear();
  root_gradients_.clear();
  regions_ = std::make_shared<Regions>();
  ran_whole_ = false;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].requires_grad()) continue;
    roots_.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
    root_gradients_.push_back(i < gradients.size() && gradients[i].defined() ? gradients[i] : at::ones_like(outputs[i]));
  }
  whole_in_weight_part_ = std::none_of(inputs.begin(), inputs.end(),
                                       [](const at::Tensor& x) { return x.defined() && x.requires_grad(); });
  if (whole_in_weight_part_) return std::vector<at::Tensor>(inputs.size());  // nothing to wait for: all later
  edge_list input_edges;
  std::vector<size_t> input_index;
  std::unordered_set<Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    input_edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    input_nodes.insert(input_edges.back().function.get());
    input_index.push_back(i);
  }
  const BackwardGraph graph(roots_, input_nodes);
  const auto boundaries = weight_boundaries(graph, roots_);
  // Boundaries that reach a common weight share a group: its gradient is summed in one run.
  std::vector<int> parent(boundaries.size());
  std::iota(parent.begin(), parent.end(), 0);
  std::unordered_map<Node*, int> owner;
  for (size_t b = 0; b < boundaries.size(); ++b)
    for (Node* weight : boundaries[b].weights)
      if (auto [it, fresh] = owner.emplace(weight, static_cast<int>(b)); !fresh)
        parent[set_root(parent, static_cast<int>(b))] = set_root(parent, it->second);
  std::unordered_map<int, std::shared_ptr<Group>> by_root;
  std::unordered_map<int, std::unordered_set<Node*>> weights_of;
  for (size_t b = 0; b < boundaries.size(); ++b) {
    const int g = set_root(parent, static_cast<int>(b));
    auto& group = by_root[g];
    if (!group) {
      group = std::make_shared<Group>();
      groups_.push_back(group);
    }
    const auto& boundary = boundaries[b];
    if (boundary.root >= 0) {
      group->root_edges.push_back(roots_[static_cast<size_t>(boundary.root)]);
      group->root_gradients.push_back(root_gradients_[static_cast<size_t>(boundary.root)]);
    } else {
      group->nodes.push_back(graph.refs.at(boundary.node));
      group->received.push_back(std::make_shared<variable_list>());
    }
    for (Node* weight : boundary.weights)
      if (weights_of[g].insert(weight).second) group->parameters.emplace_back(graph.refs.at(weight), 0);
  }
  bool any_from_outputs = false;
  for (auto& [g, group] : by_root) {
    for (const auto& node : group->nodes)
      group->from_outputs = group->from_outputs || graph.reached_through_input_path(node.get(), weights_of[g]);
    any_from_outputs = any_from_outputs || group->from_outputs;
  }
  if (!runs_again_safely(graph, groups_, input_nodes, any_from_outputs)) return whole_backward(inputs);
  for (const auto& group : groups_)  // a group run from the outputs needs no boundary's gradient
    for (size_t n = 0; n < group->nodes.size() && !group->from_outputs; ++n)
      group->nodes[n]->add_pre_hook(std::make_unique<KeepReceived>(group->received[n]));
  std::vector<at::Tensor> out(inputs.size());
  const SplitRegionsOnInputPath split_regions(graph, regions_);
  auto found = torch::autograd::Engine::get_default_engine().execute(roots_, root_gradients_, /*keep_graph=*/true,
                                                                      /*create_graph=*/false,
                                                                      /*accumulate_grad=*/false, input_edges);
  for (size_t i = 0; i < input_index.size(); ++i) out[input_index[i]] = found[i];
  if (!any_from_outputs) {  // only the groups' own edges and gradients are needed from here on
    roots_.clear();
    root_gradients_.clear();
  }
  return out;
}

std::vector<at::Tensor> SplitBackward::whole_backward(const std::vector<at::Tensor>& inputs) {
  groups_.clear();
  torch::autograd::Engine::get_default_engine().execute(roots_, root_gradients_, /*keep_graph=*/false,
                                                        /*create_graph=*/false, /*accumulate_grad=*/true);
  roots_.clear();
  root_gradients_.clear();
  ++whole_backwards_;
  ran_whole_ = true;
  std::vector<at::Tensor> out;
  for (const auto& input : inputs) out.push_back(input.defined() && input.requires_grad() ? input.grad() : at::Tensor());
  return out;
}

void SplitBackward::backward_weight() {
  auto& engine = torch::autograd::Engine::get_default_engine();
  if (whole_in_weight_part_ && !roots_.empty())  // the first stage: its backward as one
    engine.execute(roots_, root_gradients_, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
  for (const auto& group : groups_) {
    edge_list roots = group->from_outputs ? roots_ : group->root_edges;
    std::vector<at::Tensor> gradients = group->from_outputs ? root_gradients_ : group->root_gradients;
    if (!group->from_outputs) {
      for (size_t n = 0; n < group->nodes.size(); ++n) {
        const auto& received = *group->received[n];
        for (size_t i = 0; i < received.size(); ++i) {
          if (!received[i].defined()) continue;
          roots.emplace_back(group->nodes[n], static_cast<uint32_t>(i));
          gradients.push_back(received[i]);
        }
      }
    }
    if (roots.empty()) continue;  // no gradient reached this group's boundary
    engine.execute(roots, gradients, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true,
                   group->parameters);
  }
  if (regions_) {
    for (const auto& region : regions_->splits) {
      region->backward_weight();
      whole_backwards_ += region->whole_backwards();
      split_regions_ += region->split_regions() + (region->ran_whole_ ? 0 : 1);
    }
    regions_.reset();
  }
  groups_.clear();
  roots_.clear();
  root_gradients_.clear();
}

}  // namespace xlr8::pp

namespace xlr8::pp::detail {

void add_pure_backward(std::function<bool(const torch::autograd::Node&)> is_declared) {
  std::lock_guard<std::mutex> lock(pure_mutex);
  pure_backwards().push_back(std::move(is_declared));
}

}  // namespace xlr8::pp::detail
