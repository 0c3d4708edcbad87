#include "launch/etcd_client.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>

#include <nlohmann/json.hpp>

#include "os/http_post.hpp"
#include "xlr8/error.hpp"

namespace xlr8::launcher {

using nlohmann::json;

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The gateway writes 64-bit numbers as strings, and leaves out fields at their zero value.
int64_t number(const json& object, const char* field) {
  if (!object.is_object() || !object.contains(field)) return 0;
  const json& v = object.at(field);
  if (v.is_number_integer()) return v.get<int64_t>();
  return v.is_string() ? std::strtoll(v.get<std::string>().c_str(), nullptr, 10) : 0;
}

std::vector<EtcdKeyValue> key_values(const json& answer) {
  std::vector<EtcdKeyValue> out;
  if (!answer.is_object() || !answer.contains("kvs") || !answer["kvs"].is_array()) return out;
  for (const json& kv : answer["kvs"])
    if (kv.is_object())
      out.push_back({.key = base64_decode(kv.value("key", "")),
                     .value = base64_decode(kv.value("value", "")),
                     .mod_revision = number(kv, "mod_revision")});
  return out;
}

// The key just past every key that starts with `prefix` (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty() && static_cast<unsigned char>(prefix.back()) == 0xff) prefix.pop_back();
  if (prefix.empty()) return std::string(1, '\0');
  prefix.back() = static_cast<char>(prefix.back() + 1);
  return prefix;
}

}  // namespace

std::string base64_encode(const std::string& bytes) {
  std::string out;
  uint32_t bits = 0;
  int held = 0;
  for (unsigned char c : bytes) {
    bits = (bits << 8) | c, held += 8;
    while (held >= 6) out += kAlphabet[(bits >> (held -= 6)) & 63];
  }
  if (held > 0) out += kAlphabet[(bits << (6 - held)) & 63];
  while (out.size() % 4) out += '=';
  return out;
}

std::string base64_decode(const std::string& text) {
  std::string out;
  uint32_t bits = 0;
  int held = 0;
  for (char c : text) {
    const char* at = std::strchr(kAlphabet, c);
    if (c == '=' || !at || c == '\0') break;
    bits = (bits << 6) | static_cast<uint32_t>(at - kAlphabet), held += 6;
    if (held >= 8) out += static_cast<char>((bits >> (held -= 8)) & 0xff);
  }
  return out;
}

EtcdClient::EtcdClient(std::vector<os::HostPort> endpoints, double timeout_s)
    : endpoints_(std::move(endpoints)), timeout_s_(timeout_s) {
  if (endpoints_.empty()) throw ConfigError("--rdzv_endpoint names no etcd member (give host:port[,host:port...])");
}

std::string EtcdClient::endpoints() const {
  std::vector<std::string> names;
  for (const auto& e : endpoints_) names.push_back(e.str());
  return fmt::format("{}", fmt::join(names, ", "));
}

json EtcdClient::call(const std::string& path, const json& body, bool* not_found) {
  std::lock_guard lock(mutex_);
  std::vector<std::string> failures;
  for (size_t tried = 0; tried < endpoints_.size(); ++tried, current_ = (current_ + 1) % endpoints_.size()) {
    const os::HostPort& to = endpoints_[current_];
    const os::HttpResponse r = os::http_post(to, path, body.dump(), timeout_s_);
    json answer = r.status ? json::parse(r.body, nullptr, /*allow_exceptions=*/false) : json();
    if (r.status == 200 && answer.is_object()) return answer;
    std::string message = r.status ? r.body : r.error;
    int code = -1;
    if (answer.is_object()) {
      // Unary calls answer {"code", "message"}; streaming ones (keepalive) {"error": {"grpc_code", "message"}}.
      const json& e = answer.contains("error") && answer["error"].is_object() ? answer["error"] : answer;
      message = e.value("message", message);
      code = e.value("code", e.value("grpc_code", -1));
    }
    // gRPC's NOT_FOUND (5): a lease that expired; an answer, not a failing member.
    if (not_found && code == 5) return *not_found = true, json::object();
    // INVALID_ARGUMENT and the like are this program's fault: another member would say the same.
    if (r.status == 400 || code == 3) throw Error(fmt::format("etcd at {} refused {}: {}", to.str(), path, message));
    if (r.status == 200) message = fmt::format("answered something that is not etcd's JSON ({} bytes)", r.body.size());
    failures.push_back(fmt::format("{}: {}", to.str(), r.status ? fmt::format("HTTP {} {}", r.status, message) : message));
  }
  throw Error(fmt::format("no etcd member answered ({})", fmt::join(failures, "; ")));
}

std::optional<EtcdKeyValue> EtcdClient::get(const std::string& key) {
  auto found = key_values(call("/v3/kv/range", json{{"key", base64_encode(key)}}));
  if (found.empty()) return std::nullopt;
  return found.front();
}

std::vector<EtcdKeyValue> EtcdClient::get_prefix(const std::string& prefix) {
  return key_values(call("/v3/kv/range", json{{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}}));
}

bool EtcdClient::compare_and_put(const std::string& key, const std::string& value, int64_t expected) {
  const std::string k = base64_encode(key);
  const json compare = expected == 0
      ? json{{"key", k}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}}
      : json{{"key", k}, {"target", "MOD"}, {"result", "EQUAL"}, {"mod_revision", std::to_string(expected)}};
  const json request{{"compare", json::array({compare})},
                     {"success", json::array({json{{"requestPut", {{"key", k}, {"value", base64_encode(value)}}}}})}};
  return call("/v3/kv/txn", request).value("succeeded", false);
}

bool EtcdClient::put_with_lease(const std::string& key, const std::string& value, int64_t lease) {
  bool gone = false;
  call("/v3/kv/put", json{{"key", base64_encode(key)}, {"value", base64_encode(value)}, {"lease", std::to_string(lease)}},
       &gone);
  return !gone;
}

int64_t EtcdClient::grant_lease(int64_t ttl_s) {
  return number(call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_s)}}), "ID");
}

bool EtcdClient::keep_alive(int64_t lease) {
  bool gone = false;
  const json answer = call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}, &gone);
  // An expired lease is answered without a TTL.
  return !gone && number(answer.value("result", json::object()), "TTL") > 0;
}

void EtcdClient::revoke(int64_t lease) {
  bool gone = false;
  call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}, &gone);
}

}  // namespace xlr8::launcher
