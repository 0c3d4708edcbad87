#include "xlr8/process_state.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <thread>

#include "core/error_file.hpp"
#include "core/flight_recorder.hpp"
#include "core/log.hpp"
#include "distributed/comm_state.hpp"
#include "distributed/rendezvous.hpp"
#include "os/cpu_affinity.hpp"
#include "os/memory.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {
namespace {

std::mutex g_mutex;
std::unique_ptr<ProcessState> g_state;

std::chrono::milliseconds seconds_from(const Env& env, const char* name, long fallback) {
  long v = env.get_int(name).value_or(fallback);
  if (v <= 0) throw ConfigError(fmt::format("{}={} must be a positive number of seconds", name, v));
  return std::chrono::seconds(v);
}

// A training step allocates and frees the same large temporaries (gradients, optimizer
// intermediates) every iteration. glibc serves blocks above its mmap threshold with fresh mmaps, so
// each step page-faults and zeroes tens of MB again: on the bench MLP that is ~30% of the step.
// Keeping blocks up to 128 MB in the heap, and not trimming it, makes the step reuse warm pages.
// XLR8_MALLOC_TUNING=0 leaves glibc's defaults (so does a non-glibc C library).
bool tune_allocator(const Env& env) {
#if defined(__GLIBC__)
  if (!env.get_bool("XLR8_MALLOC_TUNING").value_or(true)) return false;
  return os::keep_freed_blocks_up_to(128 << 20, 256 << 20);
#else
  (void)env;
  return false;
#endif
}

}  // namespace

std::unique_ptr<ProcessState> ProcessState::create(const Env& env, const ProcessStateOptions& options) {
  std::unique_ptr<ProcessState> s(new ProcessState());
  s->topology_ = topology_from_env(env);
  s->settings_ = settings_from_env(env);
  s->allocator_tuned_ = tune_allocator(env);
  log::set_rank(s->topology_.rank, s->topology_.world_size);
  const auto& t = s->topology_;

  // Device and backend, as Accelerate detects them: CUDA with NCCL when present, else CPU with Gloo.
  int gpus = s->settings_.use_cpu ? 0 : compat::cuda_device_count();
  bool gpu = gpus > 0 && compat::kHaveNccl;
  s->device_ = gpu ? fmt::format("cuda:{}", t.local_rank % gpus) : "cpu";
  s->backend_ = gpu ? "nccl" : "gloo";
  if (gpu) compat::set_cuda_device(t.local_rank % gpus);
  s->distributed_type_ = s->settings_.distributed_type(t.distributed(), gpu);

  // Before any thread of ours starts, so they all inherit it (earlier ones are bound too).
  std::vector<int> bound_cpus;
  if (s->settings_.cpu_affinity) {
    bound_cpus = os::cpus_for_local_rank(os::allowed_cpus(), t.local_rank, t.local_world_size);
    os::bind_process_to(bound_cpus);
  }

  // Intra-op threads: cores / local ranks (or the bound CPUs), unless OMP_NUM_THREADS says otherwise
  // (no oversubscription).
  if (auto omp = env.get_int("OMP_NUM_THREADS"); omp && *omp > 0) {
    s->threads_ = static_cast<int>(*omp);
  } else if (!bound_cpus.empty()) {
    s->threads_ = static_cast<int>(bound_cpus.size());
  } else {
    int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    s->threads_ = std::max(1, cores / std::max(1, t.local_world_size));
  }
  at::set_num_threads(s->threads_);

  auto rdzv_timeout = options.rendezvous_timeout.value_or(seconds_from(env, "XLR8_RDZV_TIMEOUT", 300));
  auto coll_timeout = options.collective_timeout.value_or(seconds_from(env, "XLR8_COLLECTIVE_TIMEOUT", 1800));
  compat::StorePtr store;
  if (t.distributed()) {
    // torchrun's agent serves the workers' store across restarts (TORCHELASTIC_USE_AGENT_STORE): each attempt its own
    // keys, as torch's env:// does. xlr8 launch's workers start a fresh store each attempt; their machines' restart
    // counts may differ (a machine that joins late starts at 0).
    const bool agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    store = distributed::rendezvous(t, rdzv_timeout, agent_store ? env.get_int("TORCHELASTIC_RESTART_COUNT").value_or(0) : 0);
    if (node_index_from_hosts(t)) distributed::place_nodes_by_host(store, s->topology_);
    store->setTimeout(coll_timeout);
  } else {
    store = c10::make_intrusive<c10d::HashStore>();  // one process: no network at all
  }
  auto world_store = c10::make_intrusive<c10d::PrefixStore>("xlr8/world", store);
  bool shared_memory = env.get_bool("XLR8_SHM").value_or(true);
  s->world_ = distributed::make_communicator(world_store, t.rank, t.world_size, "world", t.master_addr, coll_timeout, gpu,
                                        shared_memory);
  // Without parallelism_config every rank is a data-parallel replica.
  ParallelismSettings sizes = s->settings_.parallelism.value_or(ParallelismSettings{.dp_replicate = t.world_size});
  try {
    s->mesh_ = std::make_unique<DeviceMesh>(s->world_, MeshLayout::from(sizes, t.world_size));
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("parallelism_config (PARALLELISM_CONFIG_*_SIZE): {}", e.what()));
  }
  return s;
}

ProcessState::~ProcessState() = default;

const ProcessState& ProcessState::instance() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_state) {
    // A launched worker's uncaught exception reaches its launcher through the error file.
    core::install_error_file_handler();
    core::FlightRecorder::instance().install_signal_trigger();  // the launcher can ask for the trace
    g_state = create(Env::current());
  }
  return *g_state;
}

bool ProcessState::exists() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state != nullptr;
}

void configure_environment(const Settings& settings, const Topology& topology) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_state) {
      const auto& current = g_state->settings();
      if (current.distributed_type_name() != settings.distributed_type_name() ||
          current.mixed_precision != settings.mixed_precision || current.fsdp != settings.fsdp ||
          current.deepspeed != settings.deepspeed)
        throw Error(fmt::format(
            "configure_environment() was called after the ProcessState was created: the state already runs as {} "
            "with mixed_precision={}, and cannot switch to {} with mixed_precision={}. Call configure_environment() "
            "before anything creates the state (xlr8::Accelerator, ProcessState::instance()), as early as possible "
            "in the worker",
            to_string(g_state->distributed_type()), to_string(current.mixed_precision), settings.distributed_type_name(),
            to_string(settings.mixed_precision)));
      return;  // same settings: nothing to change
    }
  }
  // A strategy switched off must not linger from an earlier call.
  for (const char* flag : {"ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG",
                           "ACCELERATE_CPU_AFFINITY"})
    unsetenv(flag);
  for (const auto& vars : {topology_to_env(topology), settings_to_env(settings)})
    for (const auto& [name, value] : vars) setenv(name.c_str(), value.c_str(), 1);
}

}  // namespace xlr8
