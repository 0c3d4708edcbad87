// Communicator: object collectives through the store, sub-groups, and making a group (Gloo, NCCL and
// shared memory over one store).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "compat/torch_flight_recorder.hpp"
#include "core/flight_recorder.hpp"
#include "distributed/comm_state.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

using detail::CommState;
using distributed::guarded;
using distributed::require;

namespace {
// At start-up, before any thread or process group exists (the setenv); make_communicator repeats the call.
[[maybe_unused]] const bool torch_flight_recorder_checked = (compat::avoid_torch_flight_recorder_race(), true);
}  // namespace

// Object collectives go through the store: no device tensors, any backend, store-enforced timeouts.
namespace {

// Every value carries one leading byte: LibTorch 1.13's TCPStore server sent a value's length corked
// (MSG_MORE) and then its bytes, so an empty value (an empty payload: report()'s "no error", say) left the
// length corked until the kernel's 200 ms limit, on every such read. 1.x is no longer built; the byte stays (it
// also tells an object collective's value from anything else under the key).
constexpr char kValueMark = '=';

std::string store_get(const CommState& s, const std::string& key, const std::string& desc) {
  return guarded(s, desc, [&] {
    auto bytes = s.store->get(key);
    if (bytes.empty() || bytes.front() != kValueMark)
      throw Error(fmt::format("{}: the store's value under {} is not an object collective's", desc, key));
    return std::string(bytes.begin() + 1, bytes.end());
  });
}

void store_set(const CommState& s, const std::string& key, const std::string& value, const std::string& desc) {
  guarded(s, desc, [&] {
    const std::string marked = kValueMark + value;
    s.store->set(key, std::vector<uint8_t>(marked.begin(), marked.end()));
    return 0;
  });
}

// The last rank to finish reading removes the keys, so the store does not grow without bound.
void release(const CommState& s, const std::string& base, const std::vector<std::string>& keys, const std::string& desc) {
  guarded(s, desc, [&] {
    if (s.store->add(base + "/read", 1) == s.size) {
      for (auto& k : keys) s.store->deleteKey(k);
      s.store->deleteKey(base + "/read");
    }
    return 0;
  });
}

// Object collectives go through the store, not a backend: the flight recorder numbers them with the group's
// other collectives, by kind and root only (each rank's payload size differs).
template <class Fn>
auto record_object_collective(CommState& s, const std::string& op, const std::string& desc, Fn&& fn) {
  auto& recorder = core::FlightRecorder::instance();
  const uint64_t id = recorder.enqueued(s.identity, ++s.collective_sequence, op);
  try {
    auto result = fn();
    recorder.completed(id, true);
    return result;
  } catch (const TimeoutError&) {
    recorder.failed(id, true, desc);
    throw;
  } catch (...) {
    recorder.failed(id, false, desc);
    throw;
  }
}

}  // namespace

void detail::CommState::nccl_in_use() {
#ifdef XLR8_WITH_NCCL
  compat::abort_nccl_groups_at_exit();
#endif
}

std::string Communicator::broadcast_object(const std::string& payload, int root) {
  auto& s = *state_;
  auto desc = fmt::format("broadcast_object({} bytes, root {}) on group '{}' (rank {} of {})", payload.size(), root,
                          s.name, s.rank, s.size);
  require(root >= 0 && root < s.size, desc, fmt::format("root must be in [0, {})", s.size));
  return record_object_collective(s, fmt::format("broadcast_object(root {})", root), desc, [&] {
    std::string base = fmt::format("xlr8/obj/{}", s.object_sequence++);
    if (s.rank == root) store_set(s, base, payload, desc);
    std::string value = s.rank == root ? payload : store_get(s, base, desc);
    release(s, base, {base}, desc);
    return value;
  });
}

std::vector<std::string> Communicator::all_gather_object(const std::string& payload) {
  auto& s = *state_;
  auto desc = fmt::format("all_gather_object({} bytes) on group '{}' (rank {} of {})", payload.size(), s.name, s.rank, s.size);
  return record_object_collective(s, "all_gather_object", desc, [&] {
    std::string base = fmt::format("xlr8/obj/{}", s.object_sequence++);
    store_set(s, fmt::format("{}/{}", base, s.rank), payload, desc);
    std::vector<std::string> values, keys;
    for (int i = 0; i < s.size; ++i) {
      keys.push_back(fmt::format("{}/{}", base, i));
      values.push_back(i == s.rank ? payload : store_get(s, keys.back(), desc));
    }
    release(s, base, keys, desc);
    return values;
  });
}

Communicator Communicator::new_group(const std::vector<int>& ranks, const std::string& name) const {
  auto& s = *state_;
  auto desc = fmt::format("new_group('{}', ranks [{}]) from group '{}'", name, fmt::join(ranks, ", "), s.name);
  require(!ranks.empty(), desc, "a group needs at least one rank");
  int my_index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    require(ranks[i] >= 0 && ranks[i] < s.size, desc, fmt::format("rank {} is outside [0, {})", ranks[i], s.size));
    require(i == 0 || ranks[i] > ranks[i - 1], desc, "ranks must be increasing and distinct");
    if (ranks[i] == s.rank) my_index = static_cast<int>(i);
  }
  require(my_index >= 0, desc, fmt::format("this rank ({}) is not a member; only members create a group", s.rank));
  std::string key = fmt::format("{}/{}", name, fmt::join(ranks, ","));
  int generation = state_->subgroups_made[key]++;
  auto store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("xlr8/group/{}/{}", key, generation), s.store);
  auto group = distributed::make_communicator(store, my_index, static_cast<int>(ranks.size()), s.name + "/" + name,
                                         s.master_addr, s.timeout, s.nccl != nullptr, s.shared_memory_wanted);
  group.state_->identity = fmt::format("{}/{}[{}]{}", s.identity, name, fmt::join(ranks, ","),
                                       generation ? fmt::format("#{}", generation) : "");
  return group;
}

Communicator distributed::make_communicator(compat::StorePtr store, int rank, int size, const std::string& name,
                                       const std::string& master_addr, std::chrono::milliseconds timeout, bool use_nccl,
                                       bool use_shared_memory) {
  auto s = std::make_shared<CommState>();
  s->store = store;
  s->rank = rank;
  s->size = size;
  s->name = name;
  s->identity = name;
  s->master_addr = master_addr;
  s->timeout = timeout;
  compat::avoid_torch_flight_recorder_race();
  auto desc = fmt::format("creating process group '{}' (rank {} of {})", name, rank, size);
  s->gloo = guarded(*s, desc + " with gloo", [&] {
    return compat::make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, size, timeout, master_addr);
  });
  if (use_nccl) {
#ifdef XLR8_WITH_NCCL
    s->nccl = guarded(*s, desc + " with nccl", [&] {
      return compat::make_nccl(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, size, timeout,
                               s->nccl_at_exit);
    });
#else
    throw Error(desc + ": this xlr8 build has no NCCL support");
#endif
  }
  s->shared_memory_wanted = use_shared_memory;
  if (use_shared_memory)
    s->shm = guarded(*s, desc + " with shared memory", [&] {
      return distributed::ShmTransport::connect(c10::make_intrusive<c10d::PrefixStore>("shm", store), rank, size, name,
                                           timeout);
    });
  return Communicator(s);
}

Communicator Communicator::in_process(const std::string& store_key, int rank, int size, std::chrono::milliseconds timeout,
                                      bool shared_memory) {
  static std::mutex mutex;
  static std::map<std::string, c10::intrusive_ptr<c10d::HashStore>> stores;
  c10::intrusive_ptr<c10d::HashStore> store;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto& slot = stores[store_key];
    if (!slot) slot = c10::make_intrusive<c10d::HashStore>();
    store = slot;
  }
  store->setTimeout(timeout);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("xlr8/" + store_key, store);
  return distributed::make_communicator(prefixed, rank, size, "world", "127.0.0.1", timeout, false, shared_memory);
}

}  // namespace xlr8
