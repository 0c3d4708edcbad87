#pragma once
// The elastic rendezvous, served by the `xlr8 launch` of the machine that owns --rdzv_endpoint (as torchrun's
// c10d backend serves its store from one agent). It forms rounds of machines and tells each its place;
// while a round runs it asks its members to restart when one leaves (a failure, a lost machine) or when a
// new machine waits to join. Protocol (one JSON object per line), agent -> server: join, heartbeat, done,
// leave; server -> agent: assigned, waiting, restart, finished, error, heartbeat.
#include <memory>

#include "xlr8/launcher.hpp"

namespace xlr8::launcher {

class RendezvousServer {
 public:
  // Listens on the endpoint and serves from a thread of its own. nullptr when the endpoint's address is
  // not this machine's, or another process here already serves it; throws Error for other failures.
  static std::unique_ptr<RendezvousServer> host(const ElasticOptions& options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  // True when no machine is running a round or waiting for one (every member finished or left).
  bool settled() const;
  // Some machine's workers are running a round (the others need this server to finish, or to restart).
  bool members_running() const;

  struct Impl;

 private:
  explicit RendezvousServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace xlr8::launcher
