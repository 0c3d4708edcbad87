#include "os/http_post.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace xlr8::os {

namespace {

using Clock = std::chrono::steady_clock;

int millis_left(Clock::time_point deadline) {
  return static_cast<int>(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
}

// Waits for `events` on fd until the deadline; false on timeout or error.
bool ready(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int n = poll(&p, 1, millis_left(deadline));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

bool send_all(int fd, const std::string& data, Clock::time_point deadline, std::string& why) {
  for (size_t sent = 0; sent < data.size();) {
    if (!ready(fd, POLLOUT, deadline)) return why = "timed out sending", false;
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) return why = std::strerror(errno), false;
    if (n > 0) sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads until the peer closes (the request said Connection: close).
bool receive_all(int fd, std::string& out, Clock::time_point deadline, std::string& why) {
  char buffer[16384];
  for (;;) {
    if (!ready(fd, POLLIN, deadline)) return why = "timed out waiting for the answer", false;
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return why = std::strerror(errno), false;
    if (n > 0) out.append(buffer, static_cast<size_t>(n));
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A chunked body's data; false when the chunks are malformed or cut short.
bool dechunk(const std::string& raw, std::string& out) {
  for (size_t at = 0;;) {
    const size_t eol = raw.find("\r\n", at);
    if (eol == std::string::npos) return false;
    char* end = nullptr;
    const unsigned long size = std::strtoul(raw.c_str() + at, &end, 16);
    if (end == raw.c_str() + at) return false;
    if (size == 0) return true;
    if (eol + 2 + size > raw.size()) return false;
    out.append(raw, eol + 2, size);
    at = eol + 2 + size + 2;
  }
}

HttpResponse parse(const std::string& raw) {
  HttpResponse r;
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos) {
    r.error = fmt::format("not an HTTP answer ({} bytes)", raw.size());
    return r;
  }
  r.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  const std::string head = lower(raw.substr(0, head_end));
  const std::string body = raw.substr(head_end + 4);
  if (head.find("transfer-encoding: chunked") != std::string::npos) {
    if (!dechunk(body, r.body)) r.status = 0, r.error = "a chunked answer cut short";
  } else if (const size_t at = head.find("content-length:"); at != std::string::npos &&
                                                              std::strtoull(head.c_str() + at + 15, nullptr, 10) > body.size()) {
    r.status = 0, r.error = "an answer cut short";
  } else {
    r.body = body;
  }
  return r;
}

}  // namespace

HttpResponse http_post(const HostPort& to, const std::string& path, const std::string& body, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  HttpResponse failed;
  // A member on the same network accepts at once (the kernel does); a silent one must not cost the whole timeout.
  const int fd = connect_tcp(to, std::min(timeout_s, 1.0), failed.error);
  if (fd < 0) return failed;
  const std::string request = fmt::format(
      "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
      path, to.str(), body.size(), body);
  std::string raw;
  const bool ok = send_all(fd, request, deadline, failed.error) && receive_all(fd, raw, deadline, failed.error);
  ::close(fd);
  return ok ? parse(raw) : failed;
}

}  // namespace xlr8::os
