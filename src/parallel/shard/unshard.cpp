// xlr8::unshard(): the guard a unit's forward opens, the registry behind it, and the autograd function
// that re-gathers a unit before its backward.
#include "xlr8/unshard.hpp"

#include <ATen/SequenceNumber.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "compat/torch_compat.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/shard/unit_registry.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace shard {
namespace {

std::mutex registry_mutex;
std::unordered_map<const torch::nn::Module*, std::weak_ptr<UnitHooks>>& registry() {
  static std::unordered_map<const torch::nn::Module*, std::weak_ptr<UnitHooks>> units;
  return units;
}

// The callback travels in the autograd node's context (as a capsule), so it lives exactly as long as
// the graph: nothing long-lived is allocated per forward. (An id-keyed registry did, and its small
// entries, interleaved with each step's large temporaries, kept glibc from reusing and trimming the heap:
// stage 3's resident memory grew by megabytes a step.)
struct Prehook : torch::CustomClassHolder {
  explicit Prehook(std::function<void()> fn) : fn(std::move(fn)) {}
  std::function<void()> fn;
};

struct BackwardPrehook : torch::autograd::Function<BackwardPrehook> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<Prehook> hook) {
    ctx->saved_data["hook"] = c10::IValue::make_capsule(std::move(hook));
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // Kept, not consumed: a graph run backward twice (retain_graph) gathers twice.
    auto hook = c10::static_intrusive_pointer_cast<Prehook>(ctx->saved_data["hook"].toCapsule());
    hook->fn();
    return {grads[0], at::Tensor()};
  }
};

// Shared by the post-hooks on one forward's nodes: the last of them to run calls `done`. Run again
// (retain_graph), the count goes below zero and nothing is called twice. Freed with the graph: if not
// every node ran, `dropped`.
struct Countdown {
  std::atomic<int64_t> left;
  std::function<void()> done, dropped;
  ~Countdown() {
    if (left.load() > 0 && dropped) dropped();
  }
};

struct CountdownHook : torch::autograd::FunctionPostHook {
  explicit CountdownHook(std::shared_ptr<Countdown> countdown) : countdown(std::move(countdown)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (countdown->left.fetch_sub(1) == 1) countdown->done();
    return outputs;
  }
  std::shared_ptr<Countdown> countdown;
};

}  // namespace

uint64_t autograd_position() { return at::sequence_number::peek(); }

size_t after_backward_of(const std::vector<at::Tensor>& outputs, uint64_t forward_start, std::function<void()> done,
                         std::function<void()> dropped) {
  // Nodes are numbered as they are created, and a node's inputs come from older nodes: every node on a
  // path from `output` down to one of the unit's nodes is the unit's too, so the walk stops at the
  // first older node (or a leaf's accumulator, numbered past every other).
  const uint64_t end = autograd_position();
  std::vector<torch::autograd::Node*> nodes, stack;
  std::unordered_set<torch::autograd::Node*> seen;
  auto consider = [&](const compat::NodePtr& node) {
    if (node && node->sequence_nr() >= forward_start && node->sequence_nr() < end && seen.insert(node.get()).second)
      stack.push_back(node.get());
  };
  for (const auto& output : outputs) consider(output.grad_fn());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    nodes.push_back(node);
    for (const auto& edge : node->next_edges()) consider(edge.function);
  }
  if (nodes.empty()) return 0;
  auto countdown = std::make_shared<Countdown>();
  countdown->left = static_cast<int64_t>(nodes.size());
  countdown->done = std::move(done);
  countdown->dropped = std::move(dropped);
  for (auto* node : nodes) node->add_post_hook(std::make_unique<CountdownHook>(countdown));
  return nodes.size();
}

void register_unit(const torch::nn::Module& module, std::weak_ptr<UnitHooks> unit) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[&module] = std::move(unit);
}

namespace {
// Weak, so that a module freed and another built at its address is not taken for it.
std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>>& leaves() {
  static std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>> marked;
  return marked;
}
}  // namespace

void mark_leaf_module(torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  leaves()[&module] = module.shared_from_this();
}

bool is_leaf_module(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = leaves().find(&module);
  if (it == leaves().end()) return false;
  auto alive = it->second.lock();
  return alive && alive.get() == &module;
}

void unregister_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(&module);
}

std::shared_ptr<UnitHooks> find_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(&module);
  return it == registry().end() ? nullptr : it->second.lock();
}

at::Tensor with_backward_prehook(const at::Tensor& output, std::function<void()> before_backward) {
  return BackwardPrehook::apply(output, c10::make_intrusive<Prehook>(std::move(before_backward)));
}

}  // namespace shard

UnshardScope::UnshardScope(std::shared_ptr<detail::UnitHooks> unit) : unit_(std::move(unit)) {
  if (unit_) unit_->before_forward();
}

UnshardScope::UnshardScope(UnshardScope&& other) noexcept : unit_(std::move(other.unit_)) {}

UnshardScope::~UnshardScope() {
  if (unit_) unit_->forward_abandoned();
}

at::Tensor UnshardScope::done(const at::Tensor& output) {
  if (!unit_) return output;
  auto unit = std::move(unit_);
  return unit->after_forward({output}).front();
}

std::vector<at::Tensor> UnshardScope::done_with(const std::vector<at::Tensor>& outputs) {
  if (!unit_) return outputs;
  auto unit = std::move(unit_);
  return unit->after_forward(outputs);
}

UnshardScope unshard(const torch::nn::Module& unit) {
  if (auto label = recompute::recomputed_unit_label(unit); !label.empty())
    throw ConfigError(fmt::format(
        "fsdp_activation_checkpointing: unit {} ({}) opens its guard with xlr8::unshard(*this) or "
        "xlr8::sharded(*this, body), which cannot run its forward again in backward; write its forward as "
        "`return xlr8::sharded(*this, [this](torch::Tensor x) {{ ... }}, x);` (the body takes the unit's inputs), "
        "or set fsdp_activation_checkpointing: false",
        label, unit.name()));
  return detail::open_unit(unit);
}

namespace detail {
UnshardScope open_unit(const torch::nn::Module& unit) { return UnshardScope(shard::find_unit(unit)); }
}  // namespace detail

}  // namespace xlr8
