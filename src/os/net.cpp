#include "os/net.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "xlr8/error.hpp"

namespace xlr8::os {

namespace {

// The first IPv4 address of `host` (a name or a dotted quad), or false.
bool resolve(const std::string& host, in_addr& out) {
  if (inet_pton(AF_INET, host.c_str(), &out) == 1) return true;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || !found) return false;
  out = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
  freeaddrinfo(found);
  return true;
}

sockaddr_in socket_address(const in_addr& address, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = address;
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

}  // namespace

HostPort parse_host_port(const std::string& text, int default_port, const std::string& flag) {
  HostPort out{.host = text, .port = default_port};
  if (const size_t colon = text.rfind(':'); colon != std::string::npos) {
    out.host = text.substr(0, colon);
    const std::string port = text.substr(colon + 1);
    const bool digits = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
    out.port = digits ? std::stoi(port) : -1;
    if (out.port < 1 || out.port > 65535)
      throw ConfigError(fmt::format("{} {:?}: {:?} is not a TCP port (give host:port, port 1-65535)", flag, text, port));
  }
  if (out.host.empty()) throw ConfigError(fmt::format("{} {:?} names no host (give host[:port])", flag, text));
  return out;
}

JsonLines& JsonLines::operator=(JsonLines&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    buffer_ = std::move(other.buffer_);
    other.fd_ = -1;
  }
  return *this;
}

JsonLines::~JsonLines() { close(); }

void JsonLines::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool JsonLines::send(const nlohmann::json& message) {
  if (fd_ < 0) return false;
  const std::string line = message.dump() + "\n";
  size_t sent = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (sent < line.size()) {
    const ssize_t n = ::send(fd_, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLOUT, 0};
      poll(&p, 1, 100);
      continue;
    }
    close();
    return false;
  }
  return true;
}

bool JsonLines::receive(std::vector<nlohmann::json>& out, std::string& why) {
  if (fd_ < 0) return false;
  char chunk[4096];
  for (;;) {
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n > 0) {
      buffer_.append(chunk, static_cast<size_t>(n));
      if (buffer_.size() > (1u << 20)) {
        why = "a message longer than 1 MiB";
        close();
        return false;
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    why = n == 0 ? "connection closed" : fmt::format("connection lost: {}", std::strerror(errno));
    close();
    break;
  }
  size_t start = 0;
  for (size_t end; (end = buffer_.find('\n', start)) != std::string::npos; start = end + 1) {
    auto message = nlohmann::json::parse(buffer_.begin() + static_cast<std::ptrdiff_t>(start),
                                         buffer_.begin() + static_cast<std::ptrdiff_t>(end), nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
      why = fmt::format("not xlr8's rendezvous protocol (received {:?})", buffer_.substr(start, std::min<size_t>(end - start, 60)));
      close();
      return false;
    }
    out.push_back(std::move(message));
  }
  buffer_.erase(0, start);
  return fd_ >= 0;
}

int connect_tcp(const HostPort& to, double timeout_s, std::string& why) {
  in_addr address{};
  if (!resolve(to.host, address)) {
    why = fmt::format("cannot resolve {:?}", to.host);
    return -1;
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    why = std::strerror(errno);
    return -1;
  }
  const sockaddr_in a = socket_address(address, to.port);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    why = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  const int ready = poll(&p, 1, static_cast<int>(timeout_s * 1000));
  int error = 0;
  socklen_t len = sizeof(error);
  if (ready <= 0) error = ETIMEDOUT;
  else getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
  if (error != 0) {
    why = std::strerror(error);
    ::close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int listen_tcp(const HostPort& on, int& errno_out) {
  in_addr address{};
  if (!resolve(on.host, address)) {
    errno_out = EADDRNOTAVAIL;
    return -1;
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    errno_out = errno;
    return -1;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in a = socket_address(address, on.port);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    errno_out = errno;
    ::close(fd);
    return -1;
  }
  // The address is this machine's: listen on every interface instead.
  ::close(fd);
  const int any = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (any < 0) {
    errno_out = errno;
    return -1;
  }
  setsockopt(any, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  in_addr everywhere{};
  everywhere.s_addr = htonl(INADDR_ANY);
  const sockaddr_in b = socket_address(everywhere, on.port);
  if (bind(any, reinterpret_cast<const sockaddr*>(&b), sizeof(b)) != 0 || listen(any, 64) != 0) {
    errno_out = errno;
    ::close(any);
    return -1;
  }
  return any;
}

std::string local_address_toward(const std::string& host) {
  in_addr address{};
  if (!resolve(host, address)) return "";
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  // A datagram socket's connect only picks the route and the source address.
  const sockaddr_in a = socket_address(address, 9);
  std::string out;
  sockaddr_in mine{};
  socklen_t len = sizeof(mine);
  char text[INET_ADDRSTRLEN] = {};
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0 &&
      inet_ntop(AF_INET, &mine.sin_addr, text, sizeof(text)))
    out = text;
  ::close(fd);
  return out;
}

std::string first_routable_address() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string found;
  char text[INET_ADDRSTRLEN] = {};
  for (ifaddrs* i = all; i && found.empty(); i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK) &&
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text)))
      found = text;
  freeifaddrs(all);
  return found;
}

std::string interface_with_address(const std::string& address) {
  in_addr wanted{};
  if (inet_pton(AF_INET, address.c_str(), &wanted) != 1) return "";
  if ((ntohl(wanted.s_addr) >> 24) == 127) return "";
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string name;
  for (ifaddrs* i = all; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == wanted.s_addr) {
      name = i->ifa_name;
      break;
    }
  freeifaddrs(all);
  return name;
}

const std::string& host_name() {
  static const std::string name = [] {
    char buffer[256] = {};
    if (::gethostname(buffer, sizeof(buffer) - 1) != 0 || buffer[0] == '\0') return std::string("unknown-host");
    return std::string(buffer);
  }();
  return name;
}

}  // namespace xlr8::os
