#include "launch/rendezvous_client.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "core/log.hpp"
#include "os/net.hpp"
#include "xlr8/error.hpp"

namespace xlr8::launcher {

namespace {
using Clock = std::chrono::steady_clock;
using nlohmann::json;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

struct RendezvousClient::Impl {
  ElasticOptions o;
  os::HostPort endpoint;
  std::string node, address;
  std::mutex mutex;  // guards everything below, and sends
  std::condition_variable changed;
  os::JsonLines line;
  std::deque<json> replies;  // assigned, finished, error
  std::string lost;          // why the rendezvous is gone
  int round = 0;             // the round this machine was last assigned to
  std::string restart, restart_kind;
  Clock::time_point last_heard = Clock::now(), last_sent = Clock::now();
  std::atomic<bool> stop{false};
  std::thread thread;

  bool send(const json& m) {  // with the mutex held
    last_sent = Clock::now();
    return line.send(m);
  }

  void pump() {
    while (!stop) {
      pollfd p{line.fd(), POLLIN, 0};
      poll(&p, 1, 100);
      std::lock_guard lock(mutex);
      if (!lost.empty()) continue;
      std::vector<json> messages;
      std::string why;
      const bool open = line.receive(messages, why);
      for (auto& m : messages) {
        last_heard = Clock::now();
        const std::string op = m.value("op", "");
        if (op == "restart") {
          if (m.value("round", 0) == round && restart.empty()) {
            restart = m.value("reason", "the rendezvous asked for a restart");
            restart_kind = m.value("kind", "failure");
          }
        } else if (op == "waiting") {
          log::info("xlr8 launch: waiting: {}", m.value("why", ""));
        } else if (op != "heartbeat") {
          replies.push_back(std::move(m));
        }
      }
      const double silence = seconds_since(last_heard);
      if (!open) lost = why.empty() ? "connection closed" : why;
      else if (silence > o.keep_alive_interval_s * o.keep_alive_max_attempt)
        lost = fmt::format("it answered nothing for {:.0f} s", silence);
      else if (seconds_since(last_sent) >= o.keep_alive_interval_s && !send(json{{"op", "heartbeat"}}))
        lost = "connection lost";
      if (!lost.empty()) {
        line.close();
        changed.notify_all();
      }
      if (!messages.empty()) changed.notify_all();
    }
  }

  std::string lost_message() const {
    return fmt::format("lost the rendezvous at {} ({}): the machine that serves --rdzv_endpoint stopped or is "
                       "unreachable, and an elastic job cannot outlive it (as with torchrun's c10d backend)",
                       endpoint.str(), lost);
  }
};

RendezvousClient::RendezvousClient(const ElasticOptions& options, const std::function<bool()>& cancelled)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.o = options;
  s.endpoint = {.host = options.endpoint_host, .port = options.endpoint_port};
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(options.join_timeout_s * 1000));
  std::string why;
  int fd = -1;
  bool said = false;
  while ((fd = os::connect_tcp(s.endpoint, 2.0, why)) < 0) {
    if (Clock::now() >= deadline)
      throw TimeoutError(fmt::format("cannot reach the rendezvous at {} within join_timeout {} s: {}. Start `xlr8 launch` "
                                     "on the machine that owns that address (it serves the rendezvous), or check "
                                     "--rdzv_endpoint",
                                     s.endpoint.str(), options.join_timeout_s, why));
    if (!said) log::info("xlr8 launch: waiting for the rendezvous at {} ({})", s.endpoint.str(), why), said = true;
    for (int i = 0; i < 5; ++i) {
      if (cancelled()) throw Error("interrupted while waiting for the rendezvous");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  s.line = os::JsonLines(fd);
  s.last_heard = s.last_sent = Clock::now();  // silence counts from the connection, not from the first try
  const ThisMachine me = this_machine(options.endpoint_host, options.max_nodes);
  s.node = me.node;
  s.address = me.address;
  s.thread = std::thread([p = impl_.get()] { p->pump(); });
}

RendezvousClient::~RendezvousClient() {
  impl_->stop = true;
  impl_->thread.join();
}

ThisMachine this_machine(const std::string& peer_host, int max_nodes) {
  std::string address = os::local_address_toward(peer_host);
  // A host name that resolves to loopback here (Debian's 127.0.1.1) is no address for the other machines.
  if (max_nodes > 1 && address.rfind("127.", 0) == 0)
    if (auto routable = os::first_routable_address(); !routable.empty()) address = routable;
  return {.node = fmt::format("{} ({}, pid {})", os::host_name(), address, ::getpid()), .address = address};
}

const std::string& RendezvousClient::node() const { return impl_->node; }
const std::string& RendezvousClient::address() const { return impl_->address; }

void RendezvousClient::join(int nproc, int port, const std::string& reason, const std::string& kind) {
  auto& s = *impl_;
  std::lock_guard lock(s.mutex);
  if (!s.lost.empty()) throw Error(s.lost_message());
  s.restart.clear();
  s.send(json{{"op", "join"},
              {"run_id", s.o.run_id},
              {"min", s.o.min_nodes},
              {"max", s.o.max_nodes},
              {"node", s.node},
              {"addr", s.address},
              {"nproc", nproc},
              {"port", port},
              {"reason", reason},
              {"kind", kind}});
}

std::optional<RendezvousAssignment> RendezvousClient::wait(const std::function<bool()>& cancelled) {
  auto& s = *impl_;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(s.o.join_timeout_s * 1000));
  std::unique_lock lock(s.mutex);
  for (;;) {
    if (!s.replies.empty()) {
      json m = std::move(s.replies.front());
      s.replies.pop_front();
      const std::string op = m.value("op", "");
      if (op == "finished") return std::nullopt;
      if (op == "error") throw ConfigError(fmt::format("the rendezvous at {} refused this machine: {}", s.endpoint.str(),
                                                       m.value("message", "")));
      if (op != "assigned") continue;
      RendezvousAssignment a{.round = m.at("round"),
                             .node_rank = m.at("node_rank"),
                             .num_nodes = m.at("num_nodes"),
                             .world_size = m.at("world_size"),
                             .rank_offset = m.at("rank_offset"),
                             .master_addr = m.at("master_addr"),
                             .master_port = m.at("master_port"),
                             .nodes = m.at("nodes").get<std::vector<std::string>>()};
      s.round = a.round;
      s.restart.clear();
      return a;
    }
    if (!s.lost.empty()) throw Error(s.lost_message());
    if (Clock::now() >= deadline)
      throw TimeoutError(fmt::format("no group of at least {} machine(s) (--nnodes {}:{}) formed at the rendezvous {} "
                                     "within join_timeout {} s; start the missing machines' `xlr8 launch`, or lower "
                                     "--nnodes' minimum",
                                     s.o.min_nodes, s.o.min_nodes, s.o.max_nodes, s.endpoint.str(), s.o.join_timeout_s));
    s.changed.wait_for(lock, std::chrono::milliseconds(100));
    lock.unlock();
    const bool stop = cancelled();
    lock.lock();
    if (stop) return std::nullopt;
  }
}

std::string RendezvousClient::restart_request() const {
  std::lock_guard lock(impl_->mutex);
  // A lost rendezvous is a lost machine: its workers are gone, these would wait for them until a timeout.
  return !impl_->restart.empty() || impl_->lost.empty() ? impl_->restart : impl_->lost_message();
}

std::string RendezvousClient::restart_kind() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->restart.empty() && !impl_->lost.empty() ? "failure" : impl_->restart_kind;
}

void RendezvousClient::done() {
  std::lock_guard lock(impl_->mutex);
  impl_->send(json{{"op", "done"}});
}

void RendezvousClient::leave(const std::string& reason) {
  std::lock_guard lock(impl_->mutex);
  impl_->send(json{{"op", "leave"}, {"reason", reason}});
}

}  // namespace xlr8::launcher
