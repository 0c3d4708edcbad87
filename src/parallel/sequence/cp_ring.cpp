// Context parallelism's collectives and ring attention (PyTorch's "alltoall" rotate method, Ring
// Attention's blockwise log-sum-exp merge). Each rank holds two chunks of the sequence (head-tail:
// chunks r and 2n-1-r of 2n), so every block is computed as four chunk pairs, and under the causal mask
// a pair whose key chunk comes after its query chunk is skipped, one on the diagonal masked.
#include "parallel/sequence/cp_ring.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>

#include "parallel/autograd_group.hpp"

namespace xlr8::cp::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> wire{0};
std::atomic<int64_t> blocks{0};
std::atomic<int64_t> compute_ns{0}, wait_ns{0};

int64_t since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// One chunk of this rank's queries and one of a block's keys, with their places among the 2n chunks.
struct ChunkPair {
  int64_t q_index, k_index;
  int64_t q_chunk, k_chunk;  // 0 or 1: which half of the local / block tensor
};

// The chunk pairs of queries held by `rank` against keys held by `source` that the mask leaves work in.
std::vector<ChunkPair> pairs(int rank, int source, int n, bool causal) {
  const int64_t mine[2] = {rank, 2 * n - 1 - rank}, theirs[2] = {source, 2 * n - 1 - source};
  std::vector<ChunkPair> out;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      if (!causal || theirs[b] <= mine[a]) out.push_back({mine[a], theirs[b], a, b});
  return out;
}

// Queries are taken `kTileRows` at a time against a whole key chunk, so that what one step holds is
// O(rows x chunk), never a chunk x chunk block per head (blockwise, as Ring Attention computes it).
constexpr int64_t kTileRows = 256;

// Scores of a tile of query rows [first, first + rows) of a chunk against a key chunk, in fp32; on the
// diagonal pair, keys after each query are masked.
at::Tensor tile_scores(const at::Tensor& q, const at::Tensor& k, double scale, bool diagonal, int64_t first) {
  auto s = at::matmul(q, k.transpose(-2, -1)).to(at::kFloat) * scale;
  if (diagonal) s = s.masked_fill(at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1 + first), -INFINITY);
  return s;
}

// LibTorch's CPU flash kernel computes a whole chunk pair where it is the faster (plain_attention_is_faster)
// and takes the shapes: key and value of one width. Elsewhere (CUDA, for now) the pair goes in tiles.
bool pair_kernel_applies(const at::Tensor& q, int64_t chunk, int64_t dk, int64_t dv) {
  return q.device().is_cpu() && dk == dv && q.scalar_type() != at::kDouble && !plain_attention_is_faster(q, chunk);
}

// [..., T, D] as the kernel's [N, 1, T, D], contiguous.
at::Tensor as_heads(const at::Tensor& t) { return t.reshape({-1, 1, t.size(-2), t.size(-1)}).contiguous(); }

// Merges one pair's (out, lse) for `rows` query rows into the running result (Ring Attention's merge).
void merge_into(at::Tensor out_rows, at::Tensor lse_rows, const at::Tensor& block_out, const at::Tensor& block_lse) {
  auto merged = at::logaddexp(lse_rows, block_lse);
  out_rows.mul_(at::exp(lse_rows - merged).unsqueeze(-1)).add_(block_out * at::exp(block_lse - merged).unsqueeze(-1));
  lse_rows.copy_(merged);
}

// One chunk pair's attention merged into `out` and `lse` (float32): queries of chunk p.q_chunk against the
// keys and values `kb` ([..., c, dk + dv]), masked causally on the diagonal pair.
void forward_pair(const at::Tensor& q, const at::Tensor& kb, const ChunkPair& p, bool diagonal, double scale,
                  at::Tensor& out, at::Tensor& lse) {
  const int64_t c = kb.size(-2), dk = q.size(-1), dv = kb.size(-1) - dk;
  auto key = kb.narrow(-1, 0, dk);
  if (pair_kernel_applies(q, c, dk, dv)) {
    auto qa = q.narrow(-2, p.q_chunk * c, c);
    auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(as_heads(qa), as_heads(key),
                                                                   as_heads(kb.narrow(-1, dk, dv)), 0.0, diagonal, {}, scale);
    auto out_rows = out.narrow(-2, p.q_chunk * c, c);
    merge_into(out_rows, lse.narrow(-1, p.q_chunk * c, c), o.reshape(out_rows.sizes()).to(at::kFloat),
               l.reshape(out_rows.sizes().slice(0, out_rows.dim() - 1)));
    return;
  }
  auto value = kb.narrow(-1, dk, dv).to(at::kFloat);
  for (int64_t first = 0; first < c; first += kTileRows) {
    const int64_t rows = std::min(kTileRows, c - first), at_row = p.q_chunk * c + first;
    auto scores = tile_scores(q.narrow(-2, at_row, rows), key, scale, diagonal, first);
    auto block_lse = at::logsumexp(scores, -1);
    merge_into(out.narrow(-2, at_row, rows), lse.narrow(-1, at_row, rows),
               at::matmul(at::exp(scores - block_lse.unsqueeze(-1)), value), block_lse);
  }
}

// One chunk pair's gradients, added into dq (float32, this rank's queries) and dkv_b (float32, the pair's
// key chunk), from the final output and log-sum-exp: with them each pair's part is exact on its own.
struct PairGradients {
  const at::Tensor &q, &out, &lse, &dout, &delta;  // dout and delta (rowsum(dO ∘ O)) in float32
  double scale;
  void add(const at::Tensor& kb, const ChunkPair& p, bool diagonal, at::Tensor& dq, at::Tensor dkv_b) const {
    const int64_t c = kb.size(-2), dk = q.size(-1), dv = kb.size(-1) - dk;
    auto key = kb.narrow(-1, 0, dk);
    if (pair_kernel_applies(q, c, dk, dv)) {
      const auto rows = [&](const at::Tensor& t) { return t.narrow(-2, p.q_chunk * c, c); };
      const auto dtype = q.scalar_type();
      auto qa = rows(q);
      auto lse_rows = lse.narrow(-1, p.q_chunk * c, c).reshape({-1, 1, c}).contiguous();
      auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          as_heads(rows(dout).to(dtype)), as_heads(qa), as_heads(key), as_heads(kb.narrow(-1, dk, dv)),
          as_heads(rows(out).to(dtype)), lse_rows, 0.0, diagonal, {}, scale);
      rows(dq).add_(gq.reshape(qa.sizes()).to(at::kFloat));
      dkv_b.narrow(-1, 0, dk).add_(gk.reshape(key.sizes()).to(at::kFloat));
      dkv_b.narrow(-1, dk, dv).add_(gv.reshape(key.sizes()).to(at::kFloat));
      return;
    }
    auto value = kb.narrow(-1, dk, dv).to(at::kFloat);
    auto key_fp32 = key.to(at::kFloat);
    for (int64_t first = 0; first < c; first += kTileRows) {
      const int64_t n_rows = std::min(kTileRows, c - first), at_row = p.q_chunk * c + first;
      auto qa = q.narrow(-2, at_row, n_rows);
      // The weights again from the saved log-sum-exp: exp(scores - lse), zero where masked.
      auto weights = at::exp(tile_scores(qa, key, scale, diagonal, first) - lse.narrow(-1, at_row, n_rows).unsqueeze(-1));
      auto dout_a = dout.narrow(-2, at_row, n_rows);
      dkv_b.narrow(-1, dk, dv).add_(at::matmul(weights.transpose(-2, -1), dout_a));
      auto dscores = weights * (at::matmul(dout_a, value.transpose(-2, -1)) - delta.narrow(-1, at_row, n_rows).unsqueeze(-1));
      dq.narrow(-2, at_row, n_rows).add_(at::matmul(dscores, key_fp32) * scale);
      dkv_b.narrow(-1, 0, dk).add_(at::matmul(dscores.transpose(-2, -1), qa.to(at::kFloat)) * scale);
    }
  }
};

// One step of the ring: sends `tensors` to the next rank and receives the previous rank's into `into`.
struct RingStep {
  std::vector<Work> works;
  void start(Communicator& group, const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& into, int tag) {
    const int n = group.size(), r = group.rank();
    into.reserve(tensors.size());  // recv_async writes into these: no reallocation under it
    for (size_t i = 0; i < tensors.size(); ++i) {
      into.push_back(at::empty_like(tensors[i]));
      const int t = tag + static_cast<int>(i);
      // Odd ranks receive first: at 2 ranks the next and the previous rank are one peer, and a backend that
      // runs one peer's sends and receives in issue order (NCCL's per-pair stream) would otherwise have
      // both ranks sending, neither receiving.
      if (r % 2 == 1) works.push_back(group.recv_async(into.back(), (r + n - 1) % n, t));
      works.push_back(group.send_async(tensors[i], (r + 1) % n, t));
      if (r % 2 == 0) works.push_back(group.recv_async(into.back(), (r + n - 1) % n, t));
      wire += static_cast<int64_t>(tensors[i].nbytes());
    }
  }
  void finish() {
    for (auto& w : works) w.wait();
    works.clear();
  }
};

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, double scale, const Communicator& ring) {
    Communicator group = ring;
    const int n = group.size(), r = group.rank();
    const int64_t c = q.size(-2) / 2, dv = v.size(-1);
    auto out_sizes = q.sizes().vec();
    out_sizes.back() = dv;
    auto out = at::zeros(out_sizes, q.options().dtype(at::kFloat));
    auto lse = at::full(q.sizes().slice(0, q.dim() - 1), -INFINITY, q.options().dtype(at::kFloat));
    auto kv = at::cat({k, v}, -1).contiguous();
    for (int s = 0; s < n; ++s) {
      RingStep step;
      std::vector<at::Tensor> next;
      if (s + 1 < n) step.start(group, {kv}, next, s);  // the next block travels while this one is computed
      const int source = (r - s + n) % n;
      const auto computing = std::chrono::steady_clock::now();
      const auto work = pairs(r, source, n, causal);
      blocks += static_cast<int64_t>(work.size());
      for (const auto& p : work)
        forward_pair(q, kv.narrow(-2, p.k_chunk * c, c), p, causal && p.k_index == p.q_index, scale, out, lse);
      compute_ns += since(computing);
      const auto waiting = std::chrono::steady_clock::now();
      step.finish();
      wait_ns += since(waiting);
      if (!next.empty()) kv = next[0];
    }
    xlr8::parallel::keep_group(ctx, group);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({q, k, v, out, lse});
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    Communicator& group = xlr8::parallel::group_of(ctx);
    const int n = group.size(), r = group.rank();
    const int64_t c = q.size(-2) / 2, dk = k.size(-1), dv = v.size(-1);
    auto dout = grads[0].to(at::kFloat);
    auto delta = (dout * out).sum(-1);  // rowsum(dO ∘ O): the softmax's backward term
    auto dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    const PairGradients gradients{q, out, lse, dout, delta, scale};
    auto kv = at::cat({k, v}, -1).contiguous();
    auto dkv = at::zeros(kv.sizes(), kv.options().dtype(at::kFloat));  // travels with its block
    for (int s = 0; s < n; ++s) {
      const int source = (r - s + n) % n;
      // The block itself does not change in this step: it leaves for the next rank while its gradient is
      // computed, which can only follow after.
      RingStep block_step;
      std::vector<at::Tensor> next_block;
      if (s + 1 < n) block_step.start(group, {kv}, next_block, 1000 + 2 * s);
      const auto computing = std::chrono::steady_clock::now();
      for (const auto& p : pairs(r, source, n, causal))
        gradients.add(kv.narrow(-2, p.k_chunk * c, c), p, causal && p.k_index == p.q_index, dq,
                      dkv.narrow(-2, p.k_chunk * c, c));
      compute_ns += since(computing);
      // The block's gradient so far follows it; after the last step it alone goes on, which brings it home
      // to the block's owner. (It needs this step's work, so nothing overlaps it.)
      const auto waiting = std::chrono::steady_clock::now();
      RingStep gradient_step;
      std::vector<at::Tensor> next_gradient;
      gradient_step.start(group, {dkv}, next_gradient, 1000 + 2 * s + 1);
      block_step.finish();
      gradient_step.finish();
      wait_ns += since(waiting);
      if (s + 1 < n) kv = next_block[0];
      dkv = next_gradient[0];
    }
    return {dq.to(q.scalar_type()), dkv.narrow(-1, 0, dk).to(k.scalar_type()),
            dkv.narrow(-1, dk, dv).to(v.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_sequence(const at::Tensor& x, const Communicator& group) {
  return xlr8::parallel::all_gather_on(x, group, x.dim() - 2, wire);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, const Communicator& group) {
  return xlr8::parallel::reduce_scatter_on(x, group, x.dim() - 2, wire);
}

int64_t chunk_pairs(int rank, int n, bool causal) {
  int64_t total = 0;
  for (int source = 0; source < n; ++source) total += static_cast<int64_t>(pairs(rank, source, n, causal).size());
  return total;
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          const Communicator& group) {
  return RingAttention::apply(q, k, v, causal, scale, group);
}

bool plain_attention_is_faster(const at::Tensor& q, int64_t keys) {
  const auto dtype = q.scalar_type();
  return q.device().is_cpu() && (dtype == at::kBFloat16 || dtype == at::kHalf) && keys <= 512;
}

int64_t cp_wire_bytes() { return wire.load(); }
void count_wire(int64_t bytes) { wire += bytes; }
void count_blocks(int64_t n) { blocks += n; }
int64_t blocks_counted() { return blocks.load(); }
std::pair<double, double> ring_seconds() { return {compute_ns.load() * 1e-9, wait_ns.load() * 1e-9}; }

}  // namespace xlr8::cp::detail
