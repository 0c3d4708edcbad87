// Where this process sits, from what its starter set: torchrun / `xlr8 launch`, Slurm, OpenMPI,
// MVAPICH or PMI. Each scheduler names things differently, and some leave out what we need (OpenMPI
// has no node index; Slurm and mpirun set no MASTER_ADDR/MASTER_PORT), so the gaps are derived here
// identically on every rank of one job.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "core/text.hpp"
#include "xlr8/error.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {
namespace {

struct Source {
  const char* name;
  std::initializer_list<const char*> rank;
  std::initializer_list<const char*> size;
  std::initializer_list<const char*> local_rank;
  std::initializer_list<const char*> local_size;
  std::initializer_list<const char*> node_rank;
  std::initializer_list<const char*> num_nodes;
  std::initializer_list<const char*> task_marker;  // one must be set, when listed
};

// Checked in this order; the first whose size (and rank) variables are set wins: the innermost starter
// first, since a job's processes inherit the variables of whatever started its starter (mpirun run
// inside `srun --pty bash` still sees that shell's SLURM_PROCID=0 and SLURM_STEP_NUM_TASKS=1).
// OMPI_COMM_WORLD_NODE_RANK is not a node index: it is the rank among the processes on this node
// (OpenMPI's mpirun(1), "ENVIRONMENT VARIABLES"), so OpenMPI gives no node index at all.
// SLURM_STEP_NUM_TASKS comes first: a job step started by srun sets it, while SLURM_NTASKS is the whole
// allocation's task count (srun -n 2 inside an allocation of 4). Only srun's tasks have a step id: an
// sbatch script itself also has SLURM_PROCID=0 and SLURM_NTASKS=2, and a program it runs without srun is
// one process, not rank 0 of 2.
const Source kSources[] = {
    {"torchrun", {"RANK"}, {"WORLD_SIZE"}, {"LOCAL_RANK"}, {"LOCAL_WORLD_SIZE"}, {"NODE_RANK", "GROUP_RANK"}, {}, {}},
    {"openmpi", {"OMPI_COMM_WORLD_RANK"}, {"OMPI_COMM_WORLD_SIZE"}, {"OMPI_COMM_WORLD_LOCAL_RANK"},
     {"OMPI_COMM_WORLD_LOCAL_SIZE"}, {}, {"OMPI_MCA_orte_num_nodes"}, {}},
    {"mvapich", {"MV2_COMM_WORLD_RANK"}, {"MV2_COMM_WORLD_SIZE"}, {"MV2_COMM_WORLD_LOCAL_RANK"},
     {"MV2_COMM_WORLD_LOCAL_SIZE"}, {}, {}, {}},
    {"pmi", {"PMI_RANK"}, {"PMI_SIZE"}, {"MPI_LOCALRANKID", "PALS_LOCAL_RANKID"}, {"MPI_LOCALNRANKS"}, {}, {}, {}},
    {"slurm", {"SLURM_PROCID"}, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, {"SLURM_LOCALID"}, {},
     {"SLURM_NODEID"}, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"}, {"SLURM_STEP_ID", "SLURM_STEPID"}},
};

bool has_any(const Env& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (env.has(n)) return true;
  return false;
}

// Slurm's task counts per node read "2", "2(x3)" or "3,2(x2)" (node 0 runs 3, nodes 1 and 2 run 2 each):
// the count of node `node`.
std::optional<long> tasks_on_node(const Env& env, const char* name, long node) {
  auto v = env.get(name);
  if (!v || v->empty()) return std::nullopt;
  for (const auto& part : text::split(*v, ',')) {
    size_t used = 0;
    long count = 0, repeat = 1;
    try {
      count = std::stol(part, &used);
      if (used < part.size() && part.compare(used, 2, "(x") == 0) repeat = std::stol(part.substr(used + 2));
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (node < repeat) return count;
    node -= repeat;
  }
  return std::nullopt;
}

// FNV-1a: stable across processes, compilers and runs (std::hash is not).
uint64_t stable_hash(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

bool node_index_from_hosts(const Topology& topology) {
  for (const auto& s : kSources)
    if (topology.source == s.name) return s.node_rank.size() == 0;
  return false;
}

std::string first_slurm_host(const std::string& nodelist) {
  // "node[07-09,12],gpu3" -> "node07", "rack[1-2]-n[01-04]" -> "rack1-n01": the first entry, and in each
  // bracket the first number as written (zero padding included).
  std::string host;
  for (size_t i = 0; i < nodelist.size() && nodelist[i] != ','; ++i) {
    if (nodelist[i] != '[') {
      host += nodelist[i];
      continue;
    }
    for (++i; i < nodelist.size() && std::isdigit(static_cast<unsigned char>(nodelist[i])); ++i) host += nodelist[i];
    i = nodelist.find(']', i);
    if (i == std::string::npos) break;
  }
  return host;
}

std::optional<std::string> scheduler_job_id(const Env& env, const std::string& source) {
  if (source == "slurm") {
    auto job = env.get("SLURM_JOB_ID");
    if (!job) job = env.get("SLURM_JOBID");
    if (!job) return std::nullopt;
    // The cluster's name too: two clusters (or two test clusters on one machine) both have a job 1.
    return "slurm:" + env.get("SLURM_CLUSTER_NAME").value_or("") + ":" + *job + "." +
           env.get("SLURM_STEP_ID").value_or(env.get("SLURM_STEPID").value_or("0"));
  }
  if (source == "torchrun") {  // torchrun's --rdzv_id, xlr8 launch's run id; "none" is the unnamed default
    if (auto id = env.get("TORCHELASTIC_RUN_ID"); id && !id->empty() && *id != "none") return "torchelastic:" + *id;
  }
  if (source == "openmpi" || source == "pmi" || source == "mvapich") {
    for (const char* name : {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID", "MPIRUN_ID"})
      if (auto v = env.get(name); v && !v->empty()) return std::string(name) + ":" + *v;
  }
  return std::nullopt;
}

int port_for_job(const std::string& job_id) {
  // 20000-29999: below Linux's ephemeral range (32768+), where a client socket could hold it.
  return 20000 + static_cast<int>(stable_hash(job_id) % 10000);
}

Topology topology_from_env(const Env& env) {
  Topology t;
  const Source* src = nullptr;
  for (const auto& s : kSources)
    if (has_any(env, s.size) && (has_any(env, s.rank) || (std::string(s.name) == "torchrun" && env.has("LOCAL_RANK"))) &&
        (s.task_marker.size() == 0 || has_any(env, s.task_marker))) {
      src = &s;
      break;
    }
  if (!src) return t;
  t.source = src->name;
  auto size_var = *std::find_if(src->size.begin(), src->size.end(), [&](const char* n) { return env.has(n); });
  t.world_size = static_cast<int>(env.get_positive(size_var, 1));
  t.rank = static_cast<int>(env.first_int(src->rank).value_or(env.get_int("LOCAL_RANK").value_or(0)));
  auto local_size = env.first_int(src->local_size);
  if (!local_size && t.source == "slurm") {
    long node = env.get_int("SLURM_NODEID").value_or(0);
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})
      if ((local_size = tasks_on_node(env, name, node))) break;
  }
  auto num_nodes = env.first_int(src->num_nodes);
  if (!local_size) local_size = num_nodes ? t.world_size / std::max(1L, *num_nodes) : t.world_size;
  t.local_world_size = static_cast<int>(std::max(1L, *local_size));
  t.local_rank = static_cast<int>(env.first_int(src->local_rank).value_or(t.rank % t.local_world_size));
  t.num_nodes = static_cast<int>(num_nodes.value_or((t.world_size + t.local_world_size - 1) / t.local_world_size));
  // Without a node index (OpenMPI, PMI), this one holds for ranks placed by slot; ProcessState replaces it
  // with the exact one from the hosts every rank reports at rendezvous.
  t.node_rank = static_cast<int>(
      env.first_int(src->node_rank).value_or(std::min(t.rank / t.local_world_size, std::max(0, t.num_nodes - 1))));

  auto bad = [&](const std::string& why) {
    return ConfigError(fmt::format("inconsistent {} environment: {} (rank={}, world_size={}, local_rank={}, "
                                   "local_world_size={}, node_rank={}, num_nodes={})",
                                   t.source, why, t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank,
                                   t.num_nodes));
  };
  if (t.rank < 0 || t.rank >= t.world_size)
    throw bad(fmt::format("{} must be in [0, {})", *src->rank.begin(), t.world_size));
  if (t.local_rank < 0 || t.local_rank >= t.local_world_size) throw bad("local rank must be below the local world size");
  if (t.node_rank < 0 || t.node_rank >= t.num_nodes) throw bad("node rank must be below the number of nodes");

  // Rendezvous: MASTER_ADDR/MASTER_PORT when set. A scheduler's job that sets neither gets a port derived
  // from its job id (the same on every rank, different for every job and job step) and, on one node,
  // loopback; across Slurm nodes, the first node of the step.
  auto job = scheduler_job_id(env, t.source);
  t.job_id = job.value_or("");
  t.master_port = static_cast<int>(env.get_int("MASTER_PORT").value_or(job ? port_for_job(*job) : 29500));
  if (t.master_port < 1 || t.master_port > 65535)
    throw ConfigError(fmt::format("MASTER_PORT={} is not a TCP port (1-65535)", t.master_port));
  if (auto addr = env.get("MASTER_ADDR"); addr && !addr->empty()) {
    t.master_addr = *addr;
  } else if (t.num_nodes > 1) {
    auto nodelist = t.source == "slurm" ? env.get("SLURM_STEP_NODELIST") : std::nullopt;
    if (!nodelist && t.source == "slurm") nodelist = env.get("SLURM_JOB_NODELIST");
    if (nodelist && !nodelist->empty()) {
      t.master_addr = first_slurm_host(*nodelist);
    } else {
      throw ConfigError(fmt::format(
          "MASTER_ADDR is not set but the job spans {} nodes ({} environment); set MASTER_ADDR to the host of rank 0 "
          "(with mpirun: -x MASTER_ADDR=<host> -x MASTER_PORT=<port>)",
          t.num_nodes, t.source));
    }
  }
  return t;
}

}  // namespace xlr8
