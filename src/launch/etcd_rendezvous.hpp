#pragma once
// `--rdzv_backend etcd`: the elastic rendezvous kept in an etcd cluster, so no machine of the job serves it
// and any of them, the first included, can die while the others re-form. The rounds document
// (launch/rendezvous_rounds.hpp) lives under <key_prefix>/<rdzv_id>/state and is changed by compare-and-swap
// by whichever agent sees a change to make; each agent holds a lease (TTL keep_alive_interval x
// keep_alive_max_attempt) and a key under .../alive/ bound to it, so a machine that dies or is cut off is
// dropped by the others when its lease expires, without anyone's clock being trusted.
#include <functional>
#include <memory>

#include "launch/rendezvous.hpp"

namespace xlr8::launcher {

// One request to one member: --rdzv_conf read_timeout, or (0) 3 s or a third of the lease's life when shorter.
double etcd_request_timeout_s(const ElasticOptions& options);

// Registers this machine with etcd, retrying until join_timeout (then one TimeoutError naming the members
// tried and why each failed).
std::unique_ptr<Rendezvous> make_etcd_rendezvous(const ElasticOptions& options, const std::function<bool()>& cancelled);

}  // namespace xlr8::launcher
