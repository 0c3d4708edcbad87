#include "netns_hosts.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <sstream>
#include <stdexcept>

#include "process_runner.hpp"

namespace {

// Runs `ip ...`; throws with its output when it fails and `must` is set.
std::string ip(const std::vector<std::string>& args, bool must = true) {
  std::vector<std::string> command{"ip"};
  command.insert(command.end(), args.begin(), args.end());
  auto r = run(command, 20);
  if (must && r.exit_code != 0) {
    std::string line;
    for (auto& a : command) line += a + " ";
    throw std::runtime_error(fmt::format("`{}` failed: {}{}", line, r.out, r.err));
  }
  return r.exit_code == 0 ? r.out : "";
}

std::string interface(const std::string& prefix, const char* role, int host) {
  return fmt::format("{}{}{}", prefix, role, host);  // within IFNAMSIZ: "x" + pid + role + host
}

}  // namespace

std::string NetnsHosts::unavailable() {
  if (geteuid() != 0) return "creating network namespaces needs root (CI runs as root)";
  auto r = run({"ip", "netns", "list"}, 10);
  if (r.exit_code != 0) return "`ip netns` is not available here: " + r.err;
  const std::string probe = fmt::format("xlr8probe{}", getpid());
  auto made = run({"ip", "netns", "add", probe}, 10);
  if (made.exit_code != 0) return "this machine does not allow network namespaces: " + made.err;
  run({"ip", "netns", "del", probe}, 10);
  return "";
}

NetnsHosts::NetnsHosts(int count) {
  // Namespaces of earlier test processes that died before their clean-up: their pid is in the name.
  std::istringstream existing(ip({"netns", "list"}, false));
  for (std::string line; std::getline(existing, line);) {
    const std::string name = line.substr(0, line.find(' '));
    if (name.rfind("xlr8t", 0) != 0) continue;
    const int pid = std::atoi(name.c_str() + 5);
    if (pid <= 0 || pid == getpid() || process_alive(pid)) continue;
    std::istringstream left(ip({"netns", "pids", name}, false));  // its launchers would wait for their peers
    for (int p; left >> p;) ::kill(p, SIGKILL);
    ip({"netns", "del", name}, false);
  }
  prefix_ = fmt::format("x{}", getpid());
  // A /24 of 10.213.0.0/16 nobody here uses: its unreachable route is ours while it exists.
  for (int k = getpid() % 250;; k = (k + 1) % 250) {
    subnet_ = fmt::format("10.213.{}", k);
    if (run({"ip", "route", "add", "unreachable", subnet_ + ".0/24"}, 10).exit_code == 0) break;
    if (k == (getpid() + 249) % 250) throw std::runtime_error("no free /24 in 10.213.0.0/16 for the test hosts");
  }
  try {
    const std::string bridge_ns = fmt::format("xlr8t{}sw", getpid());
    names_.push_back(bridge_ns);
    ip({"netns", "add", bridge_ns});
    ip({"-n", bridge_ns, "link", "add", "br0", "type", "bridge"});
    ip({"-n", bridge_ns, "link", "set", "br0", "up"});
    for (int h = 0; h < count; ++h) {
      const std::string name = fmt::format("xlr8t{}h{}", getpid(), h);
      names_.push_back(name);
      addresses_.push_back(fmt::format("{}.{}", subnet_, h + 1));
      ip({"netns", "add", name});
      const std::string host_side = interface(prefix_, "h", h), switch_side = interface(prefix_, "s", h);
      ip({"link", "add", host_side, "netns", name, "type", "veth", "peer", "name", switch_side, "netns", bridge_ns});
      ip({"-n", bridge_ns, "link", "set", switch_side, "master", "br0"});
      ip({"-n", bridge_ns, "link", "set", switch_side, "up"});
      ip({"-n", name, "addr", "add", addresses_.back() + "/24", "dev", host_side});
      ip({"-n", name, "link", "set", host_side, "up"});
      ip({"-n", name, "link", "set", "lo", "up"});
    }
  } catch (...) {
    remove();
    throw;
  }
}

NetnsHosts::~NetnsHosts() { remove(); }

void NetnsHosts::remove() {
  for (int h = 0; h + 1 < static_cast<int>(names_.size()); ++h) kill_all(h);
  for (auto& name : names_) ip({"netns", "del", name}, false);  // takes the veth links with it
  names_.clear();
  if (!subnet_.empty()) ip({"route", "del", "unreachable", subnet_ + ".0/24"}, false);
  subnet_.clear();
}

std::vector<std::string> NetnsHosts::on(int host, const std::vector<std::string>& command) const {
  std::vector<std::string> out{"ip", "netns", "exec", names_.at(host + 1)};
  out.insert(out.end(), command.begin(), command.end());
  return out;
}

void NetnsHosts::link(int host, bool up) const {
  ip({"-n", names_.at(host + 1), "link", "set", interface(prefix_, "h", host), up ? "up" : "down"});
}

void NetnsHosts::kill_all(int host) const {
  std::istringstream pids(ip({"netns", "pids", names_.at(host + 1)}, false));
  for (int pid; pids >> pid;) ::kill(pid, SIGKILL);
}
