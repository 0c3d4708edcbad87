#include "checkpoint/optimizer_state.hpp"

#include <fmt/format.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>

#include "compat/torch_compat.hpp"
#include "xlr8/error.hpp"

namespace xlr8::checkpoints {
namespace {

// Each kind: how its state object reads into and out of ParameterState. Optional tensors (AMSGrad's
// max_exp_avg_sq, RMSprop's momentum and centred buffers) are left out when undefined.
template <class State>
struct Codec;

void put(ParameterState& out, const char* name, const at::Tensor& t) {
  if (t.defined()) out.tensors[name] = t;
}
at::Tensor take(const ParameterState& in, const char* name, const at::Tensor& leaf) {
  auto it = in.tensors.find(name);
  if (it == in.tensors.end()) return {};
  return it->second.to(leaf.options()).reshape(leaf.sizes()).clone();
}
int64_t counter(const ParameterState& in) {
  auto it = in.counters.find("step");
  return it == in.counters.end() ? 0 : it->second;
}

// Adam and AdamW keep the same state under two types.
template <class S>
struct AdamCodec {
  static void read(const S& s, ParameterState& out) {
    put(out, "exp_avg", s.exp_avg());
    put(out, "exp_avg_sq", s.exp_avg_sq());
    put(out, "max_exp_avg_sq", s.max_exp_avg_sq());
    out.counters["step"] = s.step();
  }
  static void write(S& s, const ParameterState& in, const at::Tensor& leaf) {
    s.exp_avg(take(in, "exp_avg", leaf)).exp_avg_sq(take(in, "exp_avg_sq", leaf));
    s.max_exp_avg_sq(take(in, "max_exp_avg_sq", leaf)).step(counter(in));
  }
};
template <>
struct Codec<torch::optim::AdamWParamState> : AdamCodec<torch::optim::AdamWParamState> {};
template <>
struct Codec<torch::optim::AdamParamState> : AdamCodec<torch::optim::AdamParamState> {};
template <>
struct Codec<torch::optim::SGDParamState> {
  using S = torch::optim::SGDParamState;
  static void read(const S& s, ParameterState& out) { put(out, "momentum_buffer", s.momentum_buffer()); }
  static void write(S& s, const ParameterState& in, const at::Tensor& leaf) {
    s.momentum_buffer(take(in, "momentum_buffer", leaf));
  }
};
template <>
struct Codec<torch::optim::RMSpropParamState> {
  using S = torch::optim::RMSpropParamState;
  static void read(const S& s, ParameterState& out) {
    put(out, "square_avg", s.square_avg());
    put(out, "momentum_buffer", s.momentum_buffer());
    put(out, "grad_avg", s.grad_avg());
    out.counters["step"] = s.step();
  }
  static void write(S& s, const ParameterState& in, const at::Tensor& leaf) {
    s.square_avg(take(in, "square_avg", leaf)).momentum_buffer(take(in, "momentum_buffer", leaf));
    s.grad_avg(take(in, "grad_avg", leaf)).step(counter(in));
  }
};
template <>
struct Codec<torch::optim::AdagradParamState> {
  using S = torch::optim::AdagradParamState;
  static void read(const S& s, ParameterState& out) {
    put(out, "sum", s.sum());
    out.counters["step"] = s.step();
  }
  static void write(S& s, const ParameterState& in, const at::Tensor& leaf) {
    s.sum(take(in, "sum", leaf)).step(counter(in));
  }
};

template <class State>
std::optional<ParameterState> read_as(const torch::optim::OptimizerParamState& base) {
  const auto* s = dynamic_cast<const State*>(&base);
  if (!s) throw Error("optimizer state of an unexpected type: cannot write it portably");
  ParameterState out;
  Codec<State>::read(*s, out);
  return out;
}

template <class State>
void write_as(torch::optim::Optimizer& optimizer, const at::Tensor& leaf, const ParameterState& in) {
  auto state = std::make_unique<State>();
  Codec<State>::write(*state, in, leaf);
  optimizer.state()[compat::optimizer_state_key(leaf)] = std::move(state);
}

}  // namespace

std::optional<std::string> portable_optimizer_kind(const torch::optim::Optimizer& optimizer) {
  // Subclasses first: AdamW derives from nothing of Adam's, but be explicit about the order anyway.
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "sgd";
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer)) return "rmsprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer)) return "adagrad";
  return std::nullopt;
}

std::vector<std::string> state_tensor_names(const std::string& kind) {
  if (kind == "adamw" || kind == "adam") return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  if (kind == "sgd") return {"momentum_buffer"};
  if (kind == "rmsprop") return {"square_avg", "momentum_buffer", "grad_avg"};
  if (kind == "adagrad") return {"sum"};
  return {};
}

namespace {

// Whether any of `optimizer`'s groups, whose options are `Options`, says `yes`.
template <class Options, class Test>
bool any_group(const torch::optim::Optimizer& optimizer, Test yes) {
  const auto& groups = optimizer.param_groups();
  return std::any_of(groups.begin(), groups.end(),
                     [&](const auto& g) { return yes(static_cast<const Options&>(g.options())); });
}

}  // namespace

std::vector<std::string> kept_state_names(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  const auto kind = portable_optimizer_kind(optimizer);
  if (kind == "adamw" || kind == "adam") {
    const bool amsgrad = kind == "adamw" ? any_group<AdamWOptions>(optimizer, [](const auto& o) { return o.amsgrad(); })
                                         : any_group<AdamOptions>(optimizer, [](const auto& o) { return o.amsgrad(); });
    if (amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    return {"exp_avg", "exp_avg_sq"};
  }
  if (kind == "sgd") {
    if (any_group<SGDOptions>(optimizer, [](const auto& o) { return o.momentum() != 0; })) return {"momentum_buffer"};
    return {};
  }
  if (kind == "rmsprop") {
    std::vector<std::string> names{"square_avg"};
    if (any_group<RMSpropOptions>(optimizer, [](const auto& o) { return o.momentum() > 0; }))
      names.push_back("momentum_buffer");
    if (any_group<RMSpropOptions>(optimizer, [](const auto& o) { return o.centered(); })) names.push_back("grad_avg");
    return names;
  }
  if (kind == "adagrad") return {"sum"};
  throw Error("kept_state_names: the optimizer's type has no portable state");
}

std::optional<ParameterState> read_parameter_state(const torch::optim::Optimizer& optimizer, const at::Tensor& leaf) {
  auto it = optimizer.state().find(compat::optimizer_state_key(leaf));
  if (it == optimizer.state().end()) return std::nullopt;
  auto kind = portable_optimizer_kind(optimizer);
  const auto& base = *it->second;
  if (kind == "adamw") return read_as<torch::optim::AdamWParamState>(base);
  if (kind == "adam") return read_as<torch::optim::AdamParamState>(base);
  if (kind == "sgd") return read_as<torch::optim::SGDParamState>(base);
  if (kind == "rmsprop") return read_as<torch::optim::RMSpropParamState>(base);
  if (kind == "adagrad") return read_as<torch::optim::AdagradParamState>(base);
  throw Error("read_parameter_state: the optimizer's type has no portable state");
}

void write_parameter_state(torch::optim::Optimizer& optimizer, const at::Tensor& leaf, const ParameterState& state) {
  auto kind = portable_optimizer_kind(optimizer);
  if (kind == "adamw") return write_as<torch::optim::AdamWParamState>(optimizer, leaf, state);
  if (kind == "adam") return write_as<torch::optim::AdamParamState>(optimizer, leaf, state);
  if (kind == "sgd") return write_as<torch::optim::SGDParamState>(optimizer, leaf, state);
  if (kind == "rmsprop") return write_as<torch::optim::RMSpropParamState>(optimizer, leaf, state);
  if (kind == "adagrad") return write_as<torch::optim::AdagradParamState>(optimizer, leaf, state);
  throw Error("write_parameter_state: the optimizer's type has no portable state");
}

}  // namespace xlr8::checkpoints
