// Where a process sits when a scheduler started it. The variable sets below are what Debian's OpenMPI 4.1
// `mpirun -np 2` and Slurm 22.05 `srun -n 2` really set (trimmed to the ones xlr8 reads); the end-to-end
// tests under the real programs are in tests/multiprocess/test_schedulers.cpp.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "distributed/rendezvous.hpp"
#include "xlr8/error.hpp"
#include "xlr8/settings.hpp"

using namespace xlr8;

namespace {

// Rank `rank` of OpenMPI's `mpirun -np 2` on one machine.
Env openmpi_one_node(int rank, const std::string& jobid = "1313865729") {
  return Env({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
              {"OMPI_COMM_WORLD_SIZE", "2"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
              {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(rank)},  // a per-node rank, not a node index
              {"OMPI_MCA_orte_num_nodes", "1"},
              {"OMPI_MCA_ess_base_jobid", jobid},
              {"PMIX_NAMESPACE", jobid},
              {"PMIX_RANK", std::to_string(rank)}});
}

Env slurm_step(int rank, const std::string& step, const std::string& nodelist = "vm", int nodes = 1) {
  int tasks_per_node = 2;
  return Env({{"SLURM_PROCID", std::to_string(rank)},
              {"SLURM_NTASKS", std::to_string(tasks_per_node * nodes)},
              {"SLURM_STEP_NUM_TASKS", std::to_string(tasks_per_node * nodes)},
              {"SLURM_LOCALID", std::to_string(rank % tasks_per_node)},
              {"SLURM_NODEID", std::to_string(rank / tasks_per_node)},
              {"SLURM_NNODES", std::to_string(nodes)},
              {"SLURM_STEP_NUM_NODES", std::to_string(nodes)},
              {"SLURM_STEP_TASKS_PER_NODE", fmt::format("{}(x{})", tasks_per_node, nodes)},
              {"SLURM_JOB_ID", "2"},
              {"SLURM_CLUSTER_NAME", "c1"},
              {"SLURM_STEP_ID", step},
              {"SLURM_STEP_NODELIST", nodelist},
              {"SLURM_JOB_NODELIST", nodelist}});
}

}  // namespace

TEST(SchedulerTopology, OpenMpiOnOneNodeIsNodeZeroOnLoopbackWithTheJobsPort) {
  auto r0 = topology_from_env(openmpi_one_node(0)), r1 = topology_from_env(openmpi_one_node(1));
  EXPECT_EQ(r1.source, "openmpi");
  EXPECT_EQ(r1.rank, 1);
  EXPECT_EQ(r1.local_rank, 1);
  EXPECT_EQ(r1.node_rank, 0);  // was 1 from OMPI_COMM_WORLD_NODE_RANK, and refused as inconsistent
  EXPECT_EQ(r1.num_nodes, 1);
  EXPECT_EQ(r1.master_addr, "127.0.0.1");
  EXPECT_EQ(r0.master_port, r1.master_port);
  EXPECT_EQ(r0.master_port, port_for_job("OMPI_MCA_ess_base_jobid:1313865729"));
  EXPECT_NE(topology_from_env(openmpi_one_node(0, "1313865730")).master_port, r0.master_port);
}

TEST(SchedulerTopology, OpenMpiAcrossNodesNeedsMasterAddr) {
  auto env = openmpi_one_node(0);
  env.set("OMPI_COMM_WORLD_SIZE", "4");
  env.set("OMPI_MCA_orte_num_nodes", "2");
  try {
    topology_from_env(env);
    FAIL() << "no MASTER_ADDR across nodes must be refused";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("MASTER_ADDR is not set"), std::string::npos) << m;
    EXPECT_NE(m.find("-x MASTER_ADDR"), std::string::npos) << m;
  }
  env.set("MASTER_ADDR", "10.0.0.1");
  env.set("MASTER_PORT", "29400");
  auto t = topology_from_env(env);
  EXPECT_EQ(t.master_addr, "10.0.0.1");
  EXPECT_EQ(t.master_port, 29400);
  EXPECT_EQ(t.num_nodes, 2);
}

TEST(SchedulerTopology, SlurmStepsGetTheirOwnPortAndTheFirstNodeAcrossNodes) {
  auto a = topology_from_env(slurm_step(1, "0")), b = topology_from_env(slurm_step(1, "1"));
  EXPECT_EQ(a.source, "slurm");
  EXPECT_EQ(a.local_world_size, 2);
  EXPECT_EQ(a.master_addr, "127.0.0.1");
  EXPECT_EQ(a.master_port, port_for_job("slurm:c1:2.0"));
  EXPECT_EQ(b.master_port, port_for_job("slurm:c1:2.1"));
  EXPECT_NE(a.master_port, b.master_port);
  auto multi = topology_from_env(slurm_step(3, "0", "gpu[007-009,012]", 2));
  EXPECT_EQ(multi.node_rank, 1);
  EXPECT_EQ(multi.num_nodes, 2);
  EXPECT_EQ(multi.master_addr, "gpu007");
  // srun -n 2 inside an allocation of 4 tasks: the step's count wins.
  auto env = slurm_step(0, "0");
  env.set("SLURM_NTASKS", "4");
  EXPECT_EQ(topology_from_env(env).world_size, 2);
  // Uneven layout: node 0 runs 1 task, node 1 runs 2 ("1,2"); rank 2 is node 1's second task.
  auto uneven = slurm_step(2, "0", "n[1-2]", 2);
  uneven.set("SLURM_STEP_NUM_TASKS", "3");
  uneven.set("SLURM_STEP_TASKS_PER_NODE", "1,2");
  uneven.set("SLURM_NODEID", "1");
  uneven.set("SLURM_LOCALID", "1");
  auto u = topology_from_env(uneven);
  EXPECT_EQ(u.local_world_size, 2);
  EXPECT_EQ(u.local_rank, 1);
  EXPECT_EQ(u.node_rank, 1);
  // The sbatch script itself looks like rank 0 of the job's tasks, but has no step: one process.
  auto batch = Env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
                    {"SLURM_JOB_ID", "5"}});
  EXPECT_EQ(topology_from_env(batch).world_size, 1);
  EXPECT_EQ(topology_from_env(batch).source, "none");
}

TEST(SchedulerTopology, TheInnermostStarterWins) {
  // mpirun inside `srun --pty bash`: the ranks inherit the shell's step variables (rank 0 of 1).
  auto env = openmpi_one_node(1);
  for (auto [k, v] : std::map<std::string, std::string>{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"},
                                                        {"SLURM_NTASKS", "1"}, {"SLURM_STEP_ID", "0"}, {"SLURM_JOB_ID", "9"}})
    env.set(k, v);
  auto t = topology_from_env(env);
  EXPECT_EQ(t.source, "openmpi");
  EXPECT_EQ(t.world_size, 2);
  EXPECT_EQ(t.rank, 1);
}

TEST(SchedulerTopology, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("vm"), "vm");
  EXPECT_EQ(first_slurm_host("node[07-09,12],gpu3"), "node07");
  EXPECT_EQ(first_slurm_host("a1,a2"), "a1");
  EXPECT_EQ(first_slurm_host("rack[2-3]-n[01-04],x"), "rack2-n01");
}

TEST(SchedulerTopology, PortsStayInTheirRangeAndDependOnTheWholeId) {
  for (auto id : {"", "slurm:1.0", "slurm:1.1", "OMPI_MCA_ess_base_jobid:42"}) {
    int p = port_for_job(id);
    EXPECT_GE(p, 20000) << id;
    EXPECT_LT(p, 30000) << id;
  }
  EXPECT_EQ(scheduler_job_id(Env({{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "3"}, {"SLURM_CLUSTER_NAME", "a"}}), "slurm"),
            "slurm:a:7.3");
  // Two clusters' job 1 step 0 are different jobs.
  EXPECT_NE(scheduler_job_id(Env({{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_ID", "0"}, {"SLURM_CLUSTER_NAME", "a"}}), "slurm"),
            scheduler_job_id(Env({{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_ID", "0"}, {"SLURM_CLUSTER_NAME", "b"}}), "slurm"));
  EXPECT_FALSE(scheduler_job_id(Env({{"SLURM_JOB_ID", "7"}}), "torchrun"));
  // torchrun's run id names the job (xlr8 advise gives each candidate's launch its own); "none" names none.
  EXPECT_EQ(scheduler_job_id(Env({{"TORCHELASTIC_RUN_ID", "advise-3"}}), "torchrun"), "torchelastic:advise-3");
  EXPECT_FALSE(scheduler_job_id(Env({{"TORCHELASTIC_RUN_ID", "none"}}), "torchrun"));
}

TEST(SchedulerTopology, NodesFromTheHostsSeenAtRendezvous) {
  // Four ranks placed round-robin over two hosts (mpirun --map-by node): no formula from the local
  // rank and size gives the node, the hosts do.
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<std::string> hosts{"b", "a", "b", "a"};
  for (int r = 0; r < 4; ++r)
    store->set("xlr8/rdzv/rank/" + std::to_string(r), std::vector<uint8_t>(hosts[r].begin(), hosts[r].end()));
  Topology t;
  t.world_size = 4;
  t.local_world_size = 2;
  t.source = "openmpi";
  for (int r = 0; r < 4; ++r) {
    t.rank = r;
    xlr8::distributed::place_nodes_by_host(store, t);
    EXPECT_EQ(t.num_nodes, 2);
    EXPECT_EQ(t.node_rank, r % 2) << "rank " << r;  // host b holds rank 0, so it is node 0
  }
  t.local_world_size = 3;  // the environment disagrees with what the ranks reported
  EXPECT_THROW(xlr8::distributed::place_nodes_by_host(store, t), Error);
}
