#include "launch/elastic_agent.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <limits>
#include <thread>

#include "core/log.hpp"
#include "launch/etcd_rendezvous.hpp"
#include "launch/rendezvous_client.hpp"
#include "launch/rendezvous_server.hpp"
#include "launch/supervisor.hpp"
#include "os/shm_segment.hpp"
#include "xlr8/error.hpp"

namespace xlr8::launcher {

namespace {

std::string restarts_left(int used, int max_restarts) {
  return max_restarts == std::numeric_limits<int>::max() ? fmt::format("restart {}, no limit", used)
                                                          : fmt::format("restart {} of {}", used, max_restarts);
}

// The machine that serves the rendezvous stays while another machine's workers run (they need it to
// finish, and to restart if one of them fails), and up to close_timeout for machines still waiting.
void keep_serving(RendezvousServer* server, const ElasticOptions& e, const std::function<bool()>& cancelled) {
  if (!server) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(e.close_timeout_s * 1000));
  bool said = false;
  while ((server->members_running() || (!server->settled() && std::chrono::steady_clock::now() < deadline)) &&
         !cancelled()) {
    if (!said) log::info("xlr8 launch: serving the rendezvous until the other machines finish"), said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// No place in a round: the job finished on the other machines.
LaunchOutcome finished_elsewhere(int failed_with, int attempt) {
  if (failed_with) {
    log::warning("xlr8 launch: the job finished on the other machines after this machine's workers failed");
    return {.exit_code = failed_with, .restarts = attempt};
  }
  log::info("xlr8 launch: the job finished on the other machines; nothing to do here");
  return {.exit_code = 0, .restarts = attempt};
}

GroupPlacement place_of(const RendezvousAssignment& place) {
  return {.node_rank = place.node_rank,
          .num_nodes = place.num_nodes,
          .world_size = place.world_size,
          .rank_offset = place.rank_offset,
          .master_addr = place.master_addr,
          .master_port = place.master_port};
}

}  // namespace

LaunchOutcome launch_elastic(const LaunchOptions& o, const std::string& program) {
  const ElasticOptions& e = *o.elastic;
  // First: it blocks the signals the launcher handles, before the rendezvous threads start.
  auto group = WorkerGroup::create(o, program);
  int interrupted = 0;
  const std::function<bool()> cancelled = [&] {
    if (!interrupted) interrupted = group->wait_signal(0);
    return interrupted != 0;
  };
  // etcd keeps the rendezvous itself; c10d's is served by the machine that owns the endpoint.
  const bool etcd = e.backend == "etcd";
  auto server = etcd ? nullptr : RendezvousServer::host(e);
  if (server) log::info("xlr8 launch: serving the rendezvous for --rdzv_id {} on {}:{}", e.run_id, e.endpoint_host, e.endpoint_port);
  const std::unique_ptr<Rendezvous> rendezvous = etcd ? make_etcd_rendezvous(e, cancelled)
                                                      : std::make_unique<RendezvousClient>(e, cancelled);
  Rendezvous& client = *rendezvous;
  // Leaves the rendezvous for good: the job cannot go on with this machine.
  auto give_up = [&](const std::string& why, LaunchOutcome outcome) {
    client.leave(why);
    keep_serving(server.get(), e, cancelled);
    return outcome;
  };

  int charged = 0;  // restarts counted against max_restarts
  int failed_with = 0;  // this machine's last failure, reported if the job then ends elsewhere
  std::string reason = "first start", kind = "start";
  for (int attempt = 0;; ++attempt) {
    client.join(o.nproc_per_node, pick_free_port(), reason, kind);
    const auto place = client.wait(cancelled);
    if (interrupted) {
      client.leave(fmt::format("interrupted by signal {}", interrupted));
      return {.exit_code = 128 + interrupted, .restarts = attempt, .interrupted_by = interrupted};
    }
    if (!place) return finished_elsewhere(failed_with, attempt);
    log::info("xlr8 launch: round {}: this machine is node {} of {} (ranks {}-{} of {}), master {}:{}", place->round,
              place->node_rank, place->num_nodes, place->rank_offset, place->rank_offset + o.nproc_per_node - 1,
              place->world_size, place->master_addr, place->master_port);
    const int code = group->run_attempt(attempt, place_of(*place), [&] { return client.restart_request(); });
    os::remove_job_segments(std::to_string(::getpid()));
    if (group->interrupted_by()) {
      client.leave(fmt::format("interrupted by signal {}", group->interrupted_by()));
      return {.exit_code = code, .restarts = attempt, .interrupted_by = group->interrupted_by()};
    }
    if (!group->stopped_for().empty()) {  // the rendezvous asked for a new round
      reason = group->stopped_for();
      kind = client.restart_kind();
      if (kind == "scale") {
        log::info("xlr8 launch: starting a new round to admit a machine (not counted against --max_restarts)");
        continue;
      }
      if (charged >= o.max_restarts) {
        log::warning("xlr8 launch: the group must restart ({}) but --max_restarts {} is used up", reason, o.max_restarts);
        return give_up(fmt::format("its --max_restarts {} is used up", o.max_restarts), {.exit_code = 1, .restarts = attempt});
      }
      ++charged;
      log::warning("xlr8 launch: starting a new round ({})", restarts_left(charged, o.max_restarts));
      continue;
    }
    if (code == 0) {
      client.done();
      keep_serving(server.get(), e, cancelled);
      return {.exit_code = 0, .restarts = attempt};
    }
    group->report_failure();
    const auto failure = group->first_failure();
    reason = failure ? fmt::format("rank {} failed ({})", failure->rank, failure->how) : group->stalled();
    kind = "failure";
    failed_with = code;
    if (charged >= o.max_restarts)
      return give_up(fmt::format("its workers failed ({}) and --max_restarts {} is used up", reason, o.max_restarts),
                     {.exit_code = code, .restarts = attempt, .failure = failure, .stalled = group->stalled()});
    ++charged;
    log::warning("xlr8 launch: rejoining the rendezvous for a new round ({})", restarts_left(charged, o.max_restarts));
  }
}

}  // namespace xlr8::launcher
