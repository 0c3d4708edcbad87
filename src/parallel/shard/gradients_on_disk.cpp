// The reduced gradients on disk from their reduction to the step (gradients_on_disk.hpp).
#include "parallel/shard/gradients_on_disk.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "parallel/shard/tensor_swapper.hpp"

namespace xlr8::shard {

GradientsOnDisk::GradientsOnDisk(TensorSwapper& swapper, std::vector<std::vector<Part>> parts) : swapper_(swapper) {
  for (auto& p : parts) groups_.push_back(Group{.parts = std::move(p)});
}

std::string GradientsOnDisk::slot(size_t group) { return fmt::format("{}/gradient", group); }

std::vector<at::Tensor> GradientsOnDisk::views(const at::Tensor& chunk, const std::vector<Part>& parts) {
  // The views the leaves' .grad would be in memory (ShardedModel::hand_over_reduced), so that norms match them.
  std::vector<at::Tensor> out;
  for (const auto& p : parts) out.push_back(chunk.narrow(0, p.offset, p.count));
  return out;
}

void GradientsOnDisk::write(size_t k, const at::Tensor& chunk) {
  auto& g = groups_[k];
  at::NoGradGuard no_grad;
  const auto each = views(chunk, g.parts);
  auto norm2 = at::_foreach_norm(each, 2.0);
  auto norm_inf = at::_foreach_norm(each, std::numeric_limits<double>::infinity());
  swapper_.swap_out(slot(k), chunk);  // first: a failed write leaves the last chunk's norms with it
  g.norm2 = std::move(norm2);
  g.norm_inf = std::move(norm_inf);
  g.on_disk = true;
  g.queued.clear();
  g.dropped.assign(g.parts.size(), false);
  ++writes_;
}

void GradientsOnDisk::prefetch(size_t k) {
  if (groups_[k].on_disk) swapper_.prefetch(slot(k));
}

at::Tensor GradientsOnDisk::read(size_t k, std::vector<bool>& has_gradient) {
  ++reads_;
  return read_with_work(k, has_gradient);
}

at::Tensor GradientsOnDisk::read_with_work(size_t k, std::vector<bool>& has_gradient) {
  auto& g = groups_[k];
  auto chunk = swapper_.swap_in(slot(k));
  at::NoGradGuard no_grad;
  auto each = views(chunk, g.parts);
  for (auto& [part, op] : g.queued) op(each[part]);
  has_gradient.assign(g.parts.size(), true);
  for (size_t j = 0; j < g.parts.size(); ++j) has_gradient[j] = !g.dropped[j];
  return chunk;
}

void GradientsOnDisk::consumed(size_t k) {
  auto& g = groups_[k];
  g.on_disk = false;
  g.queued.clear();
}

std::vector<at::Tensor> GradientsOnDisk::norms(size_t k, double p) {
  auto& g = groups_[k];
  std::vector<at::Tensor> out(g.parts.size());
  if (!g.on_disk) return out;
  const double infinity = std::numeric_limits<double>::infinity();
  const bool as_written = g.queued.empty() && (p == 2 || p == infinity);  // (-inf, the smallest |g|, is not kept)
  std::vector<at::Tensor> computed;
  std::vector<bool> has;
  at::Tensor chunk;  // read only when the norms written no longer hold (held until they are computed)
  if (as_written) {
    computed = p == 2 ? g.norm2 : g.norm_inf;
  } else {
    chunk = read_with_work(k, has);
    ++reads_for_norms_;
    at::NoGradGuard no_grad;
    computed = at::_foreach_norm(views(chunk, g.parts), p);
  }
  for (size_t j = 0; j < g.parts.size(); ++j)
    if (!g.dropped[j]) out[j] = computed[j];
  return out;
}

std::optional<size_t> GradientsOnDisk::part_of(size_t k, size_t index) const {
  const auto& parts = groups_[k].parts;
  for (size_t j = 0; j < parts.size(); ++j)
    if (parts[j].index == index) return j;
  return std::nullopt;
}

void GradientsOnDisk::queue(size_t k, size_t index, Op op) {
  auto& g = groups_[k];
  const auto j = part_of(k, index);
  if (!g.on_disk || !j || g.dropped[*j]) return;
  if (!op) g.dropped[*j] = true;  // set to none: the step leaves this leaf's .grad undefined
  else g.queued.emplace_back(*j, std::move(op));
  ++queued_;
}

nlohmann::json GradientsOnDisk::stats() const {
  return {{"gradients_on_disk", true},
          {"gradient_writes", writes_},
          {"gradient_reads", reads_},
          {"gradient_reads_for_norms", reads_for_norms_},
          {"gradient_work_queued", queued_}};
}

}  // namespace xlr8::shard
