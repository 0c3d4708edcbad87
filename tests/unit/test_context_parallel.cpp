// Context parallelism on 2, 3 and 4 ranks (threads): the head-tail split and its inverse, and attention
// under both communication strategies equal to whole-sequence attention, forward and backward; the same
// for Ulysses (contiguous split, heads all-to-all).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "op_counter.hpp"
#include "thread_ranks.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"

namespace {

using xlr8::Communicator;
using xlr8::testing::generator_lock;
using xlr8::testing::run_ranks;
namespace cp = xlr8::cp;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xlr8::ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

struct Qkv {
  at::Tensor q, k, v, upstream;
};

// The whole sequence's q, k, v and an upstream gradient, the same on every rank.
Qkv whole_inputs(int64_t T, at::ScalarType dtype = at::kFloat, int64_t heads = 3, int64_t v_dim = 5) {
  std::lock_guard<std::mutex> lock(generator_lock());
  torch::manual_seed(7);
  auto make = [&](int64_t d) { return torch::randn({2, heads, T, d}).to(dtype); };
  return {make(4), make(4), make(v_dim), make(v_dim)};
}

// Attention of the whole sequence on one rank, and its gradients.
std::vector<at::Tensor> whole_attention(const Qkv& in, bool causal) {
  auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
  auto out = xlr8::attention(q, k, v, {.causal = causal});
  out.backward(in.upstream);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

struct Tolerance {
  double rtol, atol;
};
constexpr Tolerance kFp32{1e-5, 1e-6};

// On one rank: its share of attention under `strategy` (inputs cast to `dtype`) and of the gradients of
// q, k and v, each checked against the same share of the whole run (`whole`: output, dq, dk, dv). Returns
// the output's dtype.
at::ScalarType expect_shares_of_whole(Communicator& comm, cp::CommStrategy strategy, const Qkv& in,
                                      const std::vector<at::Tensor>& whole, bool causal, Tolerance out_tol,
                                      Tolerance grad_tol, const std::string& where,
                                      at::ScalarType dtype = at::kFloat) {
  auto shard = [&](const at::Tensor& t) { return cp::shard_sequence(t, comm, 2, cp::split_of(strategy)); };
  auto q = shard(in.q).to(dtype).requires_grad_(), k = shard(in.k).to(dtype).requires_grad_(),
       v = shard(in.v).to(dtype).requires_grad_();
  cp::Scope scope({comm, strategy});
  auto out = xlr8::attention(q, k, v, {.causal = causal});
  out.backward(shard(in.upstream).to(dtype));
  const std::vector<at::Tensor> got{out.detach(), q.grad(), k.grad(), v.grad()};
  for (size_t i = 0; i < got.size(); ++i) {
    const auto tol = i == 0 ? out_tol : grad_tol;
    EXPECT_EQ(got[i].sizes(), shard(whole[i]).sizes()) << where << " tensor " << i;
    EXPECT_TRUE(torch::allclose(got[i].to(at::kFloat), shard(whole[i]), tol.rtol, tol.atol)) << where << " tensor " << i;
  }
  return out.scalar_type();
}

}  // namespace

TEST(ContextParallel, HeadTailSplitKeepsChunksRAndMirrorAndUnshardingRestoresTheSequence) {
  for (int P : {2, 3, 4})
    run_ranks(P, [&](Communicator& comm) {
      const int64_t T = 4 * P;  // two chunks of 2 per rank
      auto x = torch::arange(2 * T).view({2, T});
      auto mine = cp::shard_sequence(x, comm, 1);
      const int r = comm.rank();
      auto expected = torch::tensor({2 * r, 2 * r + 1, 2 * (2 * P - 1 - r), 2 * (2 * P - 1 - r) + 1});
      EXPECT_TRUE(torch::equal(mine[0], expected)) << mine;
      EXPECT_TRUE(torch::equal(mine[1], expected + T)) << mine;
      EXPECT_TRUE(torch::equal(cp::positions(4, P, r, at::kCPU), expected));
      EXPECT_TRUE(torch::equal(cp::unshard_sequence(mine, comm, 1), x));
      {
        cp::Scope scope({comm, cp::CommStrategy::AllGather});
        EXPECT_TRUE(torch::equal(cp::local_positions(4, at::kCPU), expected));
      }
      EXPECT_TRUE(torch::equal(cp::local_positions(4, at::kCPU), torch::arange(4)));  // no context: arange
      auto m = error_of([&] { cp::shard_sequence(torch::zeros({1, 2 * P + 1}), comm, 1); });
      EXPECT_NE(m.find(fmt::format("the sequence length is {}, which 2 x parallelism_config_cp_size = {} does not divide",
                                   2 * P + 1, 2 * P)),
                std::string::npos)
          << m;
    });
}

TEST(ContextParallel, AttentionUnderBothStrategiesEqualsWholeSequenceAttentionWithItsGradients) {
  for (int P : {2, 3, 4})
    for (auto strategy : {cp::CommStrategy::AllGather, cp::CommStrategy::AllToAll})
      for (bool causal : {true, false}) {
        const int64_t T = 6 * P;
        const auto in = whole_inputs(T);
        const auto want = whole_attention(in, causal);
        const int64_t before = cp::wire_bytes();
        run_ranks(P, [&](Communicator& comm) {
          expect_shares_of_whole(comm, strategy, in, want, causal, kFp32, kFp32,
                                 fmt::format("cp {} {} causal {} rank {}", P, cp::to_string(strategy), causal, comm.rank()));
        });
        // Keys and values (head dims 4 + 5) of the T / P local tokens, fp32. allgather: all-gathered forward
        // and their gradients reduce-scattered backward, P - 1 shares each way per rank as a ring sends
        // them; alltoall: each block passed on P - 1 times forward, then with its gradient P - 1 times
        // backward and the gradient once more home, 3P - 2 shares. (The counter is the process's: all ranks.)
        const int64_t local_kv = 2 * 3 * (T / P) * 9 * 4;
        const int64_t per_rank = local_kv * (strategy == cp::CommStrategy::AllGather ? 2 * (P - 1) : 3 * P - 2);
        EXPECT_EQ(cp::wire_bytes() - before, P * per_rank) << P << " " << cp::to_string(strategy);
      }
}

TEST(ContextParallel, TheRingSkipsWorkAboveTheDiagonalAndRefusesDropout) {
  run_ranks(2, [&](Communicator& comm) {
    const auto in = whole_inputs(8);
    cp::Scope scope({comm, cp::CommStrategy::AllToAll});
    auto q = cp::shard_sequence(in.q, comm, 2);
    auto m = error_of([&] { xlr8::attention(q, q, q, {.causal = true, .dropout = 0.1}); });
    EXPECT_NE(m.find("dropout 0.1"), std::string::npos) << m;
    EXPECT_NE(m.find("alltoall"), std::string::npos) << m;
    // Dropout is fine when all-gathering, and without a context.
    cp::Scope allgather({comm, cp::CommStrategy::AllGather});
    EXPECT_EQ(xlr8::attention(q, q, q, {.causal = true, .dropout = 0.1}).sizes(), q.sizes());
  });
  EXPECT_EQ(error_of([] { cp::parse_comm_strategy("ring"); }),
            "parallelism_config_cp_comm_strategy: \"ring\" is not a strategy; allowed values are allgather (all-gather "
            "keys and values) and alltoall (the ring)");
}

TEST(ContextParallel, Bf16RingStaysWithinBf16OfTheFp32Whole) {
  const auto in = whole_inputs(32);
  const auto want = whole_attention(in, true);
  run_ranks(4, [&](Communicator& comm) {
    EXPECT_EQ(expect_shares_of_whole(comm, cp::CommStrategy::AllToAll, in, want, true, {3e-2, 3e-2}, {5e-2, 5e-2},
                                     "bf16 ring", at::kBFloat16),
              at::kBFloat16);
  });
}

TEST(ContextParallel, TheRingTakesLongChunksInTilesOfQueriesAndStaysExact) {
  // Chunks of 300 tokens, values wider than keys (no CPU kernel for that): the ring takes queries 256 rows
  // at a time (and the last 44), the causal mask of a diagonal pair shifted to each tile.
  const int64_t T = 4 * 300;
  const auto in = whole_inputs(T);
  const auto want = whole_attention(in, true);
  run_ranks(2, [&](Communicator& comm) {
    expect_shares_of_whole(comm, cp::CommStrategy::AllToAll, in, want, true, kFp32, kFp32, "ring tiles");
  });
}

TEST(ContextParallel, TheRingRunsLibTorchsCpuKernelOnEachChunkPairAndStaysExact) {
  // Keys and values of one width, float32: each chunk pair forward and backward through the CPU flash
  // kernel (given the merged output and log-sum-exp in backward), 2P+1 pairs a rank when causal, 4P not.
  for (int P : {2, 3, 4})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::to_string(P) + (causal ? " causal" : " full"));
      const auto in = whole_inputs(2 * P * 24, at::kFloat, 3, 4);
      const auto want = whole_attention(in, causal);
      xlr8::testing::OpCounter kernel({"aten::_scaled_dot_product_flash_attention_for_cpu",
                                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward"});
      run_ranks(P, [&](Communicator& comm) {
        expect_shares_of_whole(comm, cp::CommStrategy::AllToAll, in, want, causal, kFp32, kFp32, "ring kernel");
      });
      EXPECT_EQ(kernel.count(), 2 * P * (causal ? 2 * P + 1 : 4 * P));
    }
}

TEST(Ulysses, ContiguousSplitKeepsRankOrderAndUnshardingRestoresTheSequence) {
  for (int P : {2, 3, 4})
    run_ranks(P, [&](Communicator& comm) {
      const int64_t T = 3 * P;
      const int r = comm.rank();
      auto x = torch::arange(2 * T).view({2, T});
      auto mine = cp::shard_sequence(x, comm, 1, cp::Split::Contiguous);
      EXPECT_TRUE(torch::equal(mine, x.narrow(1, 3 * r, 3))) << mine;
      EXPECT_TRUE(torch::equal(cp::positions(3, P, r, at::kCPU, cp::Split::Contiguous), torch::arange(3 * r, 3 * r + 3)));
      EXPECT_TRUE(torch::equal(cp::unshard_sequence(mine, comm, 1, cp::Split::Contiguous), x));
      {
        cp::Scope scope({comm, cp::CommStrategy::Ulysses});
        EXPECT_TRUE(torch::equal(cp::local_positions(3, at::kCPU), torch::arange(3 * r, 3 * r + 3)));
      }
      auto m = error_of([&] { cp::shard_sequence(torch::zeros({1, P + 1}), comm, 1, cp::Split::Contiguous); });
      EXPECT_NE(m.find(fmt::format("the sequence length is {}, which parallelism_config_sp_size {} does not divide",
                                   P + 1, P)),
                std::string::npos)
          << m;
    });
}

TEST(Ulysses, AttentionEqualsWholeSequenceAttentionWithItsGradients) {
  for (int P : {2, 3, 4})
    for (int64_t v_dim : {4, 5})  // q, k, v of one shape share one all-to-all; otherwise one each
      for (bool causal : {true, false}) {
        const int64_t T = 3 * P;
        const auto in = whole_inputs(T, at::kFloat, 12, v_dim);
        const auto want = whole_attention(in, causal);
        const int64_t before = cp::wire_bytes(), blocks_before = cp::attention_blocks();
        run_ranks(P, [&](Communicator& comm) {
          expect_shares_of_whole(comm, cp::CommStrategy::Ulysses, in, want, causal, kFp32, kFp32,
                                 fmt::format("sp {} v_dim {} causal {} rank {}", P, v_dim, causal, comm.rank()));
        });
        // q, k, v in and the output back forward, their gradients the other way backward: each local
        // tensor crosses once each way, (P - 1) / P of it leaving the rank (the counter is the process's).
        const int64_t local_values = 2 * 12 * (T / P) * (4 + 4 + v_dim + v_dim);
        EXPECT_EQ(cp::wire_bytes() - before, P * 2 * local_values * 4 * (P - 1) / P) << P;
        EXPECT_EQ(cp::attention_blocks(), blocks_before);  // no chunk pairs: every rank attends over all of T
      }
}

TEST(Ulysses, HeadsThatSpDoesNotDivideAreOneErrorNamingBoth) {
  const auto in = whole_inputs(8, at::kFloat, 6, 4);
  run_ranks(4, [&](Communicator& comm) {
    auto shard = [&](const at::Tensor& t) { return cp::shard_sequence(t, comm, 2, cp::Split::Contiguous); };
    cp::Scope scope({comm, cp::CommStrategy::Ulysses});
    auto m = error_of([&] { xlr8::attention(shard(in.q), shard(in.k), shard(in.v)); });
    EXPECT_NE(m.find("query has 6 heads"), std::string::npos) << m;
    EXPECT_NE(m.find("parallelism_config_sp_size 4 does not divide"), std::string::npos) << m;
  });
}

TEST(Ulysses, Bf16StaysWithinBf16OfTheFp32Whole) {
  const auto in = whole_inputs(16, at::kFloat, 4, 4);
  const auto want = whole_attention(in, true);
  run_ranks(2, [&](Communicator& comm) {
    EXPECT_EQ(expect_shares_of_whole(comm, cp::CommStrategy::Ulysses, in, want, true, {3e-2, 3e-2}, {5e-2, 5e-2},
                                     "bf16 Ulysses", at::kBFloat16),
              at::kBFloat16);
  });
}

TEST(Ulysses, EachRanksWholeSequenceGoesThroughTheFusedKernelAndDropoutDropsWeights) {
  // 1,200 tokens: after the all-to-all each rank attends over all of them for its heads, in LibTorch's
  // fused kernel (tiled): exact against the whole.
  const int64_t T = 1200;
  const auto in = whole_inputs(T, at::kFloat, 2, 4);
  const auto want = whole_attention(in, true);
  run_ranks(2, [&](Communicator& comm) {
    expect_shares_of_whole(comm, cp::CommStrategy::Ulysses, in, want, true, kFp32, kFp32, "Ulysses fused kernel");
    // Dropout on the attention weights: the kernel drops some of them.
    auto shard = [&](const at::Tensor& t) { return cp::shard_sequence(t, comm, 2, cp::Split::Contiguous); };
    cp::Scope scope({comm, cp::CommStrategy::Ulysses});
    auto dropped = xlr8::attention(shard(in.q), shard(in.k), shard(in.v), {.causal = true, .dropout = 0.5});
    EXPECT_EQ(dropped.sizes(), shard(want[0]).sizes());
    EXPECT_FALSE(torch::allclose(dropped, shard(want[0]), 1e-3, 1e-3));
  });
}

TEST(GroupedQueryAttention, KeysAndValuesWithFewerHeadsServeConsecutiveQueryHeadsUnderEveryStrategy) {
  // 12 query heads over 4 or 1 key/value heads (Llama's repeat_kv): the whole run repeats them by hand.
  for (int64_t kv_heads : {4, 1})
    for (int P : {2, 3, 4}) {
      const int64_t T = 6 * P, group = 12 / kv_heads;
      Qkv in;
      {
        std::lock_guard<std::mutex> lock(generator_lock());
        torch::manual_seed(11);
        in = {torch::randn({2, 12, T, 4}), torch::randn({2, kv_heads, T, 4}), torch::randn({2, kv_heads, T, 4}),
              torch::randn({2, 12, T, 4})};
      }
      auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
      auto whole = xlr8::attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), {.causal = true});
      whole.backward(in.upstream);
      const std::vector<at::Tensor> want{whole.detach(), q.grad(), k.grad(), v.grad()};
      for (auto strategy : {cp::CommStrategy::AllGather, cp::CommStrategy::AllToAll, cp::CommStrategy::Ulysses}) {
        const int64_t before = cp::wire_bytes();
        run_ranks(P, [&](Communicator& comm) {
          expect_shares_of_whole(comm, strategy, in, want, true, kFp32, kFp32,
                                 fmt::format("{} kv heads {} on {} rank {}", cp::to_string(strategy), kv_heads, P,
                                             comm.rank()));
        });
        if (strategy != cp::CommStrategy::Ulysses) continue;
        // Ulysses sends k and v with their own heads when sp divides them, else repeated to q's 12: q, k, v
        // and the output (2 windows x T/P tokens x head_dim 4, fp32, per head) cross once each way, (P - 1) / P
        // of each leaving a rank.
        const int64_t crossing_kv_heads = kv_heads % P == 0 ? kv_heads : 12;
        const int64_t per_rank = 2 * (2 * 4 * (T / P) * 4 * (12 + 2 * crossing_kv_heads + 12)) * (P - 1) / P;
        EXPECT_EQ(cp::wire_bytes() - before, P * per_rank) << kv_heads << " kv heads on " << P;
      }
    }
  const auto five = torch::zeros({1, 5, 4, 4}), twelve = torch::zeros({1, 12, 4, 4});
  try {
    xlr8::attention(twelve, five, five);
    ADD_FAILURE() << "no error";
  } catch (const xlr8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("grouped-query attention needs k and v with one number of heads that divides "
                                         "q's"),
              std::string::npos)
        << e.what();
  }
}

TEST(Attention, OnTheCpuShortBf16SequencesTakePlainAttentionAndTheRestLibTorchsFusedKernelAllExact) {
  // The fused kernel where it is the faster (float32 at any length, bf16 above 512 keys), plain attention's
  // two GEMMs for bf16 up to 512 keys: each within bf16 of the float32 result, gradients too.
  for (const auto& [T, dtype, fused] : std::vector<std::tuple<int64_t, at::ScalarType, bool>>{
           {64, at::kFloat, true}, {512, at::kBFloat16, false}, {640, at::kBFloat16, true}}) {
    SCOPED_TRACE(std::to_string(T) + " " + c10::toString(dtype));
    const auto in = whole_inputs(T, at::kFloat, 3, 4);  // value width = key width: the CPU flash kernel's case
    const auto want = whole_attention(in, true);
    auto q = in.q.to(dtype).requires_grad_(), k = in.k.to(dtype).requires_grad_(), v = in.v.to(dtype).requires_grad_();
    xlr8::testing::OpCounter kernel({"aten::_scaled_dot_product_flash_attention_for_cpu"});
    auto out = xlr8::attention(q, k, v, {.causal = true});
    out.backward(in.upstream.to(dtype));
    EXPECT_EQ(kernel.count(), fused ? 1 : 0);
    const double tol = dtype == at::kFloat ? 1e-5 : 3e-2;
    const std::vector<at::Tensor> got{out.detach(), q.grad(), k.grad(), v.grad()};
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::allclose(got[i].to(at::kFloat), want[i], tol, tol))
          << "tensor " << i << ": max difference " << (got[i].to(at::kFloat) - want[i]).abs().max().item<double>();
  }
}
