// Collectives x dtypes on 1, 2 and 4 ranks (threads over an in-process store), over shared memory and
// over Gloo; async interleaving, non-contiguous tensors, timeouts and bad arguments.
#include <gtest/gtest.h>

#include "thread_ranks.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;
using namespace xlr8::testing;
using namespace std::chrono_literals;

namespace {

void expect_all_checks_pass(int P, bool shared_memory = true) {
  run_ranks(
      P,
      [&](Communicator& comm) {
        EXPECT_EQ(comm.uses_shared_memory(), shared_memory && P > 1);
        auto results = run_collective_checks(comm);
        EXPECT_GT(results.size(), 80u);
        for (auto& r : results) EXPECT_TRUE(r.ok) << "rank " << comm.rank() << ": " << r.name << ": " << r.detail;
      },
      30s, shared_memory);
}

}  // namespace

TEST(Collectives, EveryCollectiveEveryDtypeOn2Ranks) { expect_all_checks_pass(2); }
TEST(Collectives, EveryCollectiveEveryDtypeOn4Ranks) { expect_all_checks_pass(4); }
TEST(Collectives, SingleRankIsTheIdentity) { expect_all_checks_pass(1); }
TEST(Collectives, EveryCollectiveEveryDtypeOverGlooOn2Ranks) { expect_all_checks_pass(2, false); }
TEST(Collectives, EveryCollectiveEveryDtypeOverGlooOn4Ranks) { expect_all_checks_pass(4, false); }

TEST(Collectives, AsyncCompositeAndNativeOpsInterleave) {
  // bf16 reductions run as a ring on a helper thread while float ones go to Gloo directly; results must
  // not depend on which finishes first, whatever order they are waited for.
  run_ranks(3, [](Communicator& comm) {
    std::vector<at::Tensor> tensors;
    std::vector<Work> works;
    for (int i = 0; i < 12; ++i) {
      auto dtype = i % 2 ? at::kBFloat16 : at::kFloat;
      tensors.push_back(at::full({257 + i}, comm.rank() + i, dtype));
      works.push_back(comm.all_reduce_async(tensors.back()));
    }
    for (int i = 11; i >= 0; --i) works[i].wait();
    for (int i = 0; i < 12; ++i) {
      double want = 3 * i + 3;  // sum over ranks of (rank + i)
      EXPECT_EQ(tensors[i].to(at::kDouble).min().item<double>(), want) << i;
      EXPECT_EQ(tensors[i].to(at::kDouble).max().item<double>(), want) << i;
    }
  });
}

TEST(Collectives, NonContiguousTensorsAreHandled) {
  run_ranks(2, [](Communicator& comm) {
    auto base = at::full({4, 6}, comm.rank() + 1.0, at::kFloat);
    auto view = base.t();  // not contiguous
    comm.all_reduce(view);
    EXPECT_TRUE(at::allclose(base, at::full({4, 6}, 3.0)));
    auto bview = at::full({4, 6}, comm.rank() + 1.0, at::kBFloat16).t();
    comm.broadcast(bview, 1);
    EXPECT_EQ(bview.to(at::kFloat).sum().item<float>(), 48.0f);
  });
}

TEST(Collectives, TimeoutNamesCollectiveTensorRankAndGroup) {
  // Shared memory; then Gloo's native path (float) and the send/recv ring (bf16).
  for (auto [dtype, shared_memory] : {std::pair{at::kFloat, true}, std::pair{at::kFloat, false},
                                      std::pair{at::kBFloat16, false}}) {
    SCOPED_TRACE(shared_memory ? "shared memory" : "gloo");
    std::atomic<bool> rank0_done{false};
    std::string message;
    double seconds = 0;
    run_ranks(
        2,
        [&](Communicator& comm) {
          if (comm.rank() == 1) {  // never joins the collective
            while (!rank0_done) std::this_thread::sleep_for(10ms);
            return;
          }
          auto x = at::ones({8}, dtype);
          auto start = std::chrono::steady_clock::now();
          try {
            comm.all_reduce(x);
          } catch (const TimeoutError& e) {
            message = e.what();
          }
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          rank0_done = true;
        },
        1s, shared_memory);
    std::string type = dtype == at::kFloat ? "float32[8]" : "bfloat16[8]";
    EXPECT_NE(message.find("all_reduce(" + type + ", SUM)"), std::string::npos) << message;
    EXPECT_NE(message.find("group 'world' (rank 0 of 2)"), std::string::npos) << message;
    EXPECT_NE(message.find("timed out"), std::string::npos) << message;
    EXPECT_LT(seconds, 10.0);
    if (shared_memory) {
      EXPECT_NE(message.find("rank 1 (pid"), std::string::npos) << message;  // who is late
    }
  }
}

TEST(Collectives, BadArgumentsAreClearErrors) {
  run_ranks(2, [](Communicator& comm) {
    auto in = at::ones({4});
    auto wrong = at::empty({7});
    try {
      comm.all_gather(wrong, in);
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("needs 8"), std::string::npos) << e.what();
    }
    EXPECT_THROW(comm.reduce_scatter(wrong, in), Error);
    EXPECT_THROW(comm.broadcast(in, 5), Error);
    EXPECT_THROW(comm.send(in, comm.rank()), Error);
    try {
      comm.new_group({1 - comm.rank()}, "others");
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a member"), std::string::npos) << e.what();
    }
  });
}
