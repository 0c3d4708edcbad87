// One pipeline stage running a schedule: activations in from the previous stage, out to the next, and their
// gradients the other way, point to point (xlr8/pipeline.hpp).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "parallel/pipeline/eval_mode.hpp"
#include "parallel/pipeline/split_backward.hpp"
#include "xlr8/activation_checkpoint.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/unshard.hpp"

namespace xlr8::pp {
namespace {

// A transfer's header: dtype, rank, then the sizes (at most kMaxDims).
constexpr int64_t kMaxDims = 8;

// A transfer's tag names the micro-batch, the virtual stage that receives it (of `virtual_stages`), its direction,
// and whether it is the header or the values.
int tag_of(int micro_batch, int receiver, int virtual_stages, Action::Kind kind, bool header) {
  return ((micro_batch * virtual_stages + receiver) * 2 + (kind == Action::Backward ? 1 : 0)) * 2 + (header ? 0 : 1);
}

at::Tensor header_of(const at::Tensor& t) {
  if (t.dim() > kMaxDims)
    throw Error(fmt::format("pipeline: a stage's output has {} dimensions; at most {}", t.dim(), kMaxDims));
  auto header = at::zeros({2 + kMaxDims}, at::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = static_cast<int64_t>(t.scalar_type());
  h[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) h[2 + d] = t.size(d);
  return header;
}

// Where the stage computes (its parameters' device; the CPU for a stage without any): the transfers' tensors live
// there, as NCCL sends device tensors only.
at::Device device_of(const torch::nn::Sequential& stage) {
  const auto parameters = stage->parameters();
  if (!parameters.empty()) return parameters.front().device();
  for (const auto& layer : stage->children())  // a stage of tied copies only: theirs
    if (const auto* tied = layer->as<TiedLayerImpl>(); tied && !tied->tied().parameters().empty())
      return tied->tied().parameters().front().device();
  return at::kCPU;
}

// A stage refuses to send an output of another shape than the step's first, before its neighbour waits for it.
void check_same_shape(int stage, const at::Tensor& y, std::vector<int64_t>& first_shape, const char* what) {
  if (first_shape.empty()) first_shape = y.sizes().vec();
  if (y.sizes().vec() != first_shape)
    throw Error(fmt::format("pipeline stage {}: its {} has shape [{}] in this micro-batch and [{}] in the step's "
                            "first; every micro-batch of a step must have the same shape (split the batch evenly)",
                            stage, what, fmt::join(y.sizes(), ", "), fmt::join(first_shape, ", ")));
}

// A micro-batch's backward through a chunk, from its output (`gradient` undefined: the loss) to its input (undefined
// on the first stage), whose gradient it returns: whole, or with `split` its input's part alone.
at::Tensor backward_to_input(const at::Tensor& output, const at::Tensor& gradient, const at::Tensor& input,
                             SplitBackward* split) {
  if (split) return split->backward_input({output}, {gradient}, {input})[0];
  if (gradient.defined()) torch::autograd::backward({output}, {gradient});
  else output.backward();
  return input.defined() ? input.grad() : at::Tensor();
}

}  // namespace

at::Tensor forward_layers(const torch::nn::Sequential& layers, at::Tensor x, int checkpoint_interval) {
  const std::shared_ptr<torch::nn::SequentialImpl> all = layers.ptr();
  if (checkpoint_interval <= 0 || !at::GradMode::is_enabled()) return all->forward(x);
  const auto interval = static_cast<size_t>(checkpoint_interval);
  for (size_t begin = 0; begin < all->size(); begin += interval) {
    const size_t end = std::min(all->size(), begin + interval);
    x = xlr8::checkpoint(
        [all, begin, end](const at::Tensor& in) {
          auto y = in;
          for (size_t i = begin; i < end; ++i) y = (all->begin() + static_cast<long>(i))->forward(y);
          return y;
        },
        x);
  }
  return x;
}

Pipeline::Pipeline(torch::nn::Sequential stage, Communicator group, Schedule schedule, int micro_batches,
                   std::vector<size_t> chunk_sizes)
    : stage_(std::move(stage)), group_(std::move(group)), schedule_(schedule), micro_batches_(micro_batches) {
  if (micro_batches_ < 1) throw ConfigError(fmt::format("pipeline: {} micro-batches; give 1 or more", micro_batches_));
  if (stage_->size() == 0) throw ConfigError("pipeline: the stage holds no layer");
  if (chunk_sizes.empty()) chunk_sizes = {stage_->size()};
  size_t total = 0;
  for (const size_t size : chunk_sizes) total += size == 0 ? stage_->size() + 1 : size;  // an empty chunk never fits
  if (total != stage_->size())
    throw ConfigError(fmt::format("pipeline: chunks of [{}] layers do not cut a stage of {}", fmt::join(chunk_sizes, ", "),
                                  stage_->size()));
  const auto named = stage_->named_children();
  size_t next = 0;
  for (const size_t size : chunk_sizes) {
    torch::nn::Sequential chunk;
    for (size_t i = next; i < next + size; ++i) chunk->push_back(named[i].key(), *(stage_->begin() + static_cast<long>(i)));
    chunks_.push_back(chunk);
    next += size;
  }
  (void)actions(schedule_, group_.size(), micro_batches_, group_.rank(), static_cast<int>(chunks_.size()));  // checks
}

void Pipeline::send(const at::Tensor& tensor, int to, int tag) {
  auto values = tensor.detach().contiguous();
  auto header = header_of(values).to(values.device());  // NCCL sends device tensors only
  pending_.push_back(group_.send_async(header, to, tag));
  pending_.push_back(group_.send_async(values, to, tag + 1));
  in_flight_.push_back(header);
  in_flight_.push_back(values);
  bytes_sent_ += values.numel() * static_cast<int64_t>(values.element_size()) + header.numel() * 8;
}

at::Tensor Pipeline::receive(int from, int tag, std::vector<int64_t>& agreed, const char* what) {
  const auto started = std::chrono::steady_clock::now();
  const auto device = device_of(stage_);
  auto header = at::zeros({2 + kMaxDims}, at::TensorOptions().dtype(at::kLong).device(device));
  group_.recv(header, from, tag);
  header = header.cpu();
  const int64_t* h = header.data_ptr<int64_t>();
  std::vector<int64_t> described(h, h + 2 + h[1]);
  if (agreed.empty()) {
    agreed = described;
  } else if (described != agreed) {
    auto sizes = [](const std::vector<int64_t>& d) {
      return fmt::format("[{}]", fmt::join(d.begin() + 2, d.end(), ", "));
    };
    throw Error(fmt::format("pipeline stage {}: the {} from stage {} has shape {} in this micro-batch and {} in the "
                            "step's first; every micro-batch of a step must have the same shape (split the batch "
                            "evenly)",
                            group_.rank(), what, from, sizes(described), sizes(agreed)));
  }
  std::vector<int64_t> sizes(described.begin() + 2, described.end());
  const auto dtype = static_cast<at::ScalarType>(described[0]);
  auto values = at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  group_.recv(values, from, tag + 1);
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return values;
}

double Pipeline::step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                      const LossFn& loss) {
  return run(inputs, targets, loss, /*train=*/true);
}

double Pipeline::evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                          const LossFn& loss) {
  at::NoGradGuard no_grad;
  EvalModeScope eval_mode(*stage_);
  // The last step's figures stay the step's (pipeline_stats()), whatever the evaluation does.
  const auto step_figures = std::tuple{wait_seconds_, step_seconds_, peak_held_, bytes_sent_};
  struct Restore {
    Pipeline& p;
    decltype(step_figures) figures;
    ~Restore() { std::tie(p.wait_seconds_, p.step_seconds_, p.peak_held_, p.bytes_sent_) = figures; }
  } restore{*this, step_figures};
  return run(inputs, targets, loss, /*train=*/false);
}

void Pipeline::check_micro_batches(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) const {
  const int stages = group_.size(), r = group_.rank(), m = micro_batches_;
  if (r == 0 && static_cast<int>(inputs.size()) != m)
    throw Error(fmt::format("pipeline: the first stage needs {} input micro-batches, got {}", m, inputs.size()));
  if (r == stages - 1 && static_cast<int>(targets.size()) != m)
    throw Error(fmt::format("pipeline: the last stage needs {} target micro-batches, got {}", m, targets.size()));
}

double Pipeline::run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss,
                     bool train) {
  const int stages = group_.size(), r = group_.rank(), m = micro_batches_, v = static_cast<int>(chunks_.size());
  const int virtual_stages = stages * v, previous = (r + stages - 1) % stages, next = (r + 1) % stages;
  check_micro_batches(inputs, targets);
  const auto started = std::chrono::steady_clock::now();
  wait_seconds_ = 0;
  bytes_sent_ = 0;
  peak_held_ = 0;
  int held = 0;
  // Per chunk: each micro-batch's input and output, and the shapes agreed in the step's first micro-batch.
  std::vector<std::vector<at::Tensor>> stage_inputs(v, std::vector<at::Tensor>(m)), stage_outputs = stage_inputs;
  std::vector<std::vector<int64_t>> agreed_activation(v), agreed_gradient(v), sent_shape(v);
  at::Tensor loss_sum = at::zeros({1}, at::kDouble);
  int backwards = 0;
  // Zero-bubble schedules: each micro-batch's backward in two parts, the graph kept between them.
  const bool splits = schedule_ == Schedule::InterleavedZeroBubble;
  std::vector<std::vector<SplitBackward>> split(splits ? v : 0, std::vector<SplitBackward>(m));
  for (const auto& [kind, k, c] : actions(schedule_, stages, m, r, v)) {
    const int vs = c * stages + r;  // this chunk's virtual stage
    const bool first = vs == 0, last = vs == virtual_stages - 1;
    if (kind == Action::Forward) {
      auto x = first ? inputs[k]
                     : receive(previous, tag_of(k, vs, virtual_stages, Action::Forward, true), agreed_activation[c],
                               "activation")
                           .requires_grad_(train);
      // A sharded stage gathers its parameters for this forward and again for its backward (nothing otherwise).
      auto y = xlr8::sharded(*stage_, [&] { return forward_layers(chunks_[c], x, checkpoint_interval_); });
      if (last) {
        auto value = loss(y, targets[k]);
        loss_sum += value.detach().to(at::kDouble).cpu();
        stage_outputs[c][k] = value / m;  // one process's mean over the global batch
      } else {
        check_same_shape(r, y, sent_shape[c], "output");
        send(y, next, tag_of(k, vs + 1, virtual_stages, Action::Forward, true));
        stage_outputs[c][k] = y;
      }
      if (!train) {  // evaluation holds nothing after the forward
        stage_outputs[c][k] = at::Tensor();
        continue;
      }
      stage_inputs[c][k] = x;
      peak_held_ = std::max(peak_held_, ++held);
      continue;
    }
    if (!train) continue;
    if (kind == Action::Weight) {  // the parameters' part of a split backward (zero-bubble schedules)
      if (before_backward_) before_backward_(++backwards == m * v);
      split[c][k].backward_weight();
      --held;
      continue;
    }
    if (before_backward_ && !splits) before_backward_(++backwards == m * v);
    const auto g = last ? at::Tensor()
                        : receive(next, tag_of(k, vs, virtual_stages, Action::Backward, true), agreed_gradient[c],
                                  "gradient");
    const auto g_in = backward_to_input(stage_outputs[c][k], g, first ? at::Tensor() : stage_inputs[c][k],
                                        splits ? &split[c][k] : nullptr);
    if (!first)
      send(g_in.defined() ? g_in : at::zeros_like(stage_inputs[c][k]), previous,
           tag_of(k, vs - 1, virtual_stages, Action::Backward, true));
    stage_inputs[c][k] = at::Tensor();  // this micro-batch's activations are freed (a split one's at its Weight)
    stage_outputs[c][k] = at::Tensor();
    if (!splits) --held;
  }
  for (auto& work : pending_) work.wait();
  pending_.clear();
  in_flight_.clear();
  if (train) whole_backwards_ = split_regions_ = 0;  // an evaluation's run leaves the last step's counts (evaluate())
  for (const auto& chunk : split)
    for (const auto& part : chunk) whole_backwards_ += part.whole_backwards(), split_regions_ += part.split_regions();
  auto on_device = loss_sum.to(device_of(stage_));
  group_.broadcast(on_device, stages - 1);
  const double mean = on_device.item<double>() / m;
  step_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return mean;
}

}  // namespace xlr8::pp
