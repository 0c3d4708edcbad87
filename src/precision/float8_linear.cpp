// The fp8 product of an xlr8::nn::Linear: forward x @ w^T, backward's grad_input g @ w and grad_weight g^T @ x,
// each gemm from float8 casts of its two operands (float8_linear.hpp).
#include "precision/float8_linear.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <limits>
#include <vector>

#include "compat/torch_compat.hpp"
#include "parallel/recompute/recompute.hpp"
#include "xlr8/autocast.hpp"
#include "xlr8/error.hpp"

namespace xlr8::fp8 {
namespace {

constexpr auto kE4M3 = at::kFloat8_e4m3fn;
constexpr auto kE5M2 = at::kFloat8_e5m2;

// fp8 values and the scale they were cast with (a scalar, or one per row / column of the operand).
struct Cast {
  at::Tensor data, scale;
};

using Groups = std::vector<Communicator*>;

void reduce_max(at::Tensor& amax, const Groups& groups) {
  for (auto* group : groups)
    if (group->valid() && group->size() > 1) group->all_reduce(amax, ReduceOp::MAX);
}

// The amax of `t` over `dim` (kept, so the scale broadcasts), or of all of it when dim is -1: one reduction,
// no tensor of magnitudes.
at::Tensor amax_of(const at::Tensor& t, int64_t dim) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  if (dim < 0) return at::linalg_vector_norm(t, inf, at::OptionalIntArrayRef(), false, at::kFloat);
  return at::linalg_vector_norm(t, inf, at::IntArrayRef{dim}, /*keepdim=*/true, at::kFloat);
}

Cast cast_dynamic(const at::Tensor& t, at::ScalarType float8, int64_t dim, const Groups& groups) {
  auto amax = amax_of(t, dim);
  reduce_max(amax, groups);
  auto scale = scale_for(amax, float8);
  return {cast_to_float8(t, scale, float8), scale};
}

// Records `t`'s amax in the history and, every `interval` records, recomputes the scale from it (kept where the
// amax is zero or not finite, as Transformer Engine does).
void record_amax(const at::Tensor& t, at::ScalarType float8, AmaxHistory& h, const Recipe& recipe,
                 const Groups& groups) {
  auto amax = amax_of(t, -1);
  reduce_max(amax, groups);
  h.history = at::cat({amax.reshape({1}), h.history.narrow(0, 0, h.history.size(0) - 1)});
  if (++h.casts % recipe.interval != 0) return;
  auto chosen = recipe.amax_most_recent ? h.history[0] : h.history.max();
  auto usable = chosen.gt(0).logical_and(chosen.isfinite());
  h.scale = at::where(usable, scale_for(chosen, float8, recipe.margin), h.scale);
}

// Delayed scaling: the cast uses the scale earlier amaxes gave, then records its own amax when `record`. A forward
// cast (`forward`) inside a checkpointed region is recomputed with the scale its first run used.
Cast cast_delayed(const at::Tensor& t, at::ScalarType float8, AmaxHistory& h, const Recipe& recipe,
                  const Groups& groups, bool record, bool forward) {
  if (h.history.device() != t.device()) {
    h.history = h.history.to(t.device());
    h.scale = h.scale.to(t.device());
  }
  auto scale = forward ? recompute::recall().value_or(h.scale) : h.scale;
  if (forward) recompute::remember(scale);
  Cast cast{cast_to_float8(t, scale, float8), scale};
  if (record) record_amax(t, float8, h, recipe, groups);
  return cast;
}

// What one product's forward hands its backward besides the saved tensors.
struct Call : torch::CustomClassHolder {
  std::shared_ptr<LinearState> state;
  bool training = false;
  at::ScalarType compute = at::kFloat;
  // Tensorwise and delayed: the forward's fp8 input (kept in place of the wider input: 1 byte an element) and the
  // scales backward casts the weight with again (a sharded weight is gathered again for backward, not kept).
  at::Tensor input8, input_scale, weight_scale;
  // A backward in two parts (a zero-bubble schedule's): the scale the inputs' part cast grad_output with, which the
  // weights' part casts it with again, so that its product equals a whole backward's and nothing is recorded twice.
  at::Tensor grad_scale;
};

// Whether backward needs the input in the compute dtype: row-wise re-casts it along another axis, and
// override_linear_precision's wgrad multiplies it as it is.
bool backward_reads_wide_input(const Recipe& recipe) {
  return recipe.scaling == Scaling::Rowwise || recipe.compute_precision[2];
}

// Which groups reduce an operand's amax. Per tensor: every group its elements are spread over. Per row: the
// groups that split the contraction of the gemm it enters.
enum class Spread { Input, Weight, Grad, ContractionIn, ContractionOut, ContractionBatch };
Groups groups_for(AmaxGroups& g, Spread what) {
  Groups out;
  const bool batch = what == Spread::Input || what == Spread::Grad || what == Spread::ContractionBatch;
  const bool tensor = (g.tensor_splits_in && (what == Spread::Input || what == Spread::ContractionIn)) ||
                      (g.tensor_splits_out && (what == Spread::Grad || what == Spread::ContractionOut)) ||
                      (what == Spread::Weight && (g.tensor_splits_in || g.tensor_splits_out));
  if (batch) out.push_back(&g.batch);
  if (tensor) out.push_back(&g.tensor);
  return out;
}

at::Tensor forward_product(const at::Tensor& x, const at::Tensor& w, Call& call) {
  auto& state = *call.state;
  const auto& recipe = state.recipe();
  // Evaluation reduces nothing: ranks may evaluate different numbers of batches, and no gradient depends on it.
  auto spread = [&](Spread what) { return call.training ? groups_for(state.groups, what) : Groups{}; };
  if (recipe.scaling == Scaling::Rowwise) {
    auto xs = cast_dynamic(x, kE4M3, 1, spread(Spread::ContractionIn));
    auto ws = cast_dynamic(w, kE4M3, 1, spread(Spread::ContractionIn));
    return scaled_mm(xs.data, ws.data.t(), xs.scale, ws.scale.t(), call.compute);
  }
  Cast xs, ws;
  if (recipe.scaling == Scaling::Tensorwise) {
    xs = cast_dynamic(x, kE4M3, -1, spread(Spread::Input));
    ws = cast_dynamic(w, kE4M3, -1, spread(Spread::Weight));
  } else {
    const bool record = call.training && !recompute::recomputing();
    xs = cast_delayed(x, kE4M3, state.input, recipe, spread(Spread::Input), record, /*forward=*/true);
    ws = cast_delayed(w, kE4M3, state.weight, recipe, spread(Spread::Weight), record, /*forward=*/true);
  }
  call.input8 = xs.data;
  call.input_scale = xs.scale;
  call.weight_scale = ws.scale;
  if (recipe.compute_precision[0]) return at::mm(x, w.to(call.compute).t());
  return scaled_mm(xs.data, ws.data.t(), xs.scale, ws.scale, call.compute);
}

// grad_input and grad_weight (either undefined where not needed) from grad_output g.
std::pair<at::Tensor, at::Tensor> backward_products(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                                    Call& call, bool need_input, bool need_weight) {
  auto& state = *call.state;
  const auto& recipe = state.recipe();
  auto& groups = state.groups;
  at::Tensor gx, gw;
  if (recipe.scaling == Scaling::Rowwise) {  // each gemm casts along its own contraction
    if (need_input) {
      auto gs = cast_dynamic(g, kE4M3, 1, groups_for(groups, Spread::ContractionOut));
      auto ws = cast_dynamic(w, kE4M3, 0, groups_for(groups, Spread::ContractionOut));
      gx = scaled_mm(gs.data, ws.data, gs.scale, ws.scale, call.compute);
    }
    if (need_weight) {
      auto gs = cast_dynamic(g, kE4M3, 0, groups_for(groups, Spread::ContractionBatch));
      auto xs = cast_dynamic(x, kE4M3, 0, groups_for(groups, Spread::ContractionBatch));
      gw = scaled_mm(gs.data.t(), xs.data, gs.scale.t(), xs.scale, call.compute);
    }
    return {gx, gw};
  }
  const auto grad_type = recipe.gradients_e5m2 ? kE5M2 : kE4M3;
  const auto grad_groups = groups_for(groups, Spread::Grad);
  const bool weights_part = need_weight && !need_input && call.grad_scale.defined();
  auto gs = weights_part ? Cast{cast_to_float8(g, call.grad_scale, grad_type), call.grad_scale}
            : recipe.scaling == Scaling::Tensorwise
                ? cast_dynamic(g, grad_type, -1, grad_groups)
                : cast_delayed(g, grad_type, state.grad_output, recipe, grad_groups, /*record=*/true,
                               /*forward=*/false);
  if (need_input && !need_weight) call.grad_scale = gs.scale;  // an inputs' part: the weights' may follow
  if (weights_part) call.grad_scale = at::Tensor();               // used once: another backward casts anew
  // The forward's fp8 input, and its weight cast again with the forward's scale: the values the forward multiplied.
  const auto& sw = call.weight_scale;
  if (need_input)
    gx = recipe.compute_precision[1] ? at::mm(g, w.to(call.compute))
                                     : scaled_mm(gs.data, cast_to_float8(w, sw, kE4M3), gs.scale, sw, call.compute);
  if (need_weight)
    gw = recipe.compute_precision[2] ? at::mm(g.t(), x)
                                     : scaled_mm(gs.data.t(), call.input8, gs.scale, call.input_scale, call.compute);
  return {gx, gw};
}

struct Float8Product : torch::autograd::Function<Float8Product> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            c10::intrusive_ptr<Call> call) {
    AutocastPause pause;  // the products below are fp8's, in the dtype the call chose
    auto y = forward_product(x, w, *call);
    ctx->save_for_backward({backward_reads_wide_input(call->state->recipe()) ? x : at::Tensor(), w});
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(call));
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    AutocastPause pause;
    auto call = c10::static_intrusive_pointer_cast<Call>(ctx->saved_data["call"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    auto g = grads[0].to(call->compute).contiguous();
    auto [gx, gw] = backward_products(g, x, w, *call, ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {gx, gw.defined() ? gw.to(w.scalar_type()) : gw, at::Tensor()};
  }
};

const char* const kCasts[] = {"input", "weight", "grad_output"};

}  // namespace

bool is_float8_product(const torch::autograd::Node& node) {
  return dynamic_cast<const torch::autograd::CppNode<Float8Product>*>(&node) != nullptr;
}

LinearState::LinearState(Recipe recipe, std::string path) : recipe_(recipe), path_(std::move(path)) {
  for (auto* h : {&input, &weight, &grad_output}) {
    h->history = at::zeros({recipe_.amax_history_len}, at::kFloat);
    h->scale = at::ones({}, at::kFloat);
  }
}

std::map<std::string, at::Tensor> LinearState::state_dict() const {
  std::map<std::string, at::Tensor> out;
  if (recipe_.scaling != Scaling::Delayed) return out;
  const AmaxHistory* histories[] = {&input, &weight, &grad_output};
  for (int k = 0; k < 3; ++k) {
    const std::string name = kCasts[k];
    out[name + ".amax_history"] = histories[k]->history.to(at::kCPU).clone();
    out[name + ".scale"] = histories[k]->scale.to(at::kCPU).clone();
    out[name + ".casts"] = at::scalar_tensor(histories[k]->casts, at::kLong);
  }
  return out;
}

void LinearState::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  if (recipe_.scaling != Scaling::Delayed) return;
  AmaxHistory* histories[] = {&input, &weight, &grad_output};
  for (int k = 0; k < 3; ++k) {
    const std::string name = kCasts[k];
    auto get = [&](const std::string& key) {
      auto it = state.find(name + "." + key);
      if (it == state.end())
        throw Error(fmt::format("fp8 layer {}: the checkpoint has no {}.{} (saved without delayed scaling?); "
                                          "resume with the recipe it was saved with",
                                          path_, name, key));
      return it->second;
    };
    auto history = get("amax_history");
    if (history.dim() != 1 || history.size(0) != recipe_.amax_history_len)
      throw Error(fmt::format("fp8 layer {}: the checkpoint's {} amax history holds {} values but "
                                        "amax_history_len is {}; resume with the length it was saved with",
                                        path_, name, history.numel(), recipe_.amax_history_len));
    histories[k]->history = history.to(at::kFloat).clone();
    histories[k]->scale = get("scale").to(at::kFloat).reshape({}).clone();
    histories[k]->casts = get("casts").item<int64_t>();
  }
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::shared_ptr<LinearState>& state,
                  bool training) {
  const auto device = input.device().type();
  auto call = c10::make_intrusive<Call>();
  call->state = state;
  call->training = training;
  call->compute = compat::autocast_enabled(device) ? compat::autocast_dtype(device) : input.scalar_type();
  auto sizes = input.sizes().vec();
  auto rows = input.to(call->compute).reshape({-1, sizes.back()});
  auto product = Float8Product::apply(rows, weight, std::move(call));
  sizes.back() = weight.size(0);
  return product.view(sizes);
}

}  // namespace xlr8::fp8
