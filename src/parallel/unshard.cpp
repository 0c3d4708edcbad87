// xlr8::unshard(): the guard a unit's forward opens, the registry behind it, and the autograd function
// that re-gathers a unit before its backward.
#include "xlr8/unshard.hpp"

#include <torch/autograd.h>

#include <mutex>
#include <unordered_map>

#include "parallel/sharded_unit.hpp"

namespace xlr8 {
namespace detail {
namespace {

std::mutex registry_mutex;
std::unordered_map<const torch::nn::Module*, std::weak_ptr<ShardedUnit>>& registry() {
  static std::unordered_map<const torch::nn::Module*, std::weak_ptr<ShardedUnit>> units;
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

}  // namespace

void register_unit(const torch::nn::Module& module, std::weak_ptr<ShardedUnit> unit) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[&module] = std::move(unit);
}

void unregister_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(&module);
}

std::shared_ptr<ShardedUnit> find_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(&module);
  return it == registry().end() ? nullptr : it->second.lock();
}

at::Tensor with_backward_prehook(const at::Tensor& output, std::function<void()> before_backward) {
  return BackwardPrehook::apply(output, c10::make_intrusive<Prehook>(std::move(before_backward)));
}

}  // namespace detail

UnshardScope::UnshardScope(std::shared_ptr<detail::ShardedUnit> unit) : unit_(std::move(unit)) {
  if (unit_) unit_->before_forward();
}

UnshardScope::UnshardScope(UnshardScope&& other) noexcept : unit_(std::move(other.unit_)) {}

UnshardScope::~UnshardScope() {
  if (unit_) unit_->forward_abandoned();
}

at::Tensor UnshardScope::done(const at::Tensor& output) {
  if (!unit_) return output;
  auto unit = std::move(unit_);
  return unit->after_forward(output);
}

UnshardScope unshard(const torch::nn::Module& unit) { return UnshardScope(detail::find_unit(unit)); }

}  // namespace xlr8
