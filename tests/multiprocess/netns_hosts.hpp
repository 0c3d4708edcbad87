#pragma once
// Simulated machines for multi-host tests: each host a Linux network namespace with its own address in a
// private /24, the hosts joined by veth links to one bridge (in a namespace of its own). Nothing can
// leave this machine: the namespaces have no default route, and while the hosts exist the root namespace
// has an `unreachable` route for their /24 (it has a default route out). Everything is removed by the
// destructor, and namespaces left by a test process that died are removed by the next one.
#include <string>
#include <vector>

class NetnsHosts {
 public:
  // Why hosts cannot be made here (not root, no `ip netns`), or "" when they can.
  static std::string unavailable();
  explicit NetnsHosts(int count);
  ~NetnsHosts();
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  const std::string& address(int host) const { return addresses_.at(host); }
  // `command` run inside host `host`'s namespace.
  std::vector<std::string> on(int host, const std::vector<std::string>& command) const;
  // A crash as the others see it: the host's link goes down first, so no connection is closed cleanly.
  void link(int host, bool up) const;
  // Every process inside the host, SIGKILLed.
  void kill_all(int host) const;

 private:
  void remove();
  std::string prefix_, subnet_;
  std::vector<std::string> names_, addresses_;
};
