#include "launch/etcd_rendezvous.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/log.hpp"
#include "launch/etcd_client.hpp"
#include "launch/rendezvous_rounds.hpp"
#include "xlr8/error.hpp"

namespace xlr8::launcher {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::vector<os::HostPort> hosts_of(const ElasticOptions& o) {
  std::vector<os::HostPort> out;
  for (const auto& e : o.etcd_endpoints) out.push_back(os::parse_host_port(e, 2379, "--rdzv_endpoint"));
  return out;
}

class EtcdRendezvous final : public Rendezvous {
 public:
  EtcdRendezvous(const ElasticOptions& o, const std::function<bool()>& cancelled)
      : o_(o),
        etcd_(hosts_of(o), etcd_request_timeout_s(o)),
        prefix_(fmt::format("{}/{}/", o.etcd_key_prefix, o.run_id)),
        me_(this_machine(hosts_of(o).front().host, o.max_nodes)),
        ttl_s_(static_cast<int64_t>(std::ceil(o.keep_alive_interval_s * o.keep_alive_max_attempt))),
        cancelled_(cancelled) {
    register_machine(after(o.join_timeout_s));
    thread_ = std::thread([this] { watch(); });
  }

  ~EtcdRendezvous() override {
    stop_ = true;
    thread_.join();
    try {
      etcd_.revoke(lease());  // the others need not wait for the lease to expire
    } catch (const Error&) {
    }
  }

  void join(int nproc, int port, const std::string& reason, const std::string& kind) override {
    const auto deadline = after(o_.join_timeout_s);
    std::string lost;
    {
      std::lock_guard lock(mutex_);
      lost = lost_;
      restart_.clear();
      last_join_ = {.nproc = nproc, .port = port, .reason = reason, .kind = kind};
    }
    if (lost.empty() && !retrying(deadline, [&] { return etcd_.keep_alive(lease()); })) lost = "its etcd lease expired";
    // Cut off long enough for the others to drop it: this machine comes back as a new one, and its old self
    // leaves (a failure, as the c10d server counts a lost machine).
    std::string old_id;
    if (!lost.empty()) {
      log::warning("xlr8 launch: rejoining the etcd rendezvous ({})", lost);
      old_id = id();
      try {
        etcd_.revoke(lease());
      } catch (const Error&) {
      }
      register_machine(deadline);
    }
    const RoundMachine self{.id = id(), .node = me_.node, .addr = me_.address, .nproc = nproc, .port = port};
    std::string note;
    const RoundsState s = retrying(deadline, [&] {
      return update([&](RoundsState& state) {
        if (state.finishing) return false;
        if (!old_id.empty()) leave_rounds(state, old_id, lost);
        note = join_round(state, self, reason, kind);
        return true;
      });
    });
    std::lock_guard lock(mutex_);
    if (s.finishing && round_ == 0)
      log::warning("xlr8 launch: --rdzv_id {:?} already finished (etcd key {}state); give a new --rdzv_id to run "
                   "another job",
                   o_.run_id, prefix_);
    if (round_ == 0 && !waiting_)
      log::info("xlr8 launch: joined the etcd rendezvous of --rdzv_id {} at {} as {}", o_.run_id, etcd_.endpoints(), me_.node);
    if (!note.empty()) log::info("xlr8 launch: waiting: {}", note);
    if (lost_for_lease_ != lease_) lost_.clear();  // what was lost belonged to the lease this machine left
    latest_ = s;
    waiting_ = true;
  }

  std::optional<RendezvousAssignment> wait(const std::function<bool()>& cancelled) override {
    const auto deadline = after(o_.join_timeout_s);
    std::unique_lock lock(mutex_);
    for (;;) {
      if (!fatal_.empty()) throw ConfigError(fatal_);
      if (!lost_.empty()) {  // dropped while waiting: ask again, as a new machine
        const JoinRequest again = last_join_;
        lock.unlock();
        join(again.nproc, again.port, again.reason, again.kind);
        lock.lock();
        continue;
      }
      // Another round than the last one this machine ran (a document made anew starts again at 1).
      if (latest_ && latest_->round != round_)
        if (auto a = assignment_of(*latest_, id_)) {
          round_ = a->round;
          waiting_ = false;
          restart_.clear();
          return a;
        }
      if (latest_ && latest_->finishing) return std::nullopt;
      if (Clock::now() >= deadline)
        throw TimeoutError(fmt::format("no group of at least {} machine(s) (--nnodes {}:{}) formed at the etcd "
                                       "rendezvous ({}) within join_timeout {} s; start the missing machines' `xlr8 "
                                       "launch`, or lower --nnodes' minimum",
                                       o_.min_nodes, o_.min_nodes, o_.max_nodes, etcd_.endpoints(), o_.join_timeout_s));
      changed_.wait_for(lock, std::chrono::milliseconds(100));
      lock.unlock();
      const bool stop = cancelled();
      lock.lock();
      if (stop) return std::nullopt;
    }
  }

  std::string restart_request() const override {
    std::lock_guard lock(mutex_);
    if (!restart_.empty()) return restart_;
    const std::string& why = fatal_.empty() ? lost_ : fatal_;
    return why.empty() ? "" : fmt::format("lost the etcd rendezvous: {}", why);
  }

  std::string restart_kind() const override {
    std::lock_guard lock(mutex_);
    return restart_.empty() ? "failure" : restart_kind_;
  }

  // Retried through a short loss of etcd (an election, a member restarting): a finished job must say so.
  void done() override {
    retrying(after(o_.close_timeout_s), [&] { return update([&](RoundsState& s) { return finish_round(s, id()), true; }); });
  }

  void leave(const std::string& reason) override {
    try {
      update([&](RoundsState& s) {
        if (const std::string why = leave_rounds(s, id(), reason); !why.empty()) log::warning("xlr8 launch: {}", why);
        return true;
      });
    } catch (const Error& e) {  // etcd gone too: the lease's expiry tells the others
      log::warning("xlr8 launch: could not tell the etcd rendezvous that this machine leaves: {}", e.what());
    }
  }

 private:
  struct JoinRequest {
    int nproc = 1, port = 0;
    std::string reason, kind;
  };

  // `call` until it answers, through etcd errors (not refusals) until `deadline` or an interrupt.
  template <typename Call>
  auto retrying(Clock::time_point deadline, Call&& call) -> decltype(call()) {
    for (bool said = false;;) {
      try {
        return call();
      } catch (const ConfigError&) {
        throw;
      } catch (const Error& e) {
        if (Clock::now() >= deadline || cancelled_()) throw;
        if (!said) log::warning("xlr8 launch: etcd did not answer ({}); trying again", e.what()), said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  // A lease and this machine's key under alive/ (bound to it), retried until `deadline`.
  void register_machine(Clock::time_point deadline) {
    for (bool said = false;;) {
      std::string why;
      try {
        const int64_t lease = etcd_.grant_lease(ttl_s_);
        const std::string id = fmt::format("{:x}", lease);
        if (etcd_.put_with_lease(prefix_ + "alive/" + id, me_.node, lease)) {
          std::lock_guard lock(mutex_);
          lease_ = lease, id_ = id, last_answer_ = last_beat_ = Clock::now();
          return;
        }
        why = "the new lease expired before this machine's key was written";
      } catch (const ConfigError&) {
        throw;
      } catch (const Error& e) {
        why = e.what();
      }
      if (Clock::now() >= deadline)
        throw TimeoutError(fmt::format("cannot reach the etcd rendezvous at {} within join_timeout {} s ({}): start "
                                       "the etcd cluster, or check --rdzv_endpoint",
                                       etcd_.endpoints(), o_.join_timeout_s, why));
      if (!said) log::info("xlr8 launch: waiting for etcd at {} ({})", etcd_.endpoints(), why), said = true;
      for (int i = 0; i < 5; ++i) {
        if (cancelled_()) throw Error("interrupted while waiting for the etcd rendezvous");
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  }

  // Reads the rounds document, lets `change` edit it (true: it changed) and writes it back unless another
  // agent wrote first, then starts over. Returns the document as it now is.
  template <typename Change>
  RoundsState update(Change&& change) {
    const std::string key = prefix_ + "state";
    for (int attempt = 0;; ++attempt) {
      const auto kv = etcd_.get(key);
      RoundsState s{.min_nodes = o_.min_nodes, .max_nodes = o_.max_nodes};
      try {
        if (kv) s = RoundsState::from_json(json::parse(kv->value));
      } catch (const json::exception& e) {
        throw ConfigError(fmt::format("etcd key {} holds no xlr8 rendezvous ({}): another program uses it; give "
                                      "another --rdzv_id or key_prefix",
                                      key, e.what()));
      }
      if (s.min_nodes != o_.min_nodes || s.max_nodes != o_.max_nodes)
        throw ConfigError(fmt::format("--nnodes {}:{} on this machine, but the job --rdzv_id {:?} on etcd has --nnodes "
                                      "{}:{}; give every machine the same --nnodes (or, if etcd key {} is left from an "
                                      "earlier job, give this one a new --rdzv_id)",
                                      o_.min_nodes, o_.max_nodes, o_.run_id, s.min_nodes, s.max_nodes, key));
      if (!change(s)) return s;
      if (etcd_.compare_and_put(key, s.to_json().dump(), kv ? kv->mod_revision : 0)) return s;
      if (attempt == 1000) throw Error(fmt::format("the etcd rendezvous key {} changes faster than it can be written", key));
    }
  }

  // Drops machines whose lease expired and, while this machine waits, forms the round when it can.
  RoundsState refresh() {
    bool waiting = false;
    {
      std::lock_guard lock(mutex_);
      waiting = waiting_;
    }
    bool formed = false;
    const RoundsState now = update([&](RoundsState& s) {
      formed = false;
      std::vector<std::string> alive;
      for (const auto& kv : etcd_.get_prefix(prefix_ + "alive/")) alive.push_back(kv.key.substr(prefix_.size() + 6));
      bool changed = false;
      if (const std::string why = drop_vanished(s, alive, static_cast<double>(ttl_s_)); !why.empty())
        log::warning("xlr8 launch: rendezvous: {}", why), changed = true;
      if (!waiting || !can_form_round(s)) {
        enough_since_.reset();
        return changed;
      }
      if (!enough_since_) enough_since_ = Clock::now();
      formed = form_round(s, Clock::now() >= *enough_since_ + std::chrono::milliseconds(static_cast<int64_t>(
                                                                  o_.last_call_timeout_s * 1000)));
      return formed || changed;
    });
    if (formed) {
      int world = 0;
      std::vector<std::string> names;
      for (const auto& m : now.members) world += m.nproc, names.push_back(m.node);
      log::info("xlr8 launch: rendezvous round {}: {} machine(s), {} ranks: {}", now.round, now.members.size(), world,
                fmt::join(names, ", "));
    }
    return now;
  }

  void beat() {
    if (Clock::now() < last_beat() + std::chrono::milliseconds(static_cast<int64_t>(o_.keep_alive_interval_s * 1000)))
      return;
    const int64_t checked = lease();
    const bool alive = etcd_.keep_alive(checked);
    std::lock_guard lock(mutex_);
    last_beat_ = Clock::now();
    // Only about the lease this machine still holds (join may have registered anew meanwhile).
    if (!alive && lease_ == checked && lost_.empty())
      lost_ = fmt::format("this machine's etcd lease expired (no keep-alive for {} s)", ttl_s_), lost_for_lease_ = checked;
  }

  std::string id() const {
    std::lock_guard lock(mutex_);
    return id_;
  }
  int64_t lease() const {
    std::lock_guard lock(mutex_);
    return lease_;
  }
  Clock::time_point last_beat() const {
    std::lock_guard lock(mutex_);
    return last_beat_;
  }

  void watch() {
    const auto tick = std::chrono::milliseconds(static_cast<int64_t>(std::clamp(o_.keep_alive_interval_s / 4, 0.05, 0.5) * 1000));
    while (!stop_) {
      try {
        beat();
        const RoundsState s = refresh();
        std::lock_guard lock(mutex_);
        last_answer_ = Clock::now();
        latest_ = s;
        if (round_ > 0 && s.restart_round == round_ && restart_.empty() && lost_.empty())
          restart_ = s.restart_reason, restart_kind_ = s.restart_kind;
        if (!is_member(s, id_) && !waiting_ && round_ > 0 && restart_.empty() && lost_.empty() && !s.finishing)
          lost_ = "the others dropped this machine from the round", lost_for_lease_ = lease_;
      } catch (const ConfigError& e) {
        std::lock_guard lock(mutex_);
        fatal_ = e.what();
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex_);
        if (lost_.empty() && Clock::now() > last_answer_ + std::chrono::seconds(ttl_s_))
          lost_ = fmt::format("no etcd member answered for {} s: {}", ttl_s_, e.what()), lost_for_lease_ = lease_;
      }
      changed_.notify_all();
      std::this_thread::sleep_for(tick);
    }
  }

  ElasticOptions o_;
  EtcdClient etcd_;
  std::string prefix_;
  ThisMachine me_;
  int64_t ttl_s_;
  std::function<bool()> cancelled_;
  mutable std::mutex mutex_;  // guards the fields below
  std::condition_variable changed_;
  int64_t lease_ = 0;
  std::string id_;
  int round_ = 0;       // the round this machine was last assigned to
  bool waiting_ = false;  // asked for a place and not yet given one
  JoinRequest last_join_;
  std::optional<RoundsState> latest_;
  std::string restart_, restart_kind_;
  std::string lost_;          // this machine's registration is gone (set: join registers it anew)
  int64_t lost_for_lease_ = 0;  // the lease `lost_` is about
  std::string fatal_;         // the rendezvous refused this machine (ConfigError)
  std::optional<Clock::time_point> enough_since_;  // only the watching thread uses it
  Clock::time_point last_answer_, last_beat_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

double etcd_request_timeout_s(const ElasticOptions& o) {
  return o.etcd_timeout_s > 0 ? o.etcd_timeout_s : std::min(3.0, o.keep_alive_interval_s * o.keep_alive_max_attempt / 3);
}

std::unique_ptr<Rendezvous> make_etcd_rendezvous(const ElasticOptions& options, const std::function<bool()>& cancelled) {
  return std::make_unique<EtcdRendezvous>(options, cancelled);
}

}  // namespace xlr8::launcher
