// How enable_cpu_affinity splits a host's CPUs between its local ranks (the binding itself is tested
// with real processes in tests/multiprocess).
#include <gtest/gtest.h>

#include "os/cpu_affinity.hpp"
#include "xlr8/error.hpp"

using xlr8::os::cpu_list_text;
using xlr8::os::cpus_for_local_rank;
using xlr8::os::LogicalCpu;

namespace {

// Linux numbering on a 2-socket machine with hyperthreads: cpu = core + cores * socket for the first
// thread of each core, then the same again plus sockets * cores for the second thread.
std::vector<LogicalCpu> two_sockets(int cores_per_socket) {
  std::vector<LogicalCpu> cpus;
  for (int thread = 0; thread < 2; ++thread)
    for (int socket = 0; socket < 2; ++socket)
      for (int core = 0; core < cores_per_socket; ++core)
        cpus.push_back({core + cores_per_socket * socket + thread * 2 * cores_per_socket, socket, core});
  return cpus;
}

}  // namespace

TEST(CpuAffinity, WholeCoresInSocketOrderSoHyperthreadSiblingsStayTogether) {
  auto cpus = two_sockets(4);
  EXPECT_EQ(cpus_for_local_rank(cpus, 0, 2), (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(cpus_for_local_rank(cpus, 1, 2), (std::vector<int>{4, 5, 6, 7, 12, 13, 14, 15}));
  EXPECT_EQ(cpus_for_local_rank(cpus, 0, 4), (std::vector<int>{0, 1, 8, 9}));
  EXPECT_EQ(cpus_for_local_rank(cpus, 3, 4), (std::vector<int>{6, 7, 14, 15}));
}

TEST(CpuAffinity, UnevenSplitsAndRestrictedSetsUseEveryAllowedCpuOnce) {
  std::vector<LogicalCpu> three{{0, 0, 0}, {1, 0, 1}, {2, 0, 2}};
  EXPECT_EQ(cpus_for_local_rank(three, 0, 2), (std::vector<int>{0}));
  EXPECT_EQ(cpus_for_local_rank(three, 1, 2), (std::vector<int>{1, 2}));
  // A cgroup or taskset that allows CPUs 2, 5 and 7 only.
  std::vector<LogicalCpu> restricted{{7, 0, 7}, {2, 0, 2}, {5, 0, 5}};
  EXPECT_EQ(cpus_for_local_rank(restricted, 0, 3), (std::vector<int>{2}));
  EXPECT_EQ(cpus_for_local_rank(restricted, 1, 3), (std::vector<int>{5}));
  EXPECT_EQ(cpus_for_local_rank(restricted, 2, 3), (std::vector<int>{7}));
}

TEST(CpuAffinity, MoreRanksThanCoresSplitsHyperthreadsThenSharesCpus) {
  // 2 cores with 2 threads each (CPUs 0/2 on core 0, 1/3 on core 1), 4 ranks: one logical CPU each.
  std::vector<LogicalCpu> cpus{{0, 0, 0}, {1, 0, 1}, {2, 0, 0}, {3, 0, 1}};
  std::vector<int> seen;
  for (int r = 0; r < 4; ++r) {
    auto mine = cpus_for_local_rank(cpus, r, 4);
    ASSERT_EQ(mine.size(), 1u);
    seen.push_back(mine[0]);
  }
  EXPECT_EQ(seen, (std::vector<int>{0, 2, 1, 3}));
  // One CPU, three ranks: they share it.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(cpus_for_local_rank({{4, 0, 0}}, r, 3), (std::vector<int>{4}));
}

TEST(CpuAffinity, ImpossibleRequestsAreErrors) {
  EXPECT_THROW(cpus_for_local_rank({}, 0, 1), xlr8::Error);
  EXPECT_THROW(cpus_for_local_rank({{0, 0, 0}}, 2, 2), xlr8::Error);
  EXPECT_THROW(cpus_for_local_rank({{0, 0, 0}}, 0, 0), xlr8::Error);
}

TEST(CpuAffinity, CpuListTextUsesRanges) {
  EXPECT_EQ(cpu_list_text({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(cpu_list_text({5}), "5");
  EXPECT_EQ(cpu_list_text({}), "");
}
