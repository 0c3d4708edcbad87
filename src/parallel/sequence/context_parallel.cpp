// Context parallelism's sequence sharding (head-tail, or contiguous for Ulysses), the context a model's
// attention follows, and the attention entry point: LibTorch's fused scaled-dot-product attention at cp 1,
// keys and values all-gathered into it under
// "allgather", the ring (cp_ring.cpp) under "alltoall", heads all-to-all (sp_ulysses.cpp) under Ulysses.
#include "xlr8/context_parallel.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <mutex>

#include "parallel/autograd_group.hpp"
#include "parallel/sequence/cp_ring.hpp"
#include "parallel/sequence/sp_ulysses.hpp"
#include "xlr8/error.hpp"
#include "xlr8/format.hpp"

namespace xlr8::cp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local std::optional<Context> thread_context;
std::mutex process_context_lock;
std::optional<Context> process_context;
std::atomic<int64_t> context_attention_calls{0};
std::atomic<int64_t> any_attention_calls{0};

int64_t positive_dim(const at::Tensor& x, int64_t dim) { return dim < 0 ? dim + x.dim() : dim; }

void check_divisible(int64_t length, int size, Split split, const char* what) {
  if (split == Split::Contiguous && length % size != 0)
    throw ConfigError(fmt::format("Ulysses: the {} is {}, which parallelism_config_sp_size {} does not divide; choose a "
                                  "multiple of {}",
                                  what, length, size, size));
  if (split == Split::HeadTail && length % (2 * size) != 0)
    throw ConfigError(fmt::format("context parallelism: the {} is {}, which 2 x parallelism_config_cp_size = {} does "
                                  "not divide (each rank holds two chunks: head-tail load balancing for causal "
                                  "attention); choose a multiple of {}",
                                  what, length, 2 * size, 2 * size));
}

// All-gathers keys and values (one tensor, [..., T_local, 2·head_dim]) on the sequence dimension in
// forward; backward sums every rank's gradient for this rank's share (reduce-scatter).
struct GatherKeysValues : torch::autograd::Function<GatherKeysValues> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& kv, const Communicator& group) {
    xlr8::parallel::keep_group(ctx, group);
    return detail::gather_sequence(kv, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {detail::reduce_scatter_sequence(grads[0], xlr8::parallel::group_of(ctx)), at::Tensor()};
  }
};

double scale_of(const AttentionOptions& o, const at::Tensor& q) {
  return o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// softmax(q·kᵀ·scale) · v with the scores whole: where LibTorch's fused kernel is slower
// (detail::plain_attention_is_faster).
at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& o,
                           const at::Tensor& visible) {
  auto scores = at::matmul(q, k.transpose(-2, -1)) * scale_of(o, q);
  if (visible.defined()) scores = scores.masked_fill(visible.logical_not(), -INFINITY);
  auto weights = at::softmax(scores, -1);
  if (o.dropout > 0) weights = at::dropout(weights, o.dropout, /*train=*/true);
  return at::matmul(weights, v);
}

// LibTorch's scaled_dot_product_attention (flash, memory-efficient or cuDNN kernels on CUDA, a flash
// kernel on the CPU), or plain attention where that is faster; causal attention needs no mask (top-left aligned, as the all-gather's mask). `visible`
// (true where a query may see a key) is the all-gather's causal mask over global positions.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& o,
                           const at::Tensor& visible = {}) {
  const bool masked = visible.defined();
  if (detail::plain_attention_is_faster(q, k.size(-2))) {
    if (masked || !o.causal) return plain_attention(q, k, v, o, visible);
    return plain_attention(q, k, v, o, at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).tril());
  }
  return at::scaled_dot_product_attention(q, k, v, masked ? std::optional<at::Tensor>(visible) : std::nullopt,
                                          o.dropout, o.causal && !masked, o.scale);
}

at::Tensor allgather_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& o, const Communicator& group) {
  const int64_t local = q.size(-2), head_dim = k.size(-1);
  auto gathered = GatherKeysValues::apply(at::cat({k, v}, -1), group);
  auto keys = gathered.narrow(-1, 0, head_dim), values = gathered.narrow(-1, head_dim, v.size(-1));
  at::Tensor visible;
  if (o.causal) {
    auto mine = positions(local, group.size(), group.rank(), q.device());
    std::vector<at::Tensor> all;
    for (int r = 0; r < group.size(); ++r) all.push_back(positions(local, group.size(), r, q.device()));
    visible = mine.unsqueeze(1) >= at::cat(all).unsqueeze(0);
  }
  // The chunk pairs the mask leaves open (no device sync: the ring's own rule).
  detail::count_blocks(detail::chunk_pairs(group.rank(), group.size(), o.causal));
  return attend(q, keys, values, o, visible);
}

// Grouped-query attention: k or v with fewer heads than q, each serving q's heads / its heads consecutive
// query heads (as Llama's repeat_kv), repeated to `query_heads`.
at::Tensor with_query_heads(const at::Tensor& x, int64_t query_heads) {
  return x.dim() < 3 || x.size(-3) == query_heads ? x : x.repeat_interleave(query_heads / x.size(-3), x.dim() - 3);
}

// Heads traded for the sequence, whole attention over this rank's heads, traded back.
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& o,
                             const Communicator& group) {
  if (q.dim() < 3 || q.size(-3) % group.size() != 0)
    throw ConfigError(fmt::format("Ulysses: attention's query has {} heads ({}), which parallelism_config_sp_size {} does "
                                  "not divide; choose an sp size that divides the number of heads",
                                  q.dim() < 3 ? 1 : q.size(-3), q.sizes(), group.size()));
  // Grouped-query keys and values cross as they are when sp divides their heads (rank j's query heads use
  // exactly its share of them), else repeated to the query's heads first.
  const bool split_as_they_are = k.size(-3) % group.size() == 0;
  auto heads = detail::sequence_to_heads(
      {q, split_as_they_are ? k : with_query_heads(k, q.size(-3)), split_as_they_are ? v : with_query_heads(v, q.size(-3))},
      group);
  heads[1] = with_query_heads(heads[1], heads[0].size(-3));
  heads[2] = with_query_heads(heads[2], heads[0].size(-3));
  // The whole sequence in order on each rank: the fused kernel holds nothing T x T (as DeepSpeed runs a
  // flash kernel there).
  return detail::heads_to_sequence(attend(heads[0], heads[1], heads[2], o), group);
}

}  // namespace

std::string to_string(CommStrategy strategy) {
  switch (strategy) {
    case CommStrategy::AllGather: return "allgather";
    case CommStrategy::AllToAll: return "alltoall";
    case CommStrategy::Ulysses: return "ulysses";
  }
  return "?";
}

Split split_of(CommStrategy strategy) { return strategy == CommStrategy::Ulysses ? Split::Contiguous : Split::HeadTail; }

CommStrategy parse_comm_strategy(const std::string& value) {
  if (value == "allgather") return CommStrategy::AllGather;
  if (value == "alltoall") return CommStrategy::AllToAll;
  throw ConfigError(fmt::format("parallelism_config_cp_comm_strategy: {:?} is not a strategy; allowed values are "
                                "allgather (all-gather keys and values) and alltoall (the ring)",
                                value));
}

Scope::Scope(Context context) : previous_(std::move(thread_context)) { thread_context = std::move(context); }
Scope::~Scope() { thread_context = std::move(previous_); }

std::optional<Context> current() {
  if (thread_context) return thread_context;
  std::lock_guard<std::mutex> lock(process_context_lock);
  return process_context;
}

void set_process_context(std::optional<Context> context) {
  std::lock_guard<std::mutex> lock(process_context_lock);
  process_context = std::move(context);
}

at::Tensor positions(int64_t local_length, int cp_size, int cp_rank, const at::Device& device, Split split) {
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  if (cp_size == 1) return at::arange(local_length, options);
  if (split == Split::Contiguous) return at::arange(cp_rank * local_length, (cp_rank + 1) * local_length, options);
  if (local_length % 2 != 0)
    throw ConfigError(fmt::format("context parallelism: a rank holds {} tokens, not two equal chunks (head-tail)",
                                  local_length));
  const int64_t chunk = local_length / 2;
  return at::cat({at::arange(cp_rank * chunk, (cp_rank + 1) * chunk, options),
                  at::arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, options)});
}

at::Tensor local_positions(int64_t local_length, const at::Device& device) {
  const auto context = current();
  return context ? positions(local_length, context->group.size(), context->group.rank(), device,
                           split_of(context->strategy))
                 : positions(local_length, 1, 0, device);
}

at::Tensor shard_sequence(const at::Tensor& x, const Communicator& group, int64_t dim, Split split) {
  if (group.size() == 1) return x;
  dim = positive_dim(x, dim);
  check_divisible(x.size(dim), group.size(), split, "sequence length");
  const int r = group.rank();
  if (split == Split::Contiguous) return x.narrow(dim, r * (x.size(dim) / group.size()), x.size(dim) / group.size());
  const int64_t chunk = x.size(dim) / (2 * group.size());
  return at::cat({x.narrow(dim, r * chunk, chunk), x.narrow(dim, (2 * group.size() - 1 - r) * chunk, chunk)}, dim);
}

at::Tensor unshard_sequence(const at::Tensor& local, const Communicator& group_handle, int64_t dim, Split split) {
  if (group_handle.size() == 1) return local;
  Communicator group = group_handle;
  dim = positive_dim(local, dim);
  const int n = group.size();
  std::vector<at::Tensor> shares;
  group.all_gather(shares, local.contiguous());
  if (split == Split::Contiguous) return at::cat(shares, dim);
  const int64_t chunk = local.size(dim) / 2;
  std::vector<at::Tensor> chunks(2 * static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    chunks[static_cast<size_t>(r)] = shares[static_cast<size_t>(r)].narrow(dim, 0, chunk);
    chunks[static_cast<size_t>(2 * n - 1 - r)] = shares[static_cast<size_t>(r)].narrow(dim, chunk, chunk);
  }
  return at::cat(chunks, dim);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionOptions& options) {
  if (q.dim() < 2 || k.dim() != q.dim() || v.dim() != q.dim() || k.size(-1) != q.size(-1) || k.size(-2) != v.size(-2))
    throw Error(fmt::format("attention(): q {}, k {} and v {} must be [..., T, head_dim] with matching key and value "
                            "lengths and q, k head_dim",
                            q.sizes(), k.sizes(), v.sizes()));
  ++any_attention_calls;
  const int64_t heads = q.dim() >= 3 ? q.size(-3) : 1;
  if (q.dim() >= 3 && (k.size(-3) != v.size(-3) || heads % k.size(-3) != 0))
    throw Error(fmt::format("attention(): q {}, k {} and v {}: grouped-query attention needs k and v with one number of "
                            "heads that divides q's",
                            q.sizes(), k.sizes(), v.sizes()));
  const auto context = current();
  if (!context || context->group.size() == 1)
    return attend(q, with_query_heads(k, heads), with_query_heads(v, heads), options);
  if (q.size(-2) != k.size(-2))
    throw Error(fmt::format("attention() under context parallelism: queries ({} tokens) and keys ({}) must be the same "
                            "sequence's shares",
                            q.size(-2), k.size(-2)));
  ++context_attention_calls;
  if (context->strategy == CommStrategy::Ulysses) return ulysses_attention(q, k, v, options, context->group);
  check_divisible(q.size(-2) * context->group.size(), context->group.size(), Split::HeadTail, "sequence length");
  // Grouped-query: the exchanges carry whole heads.
  const auto keys = with_query_heads(k, heads), values = with_query_heads(v, heads);
  if (context->strategy == CommStrategy::AllGather) return allgather_attention(q, keys, values, options, context->group);
  if (options.dropout > 0)
    throw ConfigError(fmt::format("attention(): dropout {} on the attention weights is not available with "
                                  "parallelism_config_cp_comm_strategy alltoall (the ring never forms the whole "
                                  "weights); use allgather, or dropout 0",
                                  options.dropout));
  return detail::ring_attention(q, keys, values, options.causal, scale_of(options, q), context->group);
}

int64_t wire_bytes() { return detail::cp_wire_bytes(); }
int64_t attention_blocks() { return detail::blocks_counted(); }
RingTime ring_time() {
  auto [compute, wait] = detail::ring_seconds();
  return {compute, wait};
}

namespace detail {
int64_t attention_calls() { return context_attention_calls.load(); }
int64_t entry_calls() { return any_attention_calls.load(); }
}  // namespace detail

}  // namespace xlr8::cp
