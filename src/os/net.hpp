#pragma once
// TCP for the elastic rendezvous (launch/rendezvous_*.cpp): one JSON object per line, and the addresses
// a machine uses toward another. IPv4 only.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace xlr8::os {

// "host[:port]" (port default_port when absent); throws ConfigError naming `flag` when malformed.
struct HostPort {
  std::string host;
  int port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};
HostPort parse_host_port(const std::string& text, int default_port, const std::string& flag);

// A connected socket (non-blocking) exchanging newline-terminated JSON objects. Owns the descriptor.
class JsonLines {
 public:
  explicit JsonLines(int fd = -1) : fd_(fd) {}
  JsonLines(JsonLines&& other) noexcept : fd_(other.fd_), buffer_(std::move(other.buffer_)) { other.fd_ = -1; }
  JsonLines& operator=(JsonLines&& other) noexcept;
  JsonLines(const JsonLines&) = delete;
  JsonLines& operator=(const JsonLines&) = delete;
  ~JsonLines();
  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }
  void close();
  // False when the peer is gone (the socket is then closed). A full send buffer waits up to 2 s.
  bool send(const nlohmann::json& message);
  // Reads what has arrived; complete messages go to `out`. False at end of stream, on an error or on a
  // line that is not JSON (the socket is then closed; `why` says which).
  bool receive(std::vector<nlohmann::json>& out, std::string& why);

 private:
  int fd_ = -1;
  std::string buffer_;
};

// Connects within timeout_s; -1 with `why` set when it cannot.
int connect_tcp(const HostPort& to, double timeout_s, std::string& why);
// Listens on host:port, on every interface once host is known to be this machine's (so a name that resolves
// to loopback here is still reachable from the others); -1 with errno_out set (EADDRNOTAVAIL: not this
// machine's address; EADDRINUSE: taken).
int listen_tcp(const HostPort& on, int& errno_out);
// This machine's IPv4 address on the route to `host` (its own address when `host` is one of them), or "".
// Nothing is sent.
std::string local_address_toward(const std::string& host);
// The first IPv4 address of this machine that is not loopback, or "".
std::string first_routable_address();
// The network interface holding `address`, or "" (also for a loopback address).
std::string interface_with_address(const std::string& address);
// This machine's name (gethostname, read once), or "unknown-host" when it has none.
const std::string& host_name();

}  // namespace xlr8::os
