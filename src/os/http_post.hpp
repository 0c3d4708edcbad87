#pragma once
// A minimal HTTP/1.1 client for JSON services on the local network (etcd's v3 JSON gateway): one POST per
// connection, plain HTTP (no TLS), bodies by Content-Length or chunked. Every step has a deadline.
#include <string>

#include "os/net.hpp"

namespace xlr8::os {

struct HttpResponse {
  int status = 0;    // 0: no answer (`error` says why: refused, timed out, malformed)
  std::string body;  // the body, de-chunked
  std::string error;
};

// POSTs `body` (application/json) to http://to/path and reads the whole answer within timeout_s.
HttpResponse http_post(const HostPort& to, const std::string& path, const std::string& body, double timeout_s);

}  // namespace xlr8::os
