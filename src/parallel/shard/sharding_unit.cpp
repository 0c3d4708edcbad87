#include "parallel/shard/sharding_unit.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "xlr8/error.hpp"

namespace xlr8::shard {

void UnitContext::gathered(int64_t bytes) {
  ++gathers;
  gathered_bytes += bytes;
  peak_gathered_bytes = std::max(peak_gathered_bytes, gathered_bytes);
  step_peak_gathered_bytes = std::max(step_peak_gathered_bytes, gathered_bytes);
}

const char* to_string(ShardingUnit::State state) {
  switch (state) {
    case ShardingUnit::State::IDLE: return "IDLE";
    case ShardingUnit::State::FORWARD: return "FORWARD";
    case ShardingUnit::State::PRE_BACKWARD: return "PRE_BACKWARD";
    case ShardingUnit::State::POST_BACKWARD: return "POST_BACKWARD";
  }
  return "?";
}

ShardingUnit::ShardingUnit(std::string label, const torch::nn::Module* module, bool is_root, bool named_by_user,
                           std::vector<FlatGroup> groups, UnitContext& context, bool reshards, bool starts_sharded)
    : label_(std::move(label)),
      module_(module),
      is_root_(is_root),
      named_by_user_(named_by_user),
      groups_(std::move(groups)),
      context_(context),
      reshards_(reshards),
      managed_(reshards && starts_sharded) {
  for (auto& group : groups_) {
    if (managed_) group.release();
    else if (reshards_) context_.gathered_bytes += group.full_bytes();  // whole until its guard first runs
  }
}

void ShardingUnit::expect(std::initializer_list<State> allowed, const char* transition) const {
  if (std::find(allowed.begin(), allowed.end(), state_) != allowed.end()) return;
  std::vector<const char*> names;
  for (auto s : allowed) names.push_back(to_string(s));
  throw Error(fmt::format("internal: sharding unit {}: {} in state {} (expected {})", label_, transition,
                          to_string(state_), fmt::join(names, " or ")));
}

bool ShardingUnit::has_frozen() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const FlatGroup& g) { return g.frozen; });
}

bool ShardingUnit::any_gathered() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const FlatGroup& g) { return g.gathered(); });
}

bool ShardingUnit::carries_frozen() const {
  return has_frozen() || std::any_of(riders_.begin(), riders_.end(), [](const ShardingUnit* r) { return r->has_frozen(); });
}

void ShardingUnit::carry(ShardingUnit& rider) {
  if (rider.host_ || rider.is_root_ || &rider == this)
    throw Error(fmt::format("internal: sharding unit {} cannot ride with {}", rider.label_, label_));
  rider.host_ = this;
  rider.managed_ = rider.reshards_;
  riders_.push_back(&rider);
  rider.release(Which::ALL);
}

void ShardingUnit::gather_riders() {
  for (auto* rider : riders_) rider->gather_all();
}

void ShardingUnit::release_riders(Which which) {
  for (auto* rider : riders_) rider->release(which);
}

int64_t ShardingUnit::full_bytes() const {
  int64_t bytes = 0;
  for (const auto& g : groups_) bytes += g.full_bytes();
  return bytes;
}

int64_t ShardingUnit::full_numel() const {
  int64_t elements = 0;
  for (const auto& g : groups_) elements += g.numel;
  for (const auto* rider : riders_) elements += rider->full_numel();
  return elements;
}

// ------------------------------------------------------------------------------------------ transitions

void ShardingUnit::forward_begins() {
  // Not FORWARD: a unit's forward inside its own forward would free what the outer one still reads.
  expect({State::IDLE, State::PRE_BACKWARD, State::POST_BACKWARD}, "forward begins");
  managed_ = reshards_;
  guard_opened_ = true;
  gather_all();
  gather_riders();
  state_ = State::FORWARD;
}

void ShardingUnit::forward_ends(bool backward_follows, bool keep_gathered) {
  expect({State::FORWARD}, "forward ends");
  state_ = State::IDLE;
  // The root's backward comes first, right after its forward ends: it stays gathered until then.
  if (!keep_gathered && (!backward_follows || !is_root_)) {
    release(Which::ALL);
    release_riders(Which::ALL);
  }
}

void ShardingUnit::forward_abandoned() {
  expect({State::FORWARD}, "forward abandoned");
  state_ = State::IDLE;
  release(Which::ALL);
  release_riders(Which::ALL);
}

bool ShardingUnit::backward_begins() {
  expect({State::IDLE, State::PRE_BACKWARD, State::POST_BACKWARD}, "backward begins");
  // Every output of the unit that requires gradients carries the hook: the first one gathers.
  if (state_ == State::PRE_BACKWARD) return false;
  state_ = State::PRE_BACKWARD;
  gather_all();
  gather_riders();  // a rider's trainable group goes once its gradients are reduced, as any unit's
  return true;
}

void ShardingUnit::gradients_reduced() {
  expect({State::IDLE, State::PRE_BACKWARD, State::POST_BACKWARD}, "gradients reduced");
  state_ = State::POST_BACKWARD;
  release(Which::TRAINABLE);  // nothing in backward reads them any more
}

void ShardingUnit::backward_ends() {
  state_ = State::IDLE;
  release(Which::ALL);
}

bool ShardingUnit::forward_no_longer_awaited() {
  if (awaiting == 0) return false;
  // Not while the unit's own forward runs (a graph of an earlier forward freed inside it).
  if (--awaiting > 0 || state_ == State::FORWARD) return false;
  bool freed = false;
  std::vector<ShardingUnit*> carried{this};
  carried.insert(carried.end(), riders_.begin(), riders_.end());
  for (auto* unit : carried)
    for (size_t k = 0; k < unit->groups_.size(); ++k)
      if (unit->groups_[k].frozen && unit->release(k)) {
        ++context_.frozen_released_in_backward;
        freed = true;
      }
  return freed;
}

// ------------------------------------------------------------------------------------------ gathers

void ShardingUnit::gather(size_t k) {
  wait_prefetch();  // issued early: then it is there now
  auto& group = groups_[k];
  if (group.gathered()) return;
  group.gather(*context_.comm);
  context_.gathered(group.full_bytes());
}

void ShardingUnit::gather_all() {
  for (size_t k = 0; k < groups_.size(); ++k) gather(k);
}

bool ShardingUnit::release(size_t k) {
  wait_prefetch();  // never free memory a gather writes into
  auto& group = groups_[k];
  if (!managed_ || context_.summoned > 0 || !group.gathered()) return false;
  group.release();
  ++context_.releases;
  context_.gathered_bytes -= group.full_bytes();
  return true;
}

bool ShardingUnit::release(Which which) {
  bool freed = false;
  for (size_t k = 0; k < groups_.size(); ++k)
    if (which == Which::ALL || groups_[k].frozen == (which == Which::FROZEN)) freed |= release(k);
  return freed;
}

void ShardingUnit::read_ahead() const {
  for (const auto& group : groups_) group.read_ahead();
  for (const auto* rider : riders_) rider->read_ahead();
}

bool ShardingUnit::prefetch(bool in_backward) {
  if (!managed_ || !prefetch_.empty()) return false;
  bool issued = issue_prefetch();
  for (auto* rider : riders_) issued |= rider->issue_prefetch();
  if (issued) ++(in_backward ? context_.backward_prefetches : context_.forward_prefetches);
  return issued;
}

bool ShardingUnit::issue_prefetch() {
  if (!managed_ || !prefetch_.empty()) return false;
  bool issued = false;
  for (auto& group : groups_) {
    if (group.gathered()) continue;  // also true while a prefetch runs
    prefetch_.push_back(group.gather_async(*context_.comm));
    context_.gathered(group.full_bytes());
    issued = true;
  }
  return issued;
}

bool ShardingUnit::wait_prefetch() {
  if (prefetch_.empty()) return false;
  // Before forgetting them: a failed wait leaves them recorded.
  for (auto& work : prefetch_) work.wait();
  prefetch_.clear();
  return true;
}

}  // namespace xlr8::shard
