// What the Accelerator does across processes: collectives on tensors and nested values, running code
// in process order, and progress shown on the main process.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>

#include "xlr8/env.hpp"
#include "core/tensor_text.hpp"
#include "accelerate/accelerator_impl.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

namespace {

at::Tensor gather_over(Communicator& group, const at::Tensor& tensor) {
  auto input = tensor.contiguous();
  const int P = group.size();
  // A 0-d tensor becomes one value per process, [1] on one process as [P] on P: code written for P runs on 1.
  if (P == 1) return input.dim() == 0 ? input.reshape({1}) : input;
  auto flat = at::empty({input.numel() * P}, input.options());
  group.all_gather(flat, input);
  if (input.dim() == 0) return flat;
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] *= P;
  return flat.view(shape);
}

// Every rank's tensor shapes and dtypes must agree, or all_gather would fail obscurely or hang. A hash of
// the layout travels first (one small tensor collective); only when they differ does the text follow, so
// that every rank throws the same Error naming the first difference. An undefined tensor is agreed on
// the same way, so no rank throws alone and leaves the others waiting.
void check_same_layout(Communicator& group, const std::vector<at::Tensor>& tensors, const char* what) {
  std::vector<std::string> mine;
  for (const auto& t : tensors) mine.push_back(core::describe(t));  // "undefined" for an undefined one
  const std::string text = nlohmann::json(mine).dump();
  auto hashes = at::empty({group.size()}, at::kLong);
  group.all_gather(hashes, at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(text)), at::kLong));
  const bool agree = (hashes == hashes[0]).all().item<bool>();
  if (agree) {
    for (size_t i = 0; i < mine.size(); ++i)
      if (mine[i] == "undefined")
        throw Error(fmt::format("{}(): tensor {} of {} is undefined on every rank", what, i, mine.size()));
    return;
  }
  auto all = group.all_gather_object(text);
  const auto first = nlohmann::json::parse(all[0]).get<std::vector<std::string>>();
  for (size_t r = 1; r < all.size(); ++r) {
    const auto other = nlohmann::json::parse(all[r]).get<std::vector<std::string>>();
    if (other.size() != first.size())
      throw Error(fmt::format("{}(): rank {} passed {} tensor(s) and rank 0 passed {}: every rank must pass the same "
                              "structure",
                              what, r, other.size(), first.size()));
    for (size_t i = 0; i < first.size(); ++i)
      if (other[i] != first[i])
        throw Error(fmt::format("{}(): tensor {} is {} on rank {} but {} on rank 0: every rank must pass the same "
                                "shapes and dtypes (pad_across_processes pads a dimension to the longest)",
                                what, i, other[i], r, first[i]));
  }
}

}  // namespace

std::vector<at::Tensor> Accelerator::gather_tensors(const std::vector<at::Tensor>& tensors, bool for_metrics) const {
  // gather_for_metrics: over the ranks that read different batches (dp: the loader shards over it);
  // tensor- and context-parallel peers read the same batch and would repeat its samples.
  auto& group = for_metrics ? impl_->state->mesh().group(MeshDim::dp) : impl_->world();
  if (group.size() > 1) check_same_layout(group, tensors, for_metrics ? "gather_for_metrics" : "gather");
  const auto& gs = *impl_->gradient_state;
  const bool drop_padding = for_metrics && gs.end_of_dataloader() && gs.remainder() > 0;
  std::vector<at::Tensor> out;
  for (const auto& tensor : tensors) {
    auto gathered = gather_over(group, tensor);
    if (drop_padding && gathered.dim() > 0)
      gathered = gathered.narrow(0, 0, std::min<int64_t>(gs.remainder(), gathered.size(0)));
    out.push_back(gathered);
  }
  return out;
}

at::Tensor Accelerator::gather(const at::Tensor& tensor) const { return gather_tensors({tensor}, false).front(); }

at::Tensor Accelerator::gather_for_metrics(const at::Tensor& tensor) const {
  return gather_tensors({tensor}, true).front();
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, ReduceOp op) const {
  auto result = tensor.clone();
  impl_->world().all_reduce(result, op);
  return result;
}

at::Tensor Accelerator::shard_sequence(const at::Tensor& tensor, int64_t dim) const {
  const auto context = impl_->sequence_context();
  if (!context) return tensor;
  impl_->check_sequence_length(tensor.size(dim));
  return cp::shard_sequence(tensor, context->group, dim, cp::split_of(context->strategy));
}

at::Tensor Accelerator::unshard_sequence(const at::Tensor& local, int64_t dim) const {
  const auto context = impl_->sequence_context();
  return context ? cp::unshard_sequence(local, context->group, dim, cp::split_of(context->strategy)) : local;
}

at::Tensor Accelerator::pad_across_processes(const at::Tensor& tensor, int64_t dim, double pad_index, bool pad_first) const {
  // As Accelerate: a dimension the tensor does not have (any, for a 0-d tensor) leaves it as it is.
  if (dim >= tensor.dim() || dim < -tensor.dim() || num_processes() == 1) return tensor;
  if (dim < 0) dim += tensor.dim();
  auto size = at::full({1}, tensor.size(dim), at::kLong);
  impl_->world().all_reduce(size, ReduceOp::MAX);
  int64_t longest = size.item<int64_t>();
  if (longest == tensor.size(dim)) return tensor;
  auto shape = tensor.sizes().vec();
  shape[dim] = longest;
  auto padded = at::full(shape, pad_index, tensor.options());
  int64_t start = pad_first ? longest - tensor.size(dim) : 0;
  padded.narrow(dim, start, tensor.size(dim)).copy_(tensor);
  return padded;
}

void Accelerator::wait_for_everyone() const { impl_->world().barrier(); }

void Accelerator::main_process_first(const std::function<void()>& fn) const {
  if (!is_main_process()) wait_for_everyone();
  fn();
  if (is_main_process()) wait_for_everyone();
}

void Accelerator::local_main_process_first(const std::function<void()>& fn) const {
  // As Accelerate: a barrier over all processes, so every machine's local main process runs first.
  if (!is_local_main_process()) wait_for_everyone();
  fn();
  if (is_local_main_process()) wait_for_everyone();
}

std::vector<std::string> Accelerator::gather_object(const std::string& payload) const {
  if (num_processes() == 1) return {payload};
  return impl_->world().all_gather_object(payload);
}


ProgressBar Accelerator::progress(int64_t total, ProgressOptions options) const {
  if (!is_main_process()) return {};
  auto mode = impl_->options.progress;
  if (!mode) mode = parse_progress_mode(Env::current().get("XLR8_PROGRESS").value_or("auto"), "XLR8_PROGRESS");
  return ProgressBar(total, std::move(options), *mode);
}

}  // namespace xlr8
