#pragma once
// A real etcd cluster for rendezvous tests: `members` etcd servers (Debian's etcd-server), each on loopback
// ports of its own, or each inside one simulated host (netns_hosts.hpp) on its address. Data directories are
// scratch; every member is killed and its directory removed by the destructor.
#include <memory>
#include <string>
#include <vector>

#include "netns_hosts.hpp"
#include "process_runner.hpp"

class EtcdCluster {
 public:
  // Why a cluster cannot start here (no etcd binary), or "".
  static std::string unavailable();
  // Member i on host i of `hosts` (at its address, ports 2379/2380), or on 127.0.0.1 when hosts is null.
  // Returns once every member answers and a leader is elected (throws after 30 s).
  explicit EtcdCluster(int members, const NetnsHosts* hosts = nullptr);
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  std::string endpoint(int member) const;  // host:port of its client URL
  std::string endpoints() const;           // all, comma-separated (--rdzv_endpoint)
  // The member that leads now (asked of the live members), or -1.
  int leader() const;
  void kill(int member);

 private:
  std::vector<std::string> etcdctl(const std::vector<std::string>& args, int member) const;
  const NetnsHosts* hosts_;
  std::string dir_;
  std::vector<std::string> client_, peer_;
  std::vector<std::unique_ptr<Process>> members_;
};
