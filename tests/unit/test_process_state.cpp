// The device mesh's groups, ProcessState from the environment, rendezvous over a real TCPStore on
// loopback, and configure_environment.
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "compat/torch_compat.hpp"
#include "compat/abort_at_exit.hpp"
#include "thread_ranks.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/process_state.hpp"

using namespace xlr8;
using namespace xlr8::testing;
using namespace std::chrono_literals;

TEST(DeviceMesh, GroupsReduceOverTheRightRanks) {
  run_ranks(4, [](Communicator& world) {
    DeviceMesh mesh(world, MeshLayout::from({.dp_replicate = 2, .dp_shard = 2}, 4));
    for (const auto name : {MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::dp, MeshDim::cp, MeshDim::tp, MeshDim::dp_shard_cp,
                            MeshDim::pp}) {
      auto x = at::full({2}, world.rank(), at::kLong);
      auto& g = mesh.group(name);
      EXPECT_EQ(g.size(), mesh.size(name)) << to_string(name);
      EXPECT_EQ(g.rank(), mesh.rank(name)) << to_string(name);
      g.all_reduce(x);
      long want = 0;
      for (int r : mesh.layout().group_ranks(world.rank(), name)) want += r;
      EXPECT_EQ(x[0].item<long>(), want) << to_string(name);
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
  EXPECT_EQ(state.settings().distributed_type_name(), "ddp");
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

// ------------------------------------------------------------------ groups aborted at exit
// The NCCL exit handler's logic (compat/abort_at_exit.hpp) over a group type that needs no GPU: it
// counts abort() and its own destruction.
namespace {
struct CountingGroup : c10::intrusive_ptr_target {
  static inline int aborted = 0;
  static inline int destroyed = 0;
  void abort() { ++aborted; }
  ~CountingGroup() override { ++destroyed; }
};
using CountingAtExit = xlr8::compat::AbortAtExit<CountingGroup>;
}  // namespace

TEST(AbortAtExit, AbortsTheGroupsStillHeldAndNeverDestroysThem) {
  const int aborted = CountingGroup::aborted, destroyed = CountingGroup::destroyed;
  auto kept = c10::make_intrusive<CountingGroup>();
  auto dropped = c10::make_intrusive<CountingGroup>();
  auto kept_handle = CountingAtExit::instance().add(kept);
  auto dropped_handle = CountingAtExit::instance().add(dropped);
  // Dropped during the run (handle first, then the group): destroyed then, as any group, and not aborted later.
  dropped_handle.reset();
  dropped.reset();
  EXPECT_EQ(CountingGroup::destroyed, destroyed + 1);
  CountingAtExit::abort_all();
  EXPECT_EQ(CountingGroup::aborted, aborted + 1);
  // Its owner's statics go on being destroyed after the handler: the group outlives them.
  kept_handle.reset();
  kept.reset();
  EXPECT_EQ(CountingGroup::destroyed, destroyed + 1);
  CountingAtExit::abort_all();  // nothing left registered
  EXPECT_EQ(CountingGroup::aborted, aborted + 1);
}

TEST(AbortAtExitDeathTest, RunsAtExitBeforeTheStaticsThatOwnTheGroups) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        struct Owner {  // as the process state's statics hold their groups
          c10::intrusive_ptr<CountingGroup> group = c10::make_intrusive<CountingGroup>();
          std::shared_ptr<void> handle = CountingAtExit::instance().add(group);
          ~Owner() {
            handle.reset();
            group.reset();
            std::fprintf(stderr, "owner gone: aborted %d, destroyed %d\n", CountingGroup::aborted,
                         CountingGroup::destroyed);
          }
        };
        static Owner owner;
        CountingAtExit::arm();  // at the first collective: after the owner was built
        CountingAtExit::arm();  // once only
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "owner gone: aborted 1, destroyed 0\n");
}

// ------------------------------------------------------------------ LibTorch's CUDA half on demand
// compat/cuda_on_demand.hpp: libtorch_cuda.so is in this process exactly where the NVIDIA driver's library
// loads; xlr8's plugin brings it, and makes NCCL groups through it.
namespace {
bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("/" + library) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST(CudaOnDemand, LibTorchsCudaHalfIsLoadedExactlyWhereTheDriverLoads) {
  if (!compat::kHaveNccl) GTEST_SKIP() << "a LibTorch without CUDA: nothing to load";
  EXPECT_EQ(mapped("libtorch_cuda.so"), compat::cuda_driver_loads());
  if (!compat::cuda_driver_loads()) {
    EXPECT_EQ(compat::cuda_device_count(), 0);
  }
}

TEST(CudaOnDemandDeathTest, ThePluginLoadsLibTorchsCudaHalfAndMakesNcclGroups) {
  if (!compat::kHaveNccl) GTEST_SKIP() << "a LibTorch without CUDA: no plugin";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // In a child: what the plugin loads stays loaded.
  EXPECT_EXIT(
      {
        const auto& plugin = compat::cuda_plugin();
        std::fprintf(stderr, "cuda half mapped: %d\n", mapped("libtorch_cuda.so"));
        std::shared_ptr<void> at_exit;
        try {
          auto group = plugin.make_nccl(c10::make_intrusive<c10d::HashStore>(), 0, 1, 5s, at_exit);
          std::fprintf(stderr, "nccl group made on %d GPUs\n", compat::cuda_device_count());
        } catch (const std::exception& e) {  // no GPU here: ProcessGroupNCCL's own refusal
          std::fprintf(stderr, "nccl refused: %s\n", e.what());
        }
        std::fflush(stderr);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0),
      compat::cuda_driver_loads() ? "cuda half mapped: 1\n(.|\n)*nccl group made"
                                  : "cuda half mapped: 1\n(.|\n)*nccl refused: (.|\n)*GPU");
}
