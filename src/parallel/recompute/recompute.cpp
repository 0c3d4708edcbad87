// xlr8::checkpoint's autograd node, the units fsdp_activation_checkpointing marks, and the hand-over of
// end-of-backward callbacks from a recomputation's nested backward to the pass around it.
#include "parallel/recompute/recompute.hpp"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "compat/torch_compat.hpp"
#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/error.hpp"

namespace xlr8::recompute {
namespace {

// ------------------------------------------------------------------------------------------ random state

// The generators a region may draw from: the CPU's and those of the devices its inputs live on (as
// PyTorch's checkpoint does).
struct RngSnapshot {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngSnapshot of(std::vector<at::Generator> generators) {
    RngSnapshot snapshot;
    for (auto& g : generators) {
      std::lock_guard<std::mutex> lock(g.mutex());
      snapshot.states.emplace_back(g, g.get_state());
    }
    return snapshot;
  }
  static RngSnapshot of(const std::vector<at::Tensor>& inputs) {
    std::vector<at::Generator> generators{at::detail::getDefaultCPUGenerator()};
    std::vector<c10::Device> devices;
    for (const auto& t : inputs)
      if (t.defined() && t.device().is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
        generators.push_back(at::globalContext().defaultGenerator(t.device()));
      }
    return of(std::move(generators));
  }
  std::vector<at::Generator> generators() const {
    std::vector<at::Generator> out;
    for (const auto& [generator, state] : states) out.push_back(generator);
    return out;
  }
  void restore() const {
    for (const auto& [generator, state] : states) {
      auto g = generator;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

// Sets the generators to the forward's state for the recomputation and back to where backward had them.
class RngFork {
 public:
  explicit RngFork(const RngSnapshot& forward) : backward_(RngSnapshot::of(forward.generators())) { forward.restore(); }
  ~RngFork() { backward_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngSnapshot backward_;
};

struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState now() {
    AutocastState s;
    s.cpu = compat::autocast_enabled(c10::DeviceType::CPU);
    s.cuda = compat::autocast_enabled(c10::DeviceType::CUDA);
    if (s.cpu) s.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
    if (s.cuda) s.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
    return s;
  }
};

// ------------------------------------------------------------------------------------------ recomputation

thread_local int recompute_depth = 0;

class RecomputeScope {
 public:
  RecomputeScope() { ++recompute_depth; }
  ~RecomputeScope() { --recompute_depth; }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

struct Deferred {
  std::function<void()> callback, abandoned;
};
thread_local std::vector<Deferred>* deferred_callbacks = nullptr;

// While it lives, end-of-backward callbacks are collected instead of queued on the nested pass (which
// ends long before the outer one); hand_over() queues them on the enclosing pass. If the nested pass
// threw, they are abandoned.
class NestedBackward {
 public:
  NestedBackward() : previous_(deferred_callbacks) { deferred_callbacks = &collected_; }
  ~NestedBackward() {
    deferred_callbacks = previous_;
    for (auto& d : collected_)
      if (d.abandoned) d.abandoned();
  }
  void hand_over() {
    deferred_callbacks = previous_;
    auto collected = std::move(collected_);
    collected_.clear();
    for (auto& d : collected) at_end_of_backward(std::move(d.callback), std::move(d.abandoned));
  }
  NestedBackward(const NestedBackward&) = delete;
  NestedBackward& operator=(const NestedBackward&) = delete;

 private:
  std::vector<Deferred>* previous_;
  std::vector<Deferred> collected_;
};

// ------------------------------------------------------------------------------------------ the node

struct Region : torch::CustomClassHolder {
  detail::CheckpointBody body;
  RngSnapshot rng;
  AutocastState autocast;
  std::vector<at::Tensor> remembered;  // remember()'s values from the first run, recalled in the recomputation
  size_t recalled = 0;                 // how many the recomputation under way has read
  // Set: what runs in place of the one nested backward. Under a mutex: the split that sets it may clear it while an
  // engine thread of another device still runs this node (an exception on one device ends the pass early).
  std::mutex runner_mutex;
  NestedBackwardRunner nested_runner;
};

// The regions remember() and recall() use on this thread now. A region's first run records into itself and
// keeps replaying what an enclosing recomputation replays (a region checkpointed inside a recomputed one runs
// its first time there); a recomputation replays its own region's values and records nothing.
struct Tape {
  Region* recording = nullptr;
  Region* replaying = nullptr;
};
thread_local Tape tape;

class TapeScope {
 public:
  TapeScope(Region& region, bool replay) : previous_(tape) {
    if (replay) {
      region.recalled = 0;
      tape = {nullptr, &region};
    } else {
      tape.recording = &region;
    }
  }
  ~TapeScope() { tape = previous_; }
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape previous_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `inputs` ends with an anchor that requires gradients, so the node is in the graph (and the region's
  // parameters get gradients) even when no input requires them.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs_and_anchor, c10::intrusive_ptr<Region> region) {
    std::vector<at::Tensor> inputs(inputs_and_anchor.begin(), inputs_and_anchor.end() - 1);
    ctx->save_for_backward(inputs);
    region->rng = RngSnapshot::of(inputs);
    region->autocast = AutocastState::now();
    TapeScope first_run(*region, /*replay=*/false);
    auto outputs = region->body(inputs);  // gradients are off inside a Function's forward
    torch::autograd::variable_list integral;
    for (const auto& out : outputs)
      if (out.defined() && !at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type()))
        integral.push_back(out);
    ctx->mark_non_differentiable(integral);
    ctx->set_materialize_grads(false);  // outputs the loss never used get no gradient, and no nested backward
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto region = c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables()) {
      if (!saved.defined()) {
        inputs.push_back(saved);
        continue;
      }
      auto input = saved.detach();
      if (saved.requires_grad()) input.requires_grad_(true);
      inputs.push_back(std::move(input));
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(region->rng);
      AutocastPause pause;
      AutocastScope cpu = region->autocast.cpu ? AutocastScope(c10::DeviceType::CPU, region->autocast.cpu_dtype)
                                               : AutocastScope();
      AutocastScope cuda = region->autocast.cuda ? AutocastScope(c10::DeviceType::CUDA, region->autocast.cuda_dtype)
                                                 : AutocastScope();
      RecomputeScope recompute;
      TapeScope replay(*region, /*replay=*/true);
      at::AutoGradMode with_gradients(true);
      outputs = region->body(inputs);
    }
    if (outputs.size() != grads.size())
      throw Error(fmt::format("xlr8::checkpoint: the region returned {} tensors when recomputed and {} the first "
                              "time; it must return the same every time",
                              outputs.size(), grads.size()));
    std::vector<at::Tensor> roots, root_grads;
    for (size_t k = 0; k < outputs.size(); ++k)
      if (outputs[k].defined() && outputs[k].requires_grad() && grads[k].defined()) {
        roots.push_back(outputs[k]);
        root_grads.push_back(grads[k]);
      }
    std::vector<at::Tensor> input_grads(inputs.size());
    if (!roots.empty()) {
      NestedBackward nested;
      NestedBackwardRunner runner;
      {
        std::lock_guard<std::mutex> lock(region->runner_mutex);
        runner = region->nested_runner;
      }
      if (runner) {
        input_grads = runner(roots, root_grads, inputs);
      } else {
        torch::autograd::backward(roots, root_grads);
        for (size_t i = 0; i < inputs.size(); ++i)
          if (inputs[i].defined() && inputs[i].requires_grad()) input_grads[i] = inputs[i].grad();
      }
      nested.hand_over();
    }
    torch::autograd::variable_list result(input_grads.begin(), input_grads.end());
    result.push_back(at::Tensor());  // the anchor
    result.push_back(at::Tensor());  // the region
    return result;
  }
};

// ------------------------------------------------------------------------------------------ marked units

struct Marked {
  std::weak_ptr<const torch::nn::Module> alive;
  std::string label;
  const torch::nn::Module* root = nullptr;
  bool ran = false, reported = false;
};
std::mutex marked_mutex;
std::unordered_map<const torch::nn::Module*, Marked>& marked_units() {
  static std::unordered_map<const torch::nn::Module*, Marked> units;
  return units;
}
// The live entry for `module` (a freed module's address may be reused), or null. Under marked_mutex.
Marked* marked(const torch::nn::Module& module) {
  auto& units = marked_units();
  auto it = units.find(&module);
  if (it == units.end()) return nullptr;
  auto alive = it->second.alive.lock();
  if (!alive || alive.get() != &module) {
    units.erase(it);
    return nullptr;
  }
  return &it->second;
}

std::vector<at::Tensor> run_region(const std::vector<at::Tensor>& inputs, detail::CheckpointBody body) {
  auto region = c10::make_intrusive<Region>();
  region->body = std::move(body);
  torch::autograd::variable_list with_anchor = inputs;
  with_anchor.push_back(at::zeros({}).requires_grad_(true));
  // As a TensorList: the node takes a std::vector for a plain value, not its tensors.
  return CheckpointFunction::apply(at::TensorList(with_anchor), std::move(region));
}

bool note_unit_ran(const torch::nn::Module& unit) {
  std::lock_guard<std::mutex> lock(marked_mutex);
  auto* entry = marked(unit);
  if (!entry) return false;
  entry->ran = true;
  return true;
}

}  // namespace

bool is_checkpoint_node(const torch::autograd::Node& node) {
  return dynamic_cast<const torch::autograd::CppNode<CheckpointFunction>*>(&node) != nullptr;
}

void run_nested_backward_with(torch::autograd::Node& node, NestedBackwardRunner runner) {
  auto& checkpoint = dynamic_cast<torch::autograd::CppNode<CheckpointFunction>&>(node);
  auto region = c10::static_intrusive_pointer_cast<Region>(checkpoint.ctx_.saved_data.at("region").toCapsule());
  std::lock_guard<std::mutex> lock(region->runner_mutex);
  region->nested_runner = std::move(runner);
}

bool recomputing() { return recompute_depth > 0; }

void remember(const at::Tensor& value) {
  if (tape.recording) tape.recording->remembered.push_back(value);
}

std::optional<at::Tensor> recall() {
  if (!tape.replaying) return std::nullopt;
  auto& region = *tape.replaying;
  if (region.recalled >= region.remembered.size())
    throw Error(fmt::format("xlr8::checkpoint: the recomputation asked for remembered value {} of the {} its first "
                            "run kept; a region must take the same path every time it runs",
                            region.recalled + 1, region.remembered.size()));
  return region.remembered[region.recalled++];
}

std::string accumulated_twice(const std::string& parameter) {
  return fmt::format("parameter {} received its gradient twice in one backward pass, the second time after its "
                     "reduction had started: it is read in two places of which at least one is an "
                     "activation-checkpointed region (xlr8::checkpoint or fsdp_activation_checkpointing), whose "
                     "gradients come from a backward of its own: inside and outside a region, or one module "
                     "checkpointed at two calls. Keep each parameter's uses in one region (untie the weights, or "
                     "widen the region to take in every use)",
                     parameter);
}

void at_end_of_backward(std::function<void()> callback, std::function<void()> abandoned) {
  if (deferred_callbacks) {
    deferred_callbacks->push_back({std::move(callback), std::move(abandoned)});
    return;
  }
  compat::at_end_of_backward(std::move(callback), std::move(abandoned));
}

void mark_recomputed_unit(const torch::nn::Module& module, std::string label, const torch::nn::Module& root) {
  std::lock_guard<std::mutex> lock(marked_mutex);
  marked_units()[&module] = Marked{module.shared_from_this(), std::move(label), &root};
}

std::string recomputed_unit_label(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(marked_mutex);
  auto* entry = marked(module);
  return entry ? entry->label : std::string();
}

std::vector<std::string> recomputed_units_never_run(const torch::nn::Module& root) {
  std::lock_guard<std::mutex> lock(marked_mutex);
  std::vector<std::string> never;
  for (auto it = marked_units().begin(); it != marked_units().end();) {
    auto& entry = it->second;
    if (entry.alive.expired()) {
      it = marked_units().erase(it);
      continue;
    }
    if (entry.root != &root) {
      ++it;
      continue;
    }
    if (!entry.ran && !entry.reported) never.push_back(entry.label);
    entry.reported = true;
    ++it;
  }
  std::sort(never.begin(), never.end());
  return never;
}

}  // namespace xlr8::recompute

// Declared by the public headers (xlr8::checkpoint, the sharded(...) guard) in their xlr8::detail.
namespace xlr8::detail {

bool checkpointing_records() { return at::GradMode::is_enabled(); }

std::vector<at::Tensor> run_checkpointed(const std::vector<at::Tensor>& inputs, CheckpointBody body) {
  return recompute::run_region(inputs, std::move(body));
}

bool checkpoints_unit(const torch::nn::Module& unit) { return recompute::note_unit_ran(unit); }

}  // namespace xlr8::detail
