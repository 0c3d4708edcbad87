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

// Callbacks by id: autograd functions keep only IValues in their context.
std::unordered_map<int64_t, std::function<void()>>& prehooks() {
  static std::unordered_map<int64_t, std::function<void()>> hooks;
  return hooks;
}
int64_t next_prehook_id = 0;
constexpr int64_t kPrehooksKept = 1 << 16;

struct BackwardPrehook : torch::autograd::Function<BackwardPrehook> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t id) {
    ctx->saved_data["id"] = id;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::function<void()> hook;  // kept: a graph run backward twice (retain_graph) gathers twice
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      auto it = prehooks().find(ctx->saved_data["id"].toInt());
      if (it != prehooks().end()) hook = it->second;
    }
    if (hook) hook();
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
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    id = next_prehook_id++;
    prehooks()[id] = std::move(before_backward);
    // Entries stay for graphs run backward again; the graphs of long-gone forwards are gone too, so
    // only the most recent ones are kept.
    prehooks().erase(id - kPrehooksKept);
  }
  return BackwardPrehook::apply(output, id);
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
