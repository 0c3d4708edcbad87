#pragma once
// An agent's side of the elastic rendezvous (launch/rendezvous_server.hpp): joins, waits for its place,
// keeps the connection alive from a thread of its own, and hears when the running round must restart.
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "launch/rendezvous.hpp"

namespace xlr8::launcher {

class RendezvousClient final : public Rendezvous {
 public:
  // Connects, retrying until join_timeout (the hosting machine may start later); `cancelled` is asked
  // between tries. Throws Error when it cannot, or was cancelled.
  RendezvousClient(const ElasticOptions& options, const std::function<bool()>& cancelled);
  ~RendezvousClient() override;
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  const std::string& node() const;  // this machine as the others see it: "host (address, pid N)"
  const std::string& address() const;

  void join(int nproc, int port, const std::string& reason, const std::string& kind) override;
  std::optional<RendezvousAssignment> wait(const std::function<bool()>& cancelled) override;
  std::string restart_request() const override;
  std::string restart_kind() const override;
  void done() override;
  void leave(const std::string& reason) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xlr8::launcher
