#include "etcd_cluster.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "xlr8/launcher.hpp"

std::string EtcdCluster::unavailable() {
  if (run({"sh", "-c", "command -v etcd && command -v etcdctl"}, 10).exit_code != 0)
    return "etcd is not installed (Debian's etcd-server and etcd-client; scripts/setup installs them)";
  return "";
}

EtcdCluster::EtcdCluster(int members, const NetnsHosts* hosts) : hosts_(hosts), dir_(temp_dir("etcd")) {
  std::vector<std::string> initial;
  for (int i = 0; i < members; ++i) {
    const std::string host = hosts ? hosts->address(i) : "127.0.0.1";
    client_.push_back(fmt::format("{}:{}", host, hosts ? 2379 : xlr8::pick_free_port()));
    peer_.push_back(fmt::format("{}:{}", host, hosts ? 2380 : xlr8::pick_free_port()));
    initial.push_back(fmt::format("m{}=http://{}", i, peer_.back()));
  }
  for (int i = 0; i < members; ++i) {
    std::vector<std::string> command{"etcd",
                                     "--name", fmt::format("m{}", i),
                                     "--data-dir", fmt::format("{}/m{}", dir_, i),
                                     "--listen-client-urls", "http://" + client_[i],
                                     "--advertise-client-urls", "http://" + client_[i],
                                     "--listen-peer-urls", "http://" + peer_[i],
                                     "--initial-advertise-peer-urls", "http://" + peer_[i],
                                     "--initial-cluster", fmt::format("{}", fmt::join(initial, ",")),
                                     "--initial-cluster-token", fmt::format("xlr8-test-{}", ::getpid()),
                                     "--initial-cluster-state", "new"};
    members_.push_back(std::make_unique<Process>(hosts ? hosts->on(i, command) : command));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (leader() < 0) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(fmt::format("the etcd cluster did not elect a leader within 30 s: {}",
                                           members_[0]->err_so_far()));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

EtcdCluster::~EtcdCluster() {
  for (size_t i = 0; i < members_.size(); ++i) kill(static_cast<int>(i));
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string EtcdCluster::endpoint(int member) const { return client_.at(member); }

std::string EtcdCluster::endpoints() const { return fmt::format("{}", fmt::join(client_, ",")); }

std::vector<std::string> EtcdCluster::etcdctl(const std::vector<std::string>& args, int member) const {
  std::vector<std::string> command{"env", "ETCDCTL_API=3", "etcdctl", "--dial-timeout=1s", "--command-timeout=2s",
                                   "--endpoints=" + client_[member]};
  command.insert(command.end(), args.begin(), args.end());
  return hosts_ ? hosts_->on(member, command) : command;
}

int EtcdCluster::leader() const {
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!members_[i]) continue;
    auto r = run(etcdctl({"endpoint", "status", "-w", "json"}, static_cast<int>(i)), 10);
    const auto status = nlohmann::json::parse(r.out, nullptr, false);
    if (r.exit_code != 0 || !status.is_array() || status.empty()) return -1;
    const auto& s = status[0]["Status"];
    if (s.value("leader", 0ull) == 0) return -1;
    if (s["header"].value("member_id", 0ull) == s.value("leader", 0ull)) return static_cast<int>(i);
  }
  return -1;
}

void EtcdCluster::kill(int member) {
  auto& p = members_.at(member);
  if (!p) return;
  p->signal(SIGKILL);
  p->wait(10);
  p.reset();
}
