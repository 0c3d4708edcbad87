// Collectives x dtypes on 2 and 4 ranks (threads over an in-process store), timeouts, errors,
// sub-groups, the device mesh, ProcessState and rendezvous over a real TCPStore on loopback.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include <unistd.h>

#include <filesystem>

#include "compat/torch_compat.hpp"
#include "dist/shm_segment.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/error.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/self_check.hpp"

using namespace xlr8;
using namespace std::chrono_literals;

namespace {

std::string unique_key() {
  static std::atomic<int> counter{0};
  return fmt::format("{}-{}", ::testing::UnitTest::GetInstance()->current_test_info()->name(), counter++);
}

// Runs fn(comm) on P ranks, one thread each; rethrows the first failure.
template <class Fn>
void run_ranks(int P, Fn fn, std::chrono::milliseconds timeout = 30s, bool shared_memory = true) {
  std::string key = unique_key();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(P);
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = Communicator::in_process(key, r, P, timeout, shared_memory);
        fn(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

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

// ---------------------------------------------------------------------------------------------- shared memory

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
  const std::string prefix = fmt::format("xlr8.{}.{}.", xlr8::detail::shared_memory_job(), getpid());
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
  auto segment = xlr8::detail::SharedSegment::create(fmt::format("/xlr8.{}.1.0", job), 4096);
  EXPECT_EQ(shm_entries("xlr8." + job + ".").size(), 1u);
  EXPECT_EQ(xlr8::detail::remove_job_segments(job), 1);
  EXPECT_TRUE(shm_entries("xlr8." + job + ".").empty());
  segment->data()[0] = std::byte{1};  // the mapping outlives the name
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

TEST(DeviceMesh, GroupsReduceOverTheRightRanks) {
  run_ranks(4, [](Communicator& world) {
    DeviceMesh mesh(world, MeshLayout::from({2, 2, 1, 1}, 4));
    for (const std::string name : {"dp_replicate", "dp_shard", "dp", "cp", "tp", "dp_shard_cp"}) {
      auto x = at::full({2}, world.rank(), at::kLong);
      auto& g = mesh.group(name);
      EXPECT_EQ(g.size(), mesh.size(name)) << name;
      EXPECT_EQ(g.rank(), mesh.rank(name)) << name;
      g.all_reduce(x);
      long want = 0;
      for (int r : mesh.layout().group_ranks(world.rank(), name)) want += r;
      EXPECT_EQ(x[0].item<long>(), want) << name;
    }
  });
}

TEST(ProcessState, SingleProcessNeedsNoNetwork) {
  auto s = ProcessState::create(Env());
  EXPECT_EQ(s->world_size(), 1);
  EXPECT_EQ(s->distributed_type(), DistributedType::NO);
  EXPECT_EQ(s->device(), "cpu");
  EXPECT_EQ(s->backend(), "gloo");
  auto x = at::ones({3});
  s->world().all_reduce(x);
  EXPECT_EQ(x.sum().item<float>(), 3.0f);
}

TEST(ProcessState, ThreadsAreCoresOverLocalRanksUnlessOmpSaysOtherwise) {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  auto s = ProcessState::create(Env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "2"}}));
  EXPECT_EQ(s->intra_op_threads(), std::max(1, cores / 2));
  EXPECT_EQ(at::get_num_threads(), std::max(1, cores / 2));
  auto t = ProcessState::create(Env({{"OMP_NUM_THREADS", "3"}}));
  EXPECT_EQ(t->intra_op_threads(), 3);
}

TEST(ProcessState, StrategyFromAccelerateVariables) {
  auto s = ProcessState::create(Env({{"ACCELERATE_USE_DEEPSPEED", "true"}, {"ACCELERATE_DEEPSPEED_ZERO_STAGE", "1"},
                                     {"ACCELERATE_MIXED_PRECISION", "bf16"}}));
  EXPECT_EQ(s->distributed_type(), DistributedType::DEEPSPEED);
  EXPECT_EQ(s->mixed_precision(), MixedPrecision::BF16);
  EXPECT_EQ(s->settings().deepspeed->zero_stage, 1);
}

namespace {
Env rank_env(int rank, int world, int port) {
  return Env({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", std::to_string(world)}, {"MASTER_ADDR", "127.0.0.1"},
              {"MASTER_PORT", std::to_string(port)}, {"XLR8_RDZV_TIMEOUT", "2"}, {"OMP_NUM_THREADS", "1"}});
}
}  // namespace

TEST(Rendezvous, RanksMeetOverTcpStoreAndReduce) {
  int port = pick_free_port();
  std::vector<std::thread> threads;
  std::vector<float> sums(3);
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto s = ProcessState::create(rank_env(r, 3, port));
      EXPECT_EQ(s->distributed_type(), DistributedType::MULTI_CPU);
      auto x = at::full({2}, r + 1.0);
      s->world().all_reduce(x);
      sums[r] = x[0].item<float>();
      s->world().barrier();
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(sums, (std::vector<float>{6, 6, 6}));
}

TEST(Rendezvous, MissingRanksAreNamedWithinTheTimeout) {
  int port = pick_free_port();
  std::vector<std::string> errors(2);
  std::vector<double> seconds(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)  // ranks 2 and 3 never come
    threads.emplace_back([&, r] {
      auto start = std::chrono::steady_clock::now();
      try {
        ProcessState::create(rank_env(r, 4, port));
      } catch (const Error& e) {  // rank 1 may instead see rank 0's server close after rank 0 gave up
        errors[r] = e.what();
      }
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("missing ranks 2, 3"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << errors[0];
  EXPECT_LT(seconds[0], 8.0);
  EXPECT_TRUE(errors[1].find("missing ranks 2, 3") != std::string::npos ||
              errors[1].find("rank 1 lost the rendezvous server") != std::string::npos)
      << errors[1];
  EXPECT_LT(seconds[1], 8.0);
}

TEST(Rendezvous, PortInUseIsAClearError) {
  int port = pick_free_port();
  auto blocker = xlr8::compat::make_tcp_store("127.0.0.1", port, true, 1, 5s);  // someone else's server
  try {
    ProcessState::create(rank_env(0, 2, port));
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("rank 0 could not start the rendezvous server"), std::string::npos) << m;
    EXPECT_NE(m.find("--main_process_port"), std::string::npos) << m;
  }
}

TEST(ConfigureEnvironment, SetsTheLauncherVariablesAndRefusesLateStrategyChanges) {
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("ACCELERATE_USE_FSDP");
  Settings fsdp;
  fsdp.fsdp = FsdpSettings{};
  Topology single;
  if (!ProcessState::exists()) {
    configure_environment(fsdp, single);
    EXPECT_STREQ(std::getenv("ACCELERATE_USE_FSDP"), "true");
    EXPECT_STREQ(std::getenv("WORLD_SIZE"), "1");
    Settings plain;
    configure_environment(plain, single);  // still early: replaces the strategy
    EXPECT_EQ(std::getenv("ACCELERATE_USE_FSDP"), nullptr);
  }
  const auto& state = ProcessState::instance();
  EXPECT_EQ(state.settings().strategy_name(), "ddp");
  try {
    configure_environment(fsdp, single);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("after the ProcessState was created"), std::string::npos) << m;
    EXPECT_NE(m.find("before"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(configure_environment(state.settings(), single));  // same settings: fine
}
