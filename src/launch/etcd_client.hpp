#pragma once
// etcd's v3 API through its JSON gateway (POST /v3/kv/..., /v3/lease/... on the client port), which every
// etcd 3.x member serves: no gRPC or protobuf code to carry, and any member answers (followers forward
// writes to the leader). Requests go to one endpoint until it fails, then to the next: a member lost
// costs one timeout, not the job. Thread-safe: requests are serialised.
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "os/net.hpp"

namespace xlr8::launcher {

struct EtcdKeyValue {
  std::string key, value;
  int64_t mod_revision = 0;
};

class EtcdClient {
 public:
  // `timeout_s` bounds each request to one member.
  EtcdClient(std::vector<os::HostPort> endpoints, double timeout_s);

  // nullopt when the key does not exist. Every call throws Error naming each endpoint's failure when no
  // member answers.
  std::optional<EtcdKeyValue> get(const std::string& key);
  std::vector<EtcdKeyValue> get_prefix(const std::string& prefix);
  // Writes `value` if the key's mod revision is still `expected` (0: if the key does not exist); false when
  // another writer came first.
  bool compare_and_put(const std::string& key, const std::string& value, int64_t expected);
  // Writes `value` bound to `lease` (the key goes when the lease expires); false when the lease is gone.
  bool put_with_lease(const std::string& key, const std::string& value, int64_t lease);
  int64_t grant_lease(int64_t ttl_s);
  // False when the lease expired (or was revoked): whatever it held is gone.
  bool keep_alive(int64_t lease);
  void revoke(int64_t lease);

  std::string endpoints() const;  // "host:port, host:port" as given

 private:
  // The JSON answer of the first member to answer `path`; an etcd error other than "not found" throws.
  nlohmann::json call(const std::string& path, const nlohmann::json& body, bool* not_found = nullptr);
  std::vector<os::HostPort> endpoints_;
  double timeout_s_;
  mutable std::mutex mutex_;
  size_t current_ = 0;
};

std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text);

}  // namespace xlr8::launcher
