#include "xlr8/placement.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "xlr8/error.hpp"

namespace xlr8 {

namespace {

int64_t product(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (auto d : sizes) n *= d;
  return n;
}

}  // namespace

int64_t Box::numel() const { return product(sizes); }

Placement Placement::whole_tensor(std::vector<int64_t> shape) {
  Placement p;
  p.boxes_.push_back({std::vector<int64_t>(shape.size(), 0), shape});
  p.count_ = product(shape);
  p.whole_ = std::move(shape);
  return p;
}

Placement Placement::split(std::vector<int64_t> shape, int64_t dim, const std::vector<int64_t>& parts, int rank,
                           int ranks) {
  const auto d = static_cast<size_t>(dim);
  int64_t total = 0;
  for (auto width : parts) total += width;
  if (dim < 0 || d >= shape.size() || parts.empty() || total != shape[d] || ranks < 1 || rank < 0 || rank >= ranks)
    throw ConfigError(fmt::format("a split of [{}] along dimension {} in parts [{}] over {} ranks (rank {}) does not fit "
                                  "the tensor",
                                  fmt::join(shape, ", "), dim, fmt::join(parts, ", "), ranks, rank));
  if (parts.size() > 1 && dim != 0)
    throw ConfigError(fmt::format("a split of [{}] in {} fused parts along dimension {}: fused parts are stacked on "
                                  "dimension 0",
                                  fmt::join(shape, ", "), parts.size(), dim));
  Placement p;
  int64_t begin = 0;
  for (const int64_t width : parts) {
    if (width % ranks != 0)
      throw ConfigError(fmt::format("a part of {} along dimension {} of [{}] does not split in equal shares over {} "
                                    "ranks; choose a tp size that divides it",
                                    width, dim, fmt::join(shape, ", "), ranks));
    Box box{std::vector<int64_t>(shape.size(), 0), shape};
    box.sizes[d] = width / ranks;
    box.offsets[d] = begin + rank * box.sizes[d];
    p.count_ += box.numel();
    p.boxes_.push_back(std::move(box));
    begin += width;
  }
  p.whole_ = std::move(shape);
  return p;
}

Placement Placement::of_box(std::vector<int64_t> shape, Box box) {
  bool inside = box.offsets.size() == shape.size() && box.sizes.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d)
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] + box.sizes[d] <= shape[d];
  if (!inside)
    throw Error(fmt::format("the box at [{}] of size [{}] lies outside a tensor of [{}]", fmt::join(box.offsets, ", "),
                            fmt::join(box.sizes, ", "), fmt::join(shape, ", ")));
  Placement p;
  p.count_ = box.numel();
  p.boxes_.push_back(std::move(box));
  p.whole_ = std::move(shape);
  return p;
}

Placement Placement::chunk(int64_t start, int64_t count) const {
  if (start < 0 || count < 0 || start + count > count_)
    throw Error(fmt::format("elements {}..{} of {}: it holds {} (an engine bug)", start, start + count, describe(), count_));
  Placement p = *this;
  p.start_ = start_ + start;
  p.count_ = count;
  return p;
}

Placement Placement::unchunked() const {
  Placement p = *this;
  p.start_ = 0;
  p.count_ = 0;
  for (const auto& box : boxes_) p.count_ += box.numel();
  return p;
}

int64_t Placement::whole_numel() const { return product(whole_); }

bool Placement::unsplit() const { return boxes_.size() == 1 && boxes_.front().sizes == whole_; }

std::vector<Placement::Span> Placement::spans() const {
  std::vector<Span> out;
  const int64_t end = start_ + count_;
  int64_t box_begin = 0;  // where the box starts among the boxes end to end
  for (const auto& box : boxes_) {
    const int64_t n = box.numel();
    const int64_t a = std::max(start_, box_begin), b = std::min(end, box_begin + n);
    if (a < b) out.push_back({box, a - box_begin, b - a, a - start_});
    box_begin += n;
  }
  return out;
}

at::Tensor Placement::take(const at::Tensor& whole) const {
  if (whole.sizes().vec() != whole_)
    throw Error(fmt::format("a tensor of [{}] where {} was expected", fmt::join(whole.sizes(), ", "), describe()));
  std::vector<at::Tensor> parts;
  for (const auto& span : spans()) {
    at::Tensor box = whole;
    for (size_t d = 0; d < span.box.offsets.size(); ++d)
      box = box.narrow(static_cast<int64_t>(d), span.box.offsets[d], span.box.sizes[d]);
    parts.push_back(box.reshape(-1).narrow(0, span.begin, span.count));
  }
  if (parts.empty()) return at::empty({0}, whole.options());
  return parts.size() == 1 ? parts.front().contiguous() : at::cat(parts);
}

std::string Placement::describe() const {
  std::string boxes;
  for (const auto& box : boxes_)
    boxes += fmt::format("{}[{}]+[{}]", boxes.empty() ? "" : ", ", fmt::join(box.offsets, ", "), fmt::join(box.sizes, ", "));
  return fmt::format("[{}] box {} elements {}..{}", fmt::join(whole_, ", "), boxes, start_, start_ + count_);
}

}  // namespace xlr8
