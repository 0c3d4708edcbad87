// The shared-memory transport: chunked and symmetric operands, all_reduce_into, mismatched
// collectives, and segment names that vanish (or are removed) so a crash leaves nothing in /dev/shm.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "os/shm_segment.hpp"
#include "thread_ranks.hpp"
#include "xlr8/error.hpp"

using namespace xlr8;
using namespace xlr8::testing;
using namespace std::chrono_literals;


TEST(SharedMemory, ChunkedOddSizedOperandsGiveExactResults) {
  // 64 KB staging slots, so the larger operands cross many chunks; 3 ranks, so shards are uneven.
  setenv("XLR8_SHM_STAGING_MB", "0.0625", 1);
  run_ranks(3, [](Communicator& comm) {
    ASSERT_TRUE(comm.uses_shared_memory());
    const int P = comm.size(), r = comm.rank();
    for (int64_t n : {1, 7, 16383, 100003}) {
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong}) {
        SCOPED_TRACE(fmt::format("n={} dtype={}", n, c10::toString(dtype)));
        auto base = at::arange(n, at::kLong).remainder(7);
        auto x = (base + r).to(dtype);
        comm.all_reduce(x);
        EXPECT_TRUE(at::equal(x.to(at::kLong), base * P + P * (P - 1) / 2));
        auto m = (base + r).to(dtype);
        comm.all_reduce(m, ReduceOp::MAX);
        EXPECT_TRUE(at::equal(m.to(at::kLong), base + P - 1));
        auto input = (at::arange(P * n, at::kLong).remainder(5) + r).to(dtype);
        auto out = at::empty({n}, dtype);
        comm.reduce_scatter(out, input);
        auto want = at::arange(P * n, at::kLong).remainder(5).narrow(0, r * n, n) * P + P * (P - 1) / 2;
        EXPECT_TRUE(at::equal(out.to(at::kLong), want));
        auto gathered = at::empty({P * n}, dtype);
        comm.all_gather(gathered, (base + 10 * r).to(dtype));
        for (int j = 0; j < P; ++j) EXPECT_TRUE(at::equal(gathered.narrow(0, j * n, n).to(at::kLong), base + 10 * j));
      }
    }
    auto avg = at::full({1001}, 2.0 * r + 1);  // 1, 3, 5 -> 3
    comm.all_reduce(avg, ReduceOp::AVG);
    EXPECT_TRUE(at::allclose(avg, at::full({1001}, 3.0)));
  });
  unsetenv("XLR8_SHM_STAGING_MB");
}

TEST(SharedMemory, SymmetricTensorsAndTheirViewsAreReducedInPlace) {
  run_ranks(2, [](Communicator& comm) {
    const int r = comm.rank();
    auto buffer = comm.symmetric_empty({1000}, at::kFloat);
    buffer.fill_(r + 1);
    auto middle = buffer.narrow(0, 100, 500);
    comm.all_reduce(middle);  // 1 + 2 inside the view, untouched outside it
    EXPECT_EQ(buffer.narrow(0, 100, 500).min().item<float>(), 3.0f);
    EXPECT_EQ(buffer.narrow(0, 100, 500).max().item<float>(), 3.0f);
    EXPECT_EQ(buffer.narrow(0, 0, 100).max().item<float>(), r + 1.0f);
    EXPECT_EQ(buffer.narrow(0, 600, 400).min().item<float>(), r + 1.0f);
    auto source = comm.symmetric_empty({2, 300}, at::kFloat);
    source[0].fill_(10 * r);
    source[1].fill_(10 * r + 1);
    auto out = at::empty({300});
    comm.reduce_scatter(out, source);  // rank k gets row k summed: 0 + 10 (+ 2 for row 1)
    EXPECT_TRUE(at::equal(out, at::full({300}, 10.0 + 2 * r)));
    auto gathered = at::empty({2, 2, 300});
    comm.all_gather(gathered, source);
    EXPECT_EQ(gathered[1][1][0].item<float>(), 11.0f);
    // Symmetric on one rank, an ordinary tensor on the other: a clear error, not silent corruption.
    auto symmetric = comm.symmetric_empty({64}, at::kFloat).fill_(1);  // collective: both ranks make it
    auto mixed = r == 0 ? symmetric : at::ones({64});
    try {
      comm.all_reduce(mixed);
      ADD_FAILURE() << "rank " << r << ": mixing a symmetric and an ordinary tensor was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("rank {} called all_reduce(float32[64]", 1 - r)),
                std::string::npos)
          << e.what();
    }
  });
}

// all_reduce_into over shared memory into a symmetric output (this rank's shard read straight from the
// inputs), into an ordinary output, and over Gloo: the same exact results, the inputs left unchanged.
void expect_all_reduce_into_is_exact(int P, bool shared_memory) {
  run_ranks(
      P,
      [&](Communicator& comm) {
        const int r = comm.rank();
        // Uneven pieces, so shard edges fall inside pieces; one piece is already the output's own region.
        const std::vector<int64_t> sizes{5, 70001, 0, 33333, 17};
        const int64_t total = 5 + 70001 + 33333 + 17;
        for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {  // float32 takes the SSE kernel
          for (bool symmetric : {true, false}) {
            for (auto op : {ReduceOp::SUM, ReduceOp::AVG}) {
              SCOPED_TRACE(fmt::format("P={} shm={} dtype={} symmetric={} op={}", P, shared_memory,
                                       c10::toString(dtype), symmetric, to_string(op)));
              auto output = symmetric ? comm.symmetric_empty({total}, dtype) : at::empty({total}, dtype);
              output.fill_(-1);
              auto values = (at::arange(total, at::kLong).remainder(11) * P + r).to(dtype);  // sum: 11-ish * P^2 + P(P-1)/2
              std::vector<at::Tensor> inputs, originals;
              int64_t offset = 0;
              for (size_t i = 0; i < sizes.size(); ++i) {
                auto part = values.narrow(0, offset, sizes[i]);
                inputs.push_back(i == 3 ? output.narrow(0, offset, sizes[i]).copy_(part) : part.clone());
                originals.push_back(part.clone());
                offset += sizes[i];
              }
              comm.all_reduce_into(output, inputs, op);
              auto base = at::arange(total, at::kLong).remainder(11) * P;
              auto sum = base * P + P * (P - 1) / 2;
              auto want = op == ReduceOp::SUM ? sum.to(at::kDouble) : sum.to(at::kDouble) / P;
              EXPECT_TRUE(at::equal(output.to(at::kDouble), want.to(dtype).to(at::kDouble)));
              for (size_t i = 0; i < inputs.size(); ++i) {
                if (i == 3) continue;  // the output's own region
                EXPECT_TRUE(at::equal(inputs[i], originals[i])) << "input " << i << " was changed";
              }
            }
          }
        }
        auto out = comm.symmetric_empty({8}, at::kFloat);
        EXPECT_THROW(comm.all_reduce_into(out, {at::ones({7})}), Error);                  // 7 elements for 8
        EXPECT_THROW(comm.all_reduce_into(out, {at::ones({8}, at::kDouble)}), Error);     // wrong dtype
        EXPECT_THROW(comm.all_reduce_into(out, {out.narrow(0, 1, 4), at::ones({4})}), Error);  // misplaced overlap
        try {
          comm.all_reduce_into(out, {at::ones({3}), at::ones({3})});
          ADD_FAILURE() << "a short input list was accepted";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("the inputs hold 6 elements in all but the output holds 8"),
                    std::string::npos)
              << e.what();
        }
      },
      30s, shared_memory);
}

TEST(SharedMemory, AllReduceIntoGivesExactResultsOn2And3Ranks) {
  expect_all_reduce_into_is_exact(2, true);
  expect_all_reduce_into_is_exact(3, true);
}
TEST(Collectives, AllReduceIntoOverGlooMatchesSharedMemory) { expect_all_reduce_into_is_exact(3, false); }

TEST(SharedMemory, MismatchedCollectivesFailOnEveryRankInsteadOfHanging) {
  std::vector<std::string> messages(2);
  auto start = std::chrono::steady_clock::now();
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto x = at::ones({comm.rank() == 0 ? 10 : 12});
        try {
          comm.all_reduce(x);
        } catch (const Error& e) {
          messages[comm.rank()] = e.what();
        }
        auto y = at::ones({4});
        EXPECT_THROW(comm.all_reduce(y), Error);  // the group stays failed, it does not hang
      },
      60s);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  EXPECT_NE(messages[0].find("rank 1 called all_reduce(float32[12], SUM)"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("rank 0 called all_reduce(float32[10], SUM)"), std::string::npos) << messages[1];
}

namespace {
std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> found;
  for (auto& entry : std::filesystem::directory_iterator("/dev/shm"))
    if (entry.path().filename().string().rfind(prefix, 0) == 0) found.push_back(entry.path().filename());
  return found;
}
}  // namespace

TEST(SharedMemory, SegmentsHaveNoNameOnceEveryRankHasMappedThem) {
  const std::string prefix = fmt::format("xlr8.{}.{}.", xlr8::os::shared_memory_job(), getpid());
  run_ranks(4, [&](Communicator& comm) {
    ASSERT_TRUE(comm.uses_shared_memory());
    auto buffer = comm.symmetric_empty({1 << 16}, at::kFloat).fill_(1);
    comm.all_reduce(buffer);
    EXPECT_EQ(buffer[0].item<float>(), 4.0f);
    comm.barrier();
    EXPECT_EQ(shm_entries(prefix), std::vector<std::string>{});  // nothing for a crash to leave behind
  });
}

TEST(SharedMemory, RemoveJobSegmentsDeletesWhatACrashedWorkerLeft) {
  const std::string job = fmt::format("unit{}", getpid());
  auto segment = xlr8::os::SharedSegment::create(fmt::format("/xlr8.{}.1.0", job), 4096);
  EXPECT_EQ(shm_entries("xlr8." + job + ".").size(), 1u);
  EXPECT_EQ(xlr8::os::remove_job_segments(job), 1);
  EXPECT_TRUE(shm_entries("xlr8." + job + ".").empty());
  segment->data()[0] = std::byte{1};  // the mapping outlives the name
}
