#include "launch/rendezvous_server.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/log.hpp"
#include "os/net.hpp"
#include "xlr8/error.hpp"

namespace xlr8::launcher {

// Named (not anonymous): RendezvousServer::Impl holds them.
namespace rendezvous_state {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

enum class Phase { kConnected, kWaiting, kRunning, kDone };

struct Agent {
  os::JsonLines line;
  std::string node = "?", addr;
  int nproc = 0, port = 0;
  Phase phase = Phase::kConnected;
  int64_t order = 0;        // when it joined: the first round ranks machines in this order
  int prev_rank = INT_MAX;  // its node rank in the last round it ran: later rounds keep the order
  bool told_restart = false;
  Clock::time_point last_heard = Clock::now();
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace rendezvous_state

using namespace rendezvous_state;

struct RendezvousServer::Impl {
  ElasticOptions o;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  std::thread thread;
  std::atomic<bool> stop{false};
  mutable std::mutex mutex;  // guards the state below against settled()
  std::map<int, Agent> agents;
  int next_id = 0;
  int64_t next_order = 0;
  int round = 0;
  bool finished = false;   // every member of the last round finished or left after one finished
  bool finishing = false;  // a member finished: nobody starts a new round (torchrun closes on success)
  std::optional<Clock::time_point> last_call;

  ~Impl() {
    for (int fd : {listen_fd, wake[0], wake[1]})
      if (fd >= 0) ::close(fd);
  }

  std::string where() const { return fmt::format("{}:{}", o.endpoint_host, o.endpoint_port); }
  size_t count(Phase phase) const {
    return static_cast<size_t>(std::count_if(agents.begin(), agents.end(), [&](auto& a) { return a.second.phase == phase; }));
  }

  void serve() {
    while (!stop) {
      std::vector<pollfd> fds{{listen_fd, POLLIN, 0}, {wake[0], POLLIN, 0}};
      std::vector<int> ids;
      {
        std::lock_guard lock(mutex);
        for (auto& [id, a] : agents) fds.push_back({a.line.fd(), POLLIN, 0}), ids.push_back(id);
      }
      poll(fds.data(), fds.size(), 100);
      if (stop) return;
      std::lock_guard lock(mutex);
      if (fds[0].revents & POLLIN)
        for (int fd; (fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;)
          agents[next_id++].line = os::JsonLines(fd);
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const int id = ids[i - 2];
        std::vector<json> messages;
        std::string why;
        const bool open = agents.at(id).line.receive(messages, why);
        for (auto& m : messages)
          if (agents.count(id)) {
            try {
              handle(id, m);
            } catch (const std::exception& e) {  // a field of another type: another program or version
              refuse(id, fmt::format("malformed request ({})", e.what()));
            }
          }
        if (!open && agents.count(id)) drop(id, why);
      }
      const double silence = o.keep_alive_interval_s * o.keep_alive_max_attempt;
      for (auto it = agents.begin(); it != agents.end();) {
        const int id = (it++)->first;  // drop() erases
        if (!agents.at(id).line.open())  // a send to it failed
          drop(id, "could not be written to (connection lost)");
        else if (seconds(Clock::now() - agents.at(id).last_heard) > silence)
          drop(id, fmt::format("sent nothing for {:.0f} s (keep_alive_interval {} s x keep_alive_max_attempt {})",
                               silence, o.keep_alive_interval_s, o.keep_alive_max_attempt));
      }
      try_complete();
    }
  }

  void refuse(int id, const std::string& message) {
    agents.at(id).line.send(json{{"op", "error"}, {"message", message}});
    drop(id, fmt::format("was refused: {}", message));
  }

  void handle(int id, const json& m) {
    Agent& a = agents.at(id);
    a.last_heard = Clock::now();
    const std::string op = m.value("op", "");
    if (op == "heartbeat") {
      a.line.send(json{{"op", "heartbeat"}});
    } else if (op == "join") {
      if (m.value("run_id", "") != o.run_id)
        return refuse(id, fmt::format("the rendezvous at {} belongs to --rdzv_id {:?}, not {:?}; give every machine of "
                                      "one job the same --rdzv_id, and other jobs another endpoint",
                                      where(), o.run_id, m.value("run_id", "")));
      if (m.value("min", 0) != o.min_nodes || m.value("max", 0) != o.max_nodes)
        return refuse(id, fmt::format("--nnodes {}:{} on this machine, but the rendezvous at {} was started with "
                                      "--nnodes {}:{}; give every machine the same --nnodes",
                                      m.value("min", 0), m.value("max", 0), where(), o.min_nodes, o.max_nodes));
      a.node = m.value("node", "?");
      a.addr = m.value("addr", "");
      a.nproc = m.value("nproc", 1);
      a.port = m.value("port", 0);
      const bool was_running = a.phase == Phase::kRunning;
      a.phase = Phase::kWaiting;
      a.order = next_order++;
      a.told_restart = false;
      if (finished || finishing) {
        a.line.send(json{{"op", "finished"}});
        return;
      }
      if (was_running) {
        restart_round(fmt::format("machine {} restarts its workers: {}", a.node, m.value("reason", "")),
                      m.value("kind", "failure"));
      } else if (const size_t running = count(Phase::kRunning); running > 0) {
        if (running < static_cast<size_t>(o.max_nodes))
          restart_round(fmt::format("machine {} is waiting to join", a.node), "scale");
        else
          a.line.send(json{{"op", "waiting"},
                           {"why", fmt::format("the job runs on --nnodes max {} machines; this one is admitted "
                                               "when one of them leaves",
                                               o.max_nodes)}});
      }
    } else if (op == "done") {
      a.phase = Phase::kDone;
      finishing = true;
      for (auto& [other, w] : agents)
        if (w.phase == Phase::kWaiting) w.line.send(json{{"op", "finished"}}), w.phase = Phase::kConnected;
      settle_finished();
    } else if (op == "leave") {
      drop(id, fmt::format("machine {} left: {}", a.node, m.value("reason", "")));
    } else {
      refuse(id, fmt::format("unknown request {:?}: is this agent another version of xlr8?", op));
    }
  }

  // A member of the running round is gone (closed, silent or left): the others must restart without it.
  void drop(int id, const std::string& why) {
    Agent& a = agents.at(id);
    const Phase phase = a.phase;
    const std::string who = a.node;
    agents.erase(id);
    if (phase == Phase::kRunning) {
      const std::string reason = why.rfind("machine ", 0) == 0 ? why : fmt::format("machine {} {}", who, why);
      log::warning("xlr8 launch: rendezvous: {}", reason);
      restart_round(reason, "failure");
    }
    settle_finished();
  }

  void restart_round(const std::string& reason, const std::string& kind) {
    for (auto& [id, a] : agents)
      if (a.phase == Phase::kRunning && !a.told_restart) {
        a.told_restart = true;
        a.line.send(json{{"op", "restart"}, {"round", round}, {"reason", reason}, {"kind", kind}});
      }
  }

  // A member finished and none runs any more: the job is done; waiting machines are told so.
  void settle_finished() {
    if (finished || !finishing || count(Phase::kRunning) > 0) return;
    finished = true;
    for (auto& [id, a] : agents)
      if (a.phase == Phase::kWaiting) a.line.send(json{{"op", "finished"}}), a.phase = Phase::kConnected;
  }

  void try_complete() {
    if (finished || finishing || count(Phase::kRunning) > 0) return;  // a round is still on, or the job ends
    std::vector<Agent*> waiting;
    for (auto& [id, a] : agents)
      if (a.phase == Phase::kWaiting) waiting.push_back(&a);
    if (waiting.size() < static_cast<size_t>(o.min_nodes)) {
      last_call.reset();
      return;
    }
    // A first round waits last_call_timeout for more machines once enough joined; a restart goes at once
    // with every machine that is back (the others are admitted at the next one).
    const bool go = waiting.size() >= static_cast<size_t>(o.max_nodes) || round > 0 || (last_call && Clock::now() >= *last_call);
    if (!go) {
      if (!last_call) last_call = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.last_call_timeout_s * 1000));
      return;
    }
    std::sort(waiting.begin(), waiting.end(),
              [](Agent* x, Agent* y) { return std::tie(x->prev_rank, x->order) < std::tie(y->prev_rank, y->order); });
    for (size_t i = static_cast<size_t>(o.max_nodes); i < waiting.size(); ++i)
      waiting[i]->line.send(json{{"op", "waiting"},
                                 {"why", fmt::format("the job runs on --nnodes max {} machines; this one is admitted "
                                                     "when one of them leaves",
                                                     o.max_nodes)}});
    waiting.resize(std::min(waiting.size(), static_cast<size_t>(o.max_nodes)));
    ++round;
    last_call.reset();
    int world = 0;
    std::vector<std::string> names;
    for (Agent* a : waiting) world += a->nproc, names.push_back(a->node);
    int offset = 0;
    for (size_t i = 0; i < waiting.size(); ++i) {
      Agent& a = *waiting[i];
      a.phase = Phase::kRunning;
      a.prev_rank = static_cast<int>(i);
      a.told_restart = false;
      a.line.send(json{{"op", "assigned"},
                       {"round", round},
                       {"node_rank", i},
                       {"num_nodes", waiting.size()},
                       {"world_size", world},
                       {"rank_offset", offset},
                       {"master_addr", waiting[0]->addr},
                       {"master_port", waiting[0]->port},
                       {"nodes", names}});
      offset += a.nproc;
    }
    log::info("xlr8 launch: rendezvous round {}: {} machine(s), {} ranks: {}", round, waiting.size(), world,
              fmt::join(names, ", "));
  }
};

std::unique_ptr<RendezvousServer> RendezvousServer::host(const ElasticOptions& options) {
  int error = 0;
  const int fd = os::listen_tcp({.host = options.endpoint_host, .port = options.endpoint_port}, error);
  if (fd < 0) {
    if (error == EADDRNOTAVAIL || error == EADDRINUSE) return nullptr;
    throw Error(fmt::format("cannot serve the rendezvous on {}:{}: {}", options.endpoint_host, options.endpoint_port,
                            std::strerror(error)));
  }
  auto impl = std::make_unique<Impl>();
  impl->o = options;
  impl->listen_fd = fd;
  if (pipe2(impl->wake, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(fmt::format("pipe failed: {}", std::strerror(errno)));
  impl->thread = std::thread([p = impl.get()] { p->serve(); });
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(impl)));
}

RendezvousServer::RendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RendezvousServer::~RendezvousServer() {
  impl_->stop = true;
  [[maybe_unused]] auto ignored = ::write(impl_->wake[1], "x", 1);
  impl_->thread.join();
}

bool RendezvousServer::settled() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->count(Phase::kRunning) == 0 && impl_->count(Phase::kWaiting) == 0;
}

bool RendezvousServer::members_running() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->count(Phase::kRunning) > 0;
}

}  // namespace xlr8::launcher
