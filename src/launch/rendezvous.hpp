#pragma once
// What an elastic agent (launch/elastic_agent.cpp) asks of a rendezvous, whichever backend keeps it:
// c10d (one machine's `xlr8 launch` serves it: launch/rendezvous_client.hpp) or etcd (a replicated store:
// launch/etcd_rendezvous.hpp).
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/launcher.hpp"

namespace xlr8::launcher {

struct RendezvousAssignment {
  int round = 0, node_rank = 0, num_nodes = 1, world_size = 1, rank_offset = 0;
  std::string master_addr;
  int master_port = 0;
  std::vector<std::string> nodes;  // every machine of the round, by node rank
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Asks for a place in the next round (`port`: the workers' master port if this machine becomes node 0;
  // `reason`/`kind` ("start", "failure" or "scale"): why this machine (re)starts, told to the others).
  virtual void join(int nproc, int port, const std::string& reason, const std::string& kind) = 0;
  // Waits for the round: its assignment, or nullopt when the job already finished (or `cancelled` said so).
  // Throws Error on a refusal, a lost rendezvous, or no round within join_timeout.
  virtual std::optional<RendezvousAssignment> wait(const std::function<bool()>& cancelled) = 0;
  // While a round runs: why it must restart ("" while it need not), and the kind of that restart.
  virtual std::string restart_request() const = 0;
  virtual std::string restart_kind() const = 0;
  virtual void done() = 0;
  virtual void leave(const std::string& reason) = 0;
};

// This machine as the others see it ("host (address, pid N)") and its address toward `peer_host` (a routable
// one when the job may span machines and the route says loopback).
struct ThisMachine {
  std::string node, address;
};
ThisMachine this_machine(const std::string& peer_host, int max_nodes);

}  // namespace xlr8::launcher
