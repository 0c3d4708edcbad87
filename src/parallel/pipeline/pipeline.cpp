// One pipeline stage running a schedule: activations in from the previous stage, out to the next, and their
// gradients the other way, point to point (xlr8/pipeline.hpp).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>

#include <chrono>

#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/unshard.hpp"

namespace xlr8::pp {
namespace {

// A transfer's header: dtype, rank, then the sizes (at most kMaxDims).
constexpr int64_t kMaxDims = 8;

int tag_of(int micro_batch, Action::Kind kind, bool header) {
  return micro_batch * 4 + (kind == Action::Backward ? 2 : 0) + (header ? 0 : 1);
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
  return parameters.empty() ? at::Device(at::kCPU) : parameters.front().device();
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential stage, Communicator group, Schedule schedule, int micro_batches)
    : stage_(std::move(stage)), group_(std::move(group)), schedule_(schedule), micro_batches_(micro_batches) {
  if (micro_batches_ < 1) throw ConfigError(fmt::format("pipeline: {} micro-batches; give 1 or more", micro_batches_));
  if (stage_->size() == 0) throw ConfigError("pipeline: the stage holds no layer");
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
  const int stages = group_.size(), s = group_.rank(), m = micro_batches_;
  const bool first = s == 0, last = s == stages - 1;
  if (first && static_cast<int>(inputs.size()) != m)
    throw Error(fmt::format("pipeline: the first stage needs {} input micro-batches, got {}", m, inputs.size()));
  if (last && static_cast<int>(targets.size()) != m)
    throw Error(fmt::format("pipeline: the last stage needs {} target micro-batches, got {}", m, targets.size()));
  wait_seconds_ = 0;
  bytes_sent_ = 0;
  std::vector<at::Tensor> stage_inputs(m), stage_outputs(m);
  at::Tensor loss_sum = at::zeros({1}, at::kDouble);
  std::vector<int64_t> agreed_activation, agreed_gradient, sent_shape;
  int backwards = 0;
  // A stage refuses to send an output of another shape than the step's first, before its neighbour waits for it.
  auto check_shape = [&](const at::Tensor& y, std::vector<int64_t>& first_shape, const char* what) {
    if (first_shape.empty()) first_shape = y.sizes().vec();
    if (y.sizes().vec() != first_shape)
      throw Error(fmt::format("pipeline stage {}: its {} has shape [{}] in this micro-batch and [{}] in the step's "
                              "first; every micro-batch of a step must have the same shape (split the batch evenly)",
                              s, what, fmt::join(y.sizes(), ", "), fmt::join(first_shape, ", ")));
  };
  for (const auto& [kind, k] : actions(schedule_, stages, m, s)) {
    if (kind == Action::Forward) {
      auto x = first ? inputs[k]
                     : receive(s - 1, tag_of(k, Action::Forward, true), agreed_activation, "activation")
                           .requires_grad_(true);
      // A sharded stage gathers its parameters for this forward and again for its backward (nothing otherwise).
      auto y = xlr8::sharded(*stage_, [&] { return stage_->forward(x); });
      if (last) {
        auto value = loss(y, targets[k]);
        loss_sum += value.detach().to(at::kDouble).cpu();
        stage_outputs[k] = value / m;  // one process's mean over the global batch
      } else {
        check_shape(y, sent_shape, "output");
        send(y, s + 1, tag_of(k, Action::Forward, true));
        stage_outputs[k] = y;
      }
      stage_inputs[k] = x;
      continue;
    }
    if (before_backward_) before_backward_(++backwards == m);
    if (last) {
      stage_outputs[k].backward();
    } else {
      auto g = receive(s + 1, tag_of(k, Action::Backward, true), agreed_gradient, "gradient");
      torch::autograd::backward({stage_outputs[k]}, {g});
    }
    if (!first) {
      auto g_in = stage_inputs[k].grad();
      send(g_in.defined() ? g_in : at::zeros_like(stage_inputs[k]), s - 1, tag_of(k, Action::Backward, true));
    }
    stage_inputs[k] = at::Tensor();  // this micro-batch's activations are freed
    stage_outputs[k] = at::Tensor();
  }
  for (auto& work : pending_) work.wait();
  pending_.clear();
  in_flight_.clear();
  auto on_device = loss_sum.to(device_of(stage_));
  group_.broadcast(on_device, stages - 1);
  return on_device.item<double>() / m;
}

}  // namespace xlr8::pp
