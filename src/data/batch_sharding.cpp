#include "xlr8/batch_sharding.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

using Batch = std::vector<int64_t>;

std::vector<Batch> make_batches(const std::vector<int64_t>& order, int64_t size, bool drop_last) {
  std::vector<Batch> batches;
  for (size_t start = 0; start < order.size(); start += static_cast<size_t>(size)) {
    size_t end = std::min(order.size(), start + static_cast<size_t>(size));
    if (drop_last && static_cast<int64_t>(end - start) < size) break;
    batches.emplace_back(order.begin() + start, order.begin() + end);
  }
  return batches;
}

Batch slice(const Batch& b, size_t begin, size_t end) {
  begin = std::min(begin, b.size());
  end = std::min(end, b.size());
  return Batch(b.begin() + begin, b.begin() + end);
}

// Global batch i goes to rank i % P; a round is yielded only when complete (all P batches full).
std::vector<Batch> no_split(const std::vector<Batch>& batches, const ShardingOptions& o) {
  const int P = o.num_processes, p = o.process_index;
  const size_t B = static_cast<size_t>(o.batch_size);
  std::vector<Batch> out;
  Batch initial, pending, last;
  int64_t idx = 0;
  for (; idx < static_cast<int64_t>(batches.size()); ++idx) {
    const Batch& batch = batches[idx];
    if (!o.drop_last && idx < P) initial.insert(initial.end(), batch.begin(), batch.end());
    if (idx % P == p) pending = batch;
    if (idx % P == P - 1 && batch.size() == B) {
      out.push_back(pending);
      pending.clear();
    }
    last = batch;
  }
  if (o.drop_last || initial.empty()) return out;
  if (!o.even_batches) {
    if (!pending.empty()) out.push_back(pending);
    return out;
  }
  if (pending.size() == B) out.push_back(pending);
  while (initial.size() < static_cast<size_t>(P) * B) {  // fewer samples than one round: repeat them
    Batch copy = initial;
    initial.insert(initial.end(), copy.begin(), copy.end());
  }
  Batch batch = idx > 0 ? last : Batch{};
  idx -= 1;  // index of `last`
  if (batch.size() == B) {  // already yielded by its rank: continue with a fresh slot
    batch.clear();
    idx += 1;
  }
  size_t cycle = 0;
  while (idx % P != 0 || !batch.empty()) {
    size_t end = cycle + B - batch.size();
    Batch top = slice(initial, cycle, end);
    batch.insert(batch.end(), top.begin(), top.end());
    if (idx % P == p) out.push_back(batch);
    cycle = end;
    batch.clear();
    idx += 1;
  }
  return out;
}

// Each full global batch is split; the short last one is padded from the first batch (even_batches).
std::vector<Batch> split(const std::vector<Batch>& batches, const ShardingOptions& o) {
  const size_t B = static_cast<size_t>(o.batch_size);
  const size_t chunk = B / static_cast<size_t>(o.num_processes);
  const size_t begin = chunk * static_cast<size_t>(o.process_index), end = begin + chunk;
  std::vector<Batch> out;
  for (const auto& b : batches)
    if (b.size() == B) out.push_back(slice(b, begin, end));
  if (o.drop_last || batches.empty() || batches.back().size() == B) return out;
  const Batch& last = batches.back();
  if (!o.even_batches) {
    if (last.size() > begin) out.push_back(slice(last, begin, end));
    return out;
  }
  Batch initial = batches.front();
  while (initial.size() < B) {
    Batch copy = initial;
    initial.insert(initial.end(), copy.begin(), copy.end());
  }
  Batch padded = last;
  padded.insert(padded.end(), initial.begin(), initial.end());
  out.push_back(slice(padded, begin, end));
  return out;
}

// The shares of num_processes x micro_batches ranks, this process's in rank order within each round: what its
// ranks' would be, one micro-batch per rank. A rank that has no share of a short last round adds none.
std::vector<Batch> as_micro_batches(const std::vector<int64_t>& order, const ShardingOptions& o) {
  ShardingOptions rank = o;
  rank.micro_batches = 1;
  rank.num_processes = o.num_processes * o.micro_batches;
  std::vector<std::vector<Batch>> shares;
  for (int i = 0; i < o.micro_batches; ++i) {
    rank.process_index = o.process_index * o.micro_batches + i;
    shares.push_back(shard_batches(order, rank));
  }
  std::vector<Batch> out;
  for (size_t round = 0; round < shares.front().size(); ++round)
    for (const auto& share : shares)
      if (round < share.size()) out.push_back(share[round]);
  return out;
}

}  // namespace

std::vector<std::vector<int64_t>> shard_batches(const std::vector<int64_t>& order, const ShardingOptions& o) {
  if (o.batch_size < 1) throw ConfigError(fmt::format("batch_size must be at least 1, not {}", o.batch_size));
  if (o.num_processes < 1 || o.process_index < 0 || o.process_index >= o.num_processes)
    throw Error(fmt::format("process index {} is outside [0, {})", o.process_index, o.num_processes));
  if (o.split_batches && o.batch_size % o.num_processes != 0)
    throw ConfigError(fmt::format("split_batches needs the batch size ({}) to be a multiple of the number of processes "
                                  "({})",
                                  o.batch_size, o.num_processes));
  if (o.micro_batches < 1)
    throw ConfigError(fmt::format("ShardingOptions::micro_batches {} must be at least 1 (1: this process is one rank)",
                                  o.micro_batches));
  if (o.micro_batches > 1) return as_micro_batches(order, o);
  auto batches = make_batches(order, o.batch_size, o.drop_last);
  return o.split_batches ? split(batches, o) : no_split(batches, o);
}

int64_t padding_remainder(int64_t dataset_size, const ShardingOptions& o) {
  if (o.drop_last) return 0;
  int64_t total = o.split_batches ? o.batch_size : o.batch_size * o.num_processes;
  return dataset_size % total;
}

std::pair<int64_t, int64_t> split_range(int64_t n, int num_processes, int process_index) {
  int64_t q = n / num_processes, r = n % num_processes;
  int64_t start = process_index * q + std::min<int64_t>(process_index, r);
  return {start, start + q + (process_index < r ? 1 : 0)};
}

}  // namespace xlr8
