#pragma once
// An agent's side of the elastic rendezvous (launch/rendezvous_server.hpp): joins, waits for its place,
// keeps the connection alive from a thread of its own, and hears when the running round must restart.
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

class RendezvousClient {
 public:
  // Connects, retrying until join_timeout (the hosting machine may start later); `cancelled` is asked
  // between tries. Throws Error when it cannot, or was cancelled.
  RendezvousClient(const ElasticOptions& options, const std::function<bool()>& cancelled);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  const std::string& node() const;  // this machine as the others see it: "host (address, pid N)"
  const std::string& address() const;

  // Asks for a place in the next round (`port`: the workers' master port if this machine becomes node 0;
  // `reason`/`kind` ("failure" or "scale"): why this machine restarts, told to the others).
  void join(int nproc, int port, const std::string& reason, const std::string& kind);
  // Waits for the round: its assignment, or nullopt when the job already finished (or `cancelled` said so).
  // Throws Error on a refusal, a lost rendezvous, or no round within join_timeout.
  std::optional<RendezvousAssignment> wait(const std::function<bool()>& cancelled);
  // While a round runs: why it must restart ("" while it need not), and the kind of that restart.
  std::string restart_request() const;
  std::string restart_kind() const;
  void done();
  void leave(const std::string& reason);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xlr8::launcher
