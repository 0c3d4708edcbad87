#include "distributed/rendezvous.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "core/text.hpp"
#include "os/net.hpp"
#include "xlr8/error.hpp"

namespace xlr8::distributed {

using text::first_line;

namespace {

// LibTorch's TCPStore client retries a refused connection once a second, so a rank that starts before rank 0
// listens lost a second of every launch. Knock until the port accepts (a connection closed at once, which the
// server drops), then let the store connect. Only a refusal is waited out here; anything else (a name this
// IPv4 check cannot resolve, an unreachable host) is left to the store and its own error.
// False when the port refused until the deadline.
bool wait_until_listening(const Topology& t, std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::milliseconds(2);
  const std::string refused = std::strerror(ECONNREFUSED);
  for (;;) {
    std::string why;
    const int fd = os::connect_tcp({t.master_addr, t.master_port}, 1.0, why);
    if (fd >= 0) {
      ::close(fd);
      return true;
    }
    if (why != refused) return true;
    if (std::chrono::steady_clock::now() + pause >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

// The job this server belongs to, which every rank must share: its id and its number of ranks, in one key (as
// earlier versions wrote it). A rank that disagrees stops with an error instead of joining, and leaves a note for
// rank 0's timeout to name: either a machine of this job counted the ranks differently, or a rank of another job (a
// stale MASTER_PORT) came here. Rank 0 does not stop for it: a stray rank of another job must not end this one.
void check_same_job(c10d::Store& store, const Topology& t, const std::string& where, const std::string& host) {
  constexpr std::string_view kWith = " with ";  // "<job> with <N> ranks"
  const std::string name = t.job_id.empty() ? "this job" : t.job_id;
  const std::string job = fmt::format("{}{}{} ranks", name, kWith, t.world_size);
  if (t.rank == 0) {
    store.set("xlr8/rdzv/job", bytes_of(job));
    return;
  }
  const auto their_bytes = store.get("xlr8/rdzv/job");
  const std::string theirs(their_bytes.begin(), their_bytes.end());
  if (theirs == job) return;
  const auto with = theirs.rfind(kWith);
  const bool same_name = with != std::string::npos && theirs.substr(0, with) == name;
  const auto note = fmt::format("rank {} on {} expected {} ranks in all ({}: {})", t.rank, host, t.world_size, name,
                                same_name ? "every machine must count the same processes"
                                          : "another job's, which needs a port of its own");
  // The note is written before it is counted, so that rank 0 never waits for a counted note.
  const auto key = fmt::format("xlr8/rdzv/refused/{}/{}", host, t.rank);
  store.set(key, bytes_of(note));
  store.append("xlr8/rdzv/refused", bytes_of(key + "\n"));
  if (!same_name)
    throw Error(fmt::format("rank {} ({}) reached the rendezvous server at {} of another job ({}); give this job a port "
                            "of its own with MASTER_PORT",
                            t.rank, job, where, theirs));
  throw Error(fmt::format("rank {} expected {} ranks in all, but rank 0 started the rendezvous at {} for {}: every "
                          "machine must count the same processes (--num_processes is the total over all machines; or "
                          "give every machine the same --nproc_per_node and --num_machines). If that server is another "
                          "job's, give this job a port of its own with MASTER_PORT",
                          t.rank, t.world_size, where, with == std::string::npos ? theirs : theirs.substr(with + kWith.size())));
}

// What rank 0's timeout adds about ranks that came and were refused (check_same_job's notes).
std::string refused_ranks(c10d::Store& store) {
  try {
    if (!store.check({"xlr8/rdzv/refused"})) return "";
    const auto listed = store.get("xlr8/rdzv/refused");
    std::vector<std::string> notes;
    for (const auto& key : text::split(std::string(listed.begin(), listed.end()), '\n')) {
      if (key.empty() || !store.check({key})) continue;
      const auto note = store.get(key);
      notes.emplace_back(note.begin(), note.end());
    }
    return notes.empty() ? "" : fmt::format(". Refused here: {}", fmt::join(notes, "; "));
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

compat::StorePtr rendezvous(const Topology& t, std::chrono::milliseconds timeout, int64_t attempt) {
  const std::string where = fmt::format("{}:{}", t.master_addr, t.master_port);
  const double seconds = timeout.count() / 1000.0;
  compat::StorePtr store;
  const auto unreachable = [&](const std::string& cause) {
    return TimeoutError(fmt::format("rank {} could not reach the rendezvous server at {} within {} s: {}. Check that "
                                    "rank 0 (machine 0) is running and that MASTER_ADDR/MASTER_PORT are right",
                                    t.rank, where, seconds, cause));
  };
  // One deadline for reaching the server and for every rank to join.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (t.rank != 0 && !wait_until_listening(t, deadline))
    throw unreachable(std::strerror(ECONNREFUSED));
  try {
    store = compat::make_tcp_store(t.master_addr, t.master_port, t.rank == 0, t.world_size, timeout);
  } catch (const std::exception& e) {
    std::string cause = first_line(e.what());
    if (t.rank == 0)
      throw Error(fmt::format("rank 0 could not start the rendezvous server on port {} ({}): {}. If the port is in use, "
                              "choose another with --main_process_port, or omit it to pick a free one",
                              t.master_port, where, cause));
    throw unreachable(cause);
  }
  if (attempt > 0) store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("xlr8/attempt_{}", attempt), store);

  // Any store failure from here on means the server (rank 0) went away: it gave up or died.
  auto lost_server = [&](const std::exception& e) {
    return Error(fmt::format("rank {} lost the rendezvous server at {} while waiting for all {} ranks: {}. Rank 0 "
                             "exited or gave up; its own error names the ranks that did not join",
                             t.rank, where, t.world_size, first_line(e.what())));
  };
  const std::string& host = os::host_name();
  std::vector<int> missing;
  try {
    check_same_job(*store, t, where, host);
    store->set(fmt::format("xlr8/rdzv/rank/{}", t.rank), std::vector<uint8_t>(host.begin(), host.end()));
    store->add("xlr8/rdzv/joined", 1);
    auto pause = std::chrono::milliseconds(2);
    while (store->add("xlr8/rdzv/joined", 0) < t.world_size) {
      if (std::chrono::steady_clock::now() >= deadline) {
        for (int r = 0; r < t.world_size; ++r)
          if (!store->check({fmt::format("xlr8/rdzv/rank/{}", r)})) missing.push_back(r);
        break;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw lost_server(e);
  }
  if (!missing.empty())
    throw TimeoutError(fmt::format(
        "rendezvous at {} timed out after {} s on rank {}: {} of {} ranks joined; missing rank{} {}. Start the missing "
        "processes (every machine's launcher), or raise XLR8_RDZV_TIMEOUT{}",
        where, seconds, t.rank, t.world_size - static_cast<int>(missing.size()), t.world_size,
        missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), refused_ranks(*store)));
  return store;
}

void place_nodes_by_host(const compat::StorePtr& store, Topology& t) {
  // Rank 0 reads every rank's host and publishes the list under one key: W requests in all, where every
  // rank reading every host would send W^2 to the server.
  std::vector<std::string> hosts;
  try {
    if (t.rank == 0) {
      std::string all;
      for (int r = 0; r < t.world_size; ++r) {
        auto bytes = store->get(fmt::format("xlr8/rdzv/rank/{}", r));
        all += std::string(bytes.begin(), bytes.end()) + "\n";
      }
      store->set("xlr8/rdzv/hosts", std::vector<uint8_t>(all.begin(), all.end()));
    }
    auto bytes = store->get("xlr8/rdzv/hosts");
    std::string all(bytes.begin(), bytes.end());
    for (size_t start = 0, end; (end = all.find('\n', start)) != std::string::npos; start = end + 1)
      hosts.push_back(all.substr(start, end - start));
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {} could not read the hosts of the {} ranks from the rendezvous server at {}:{}: {}",
                            t.rank, t.world_size, t.master_addr, t.master_port, first_line(e.what())));
  }
  if (static_cast<int>(hosts.size()) != t.world_size)
    throw Error(fmt::format("rank {}: the rendezvous server listed {} hosts for {} ranks", t.rank, hosts.size(),
                            t.world_size));
  std::vector<std::string> nodes;  // distinct hosts, by lowest rank
  int local_count = 0;
  for (int r = 0; r < t.world_size; ++r) {
    if (std::find(nodes.begin(), nodes.end(), hosts[r]) == nodes.end()) nodes.push_back(hosts[r]);
    local_count += hosts[r] == hosts[t.rank];
  }
  if (local_count != t.local_world_size)
    throw Error(fmt::format("rank {} on host {} was told by the {} environment that {} ranks share its node, but {} "
                            "ranks reported this host at rendezvous; check the launcher's host names and slots",
                            t.rank, hosts[t.rank], t.source, t.local_world_size, local_count));
  t.num_nodes = static_cast<int>(nodes.size());
  t.node_rank = static_cast<int>(std::find(nodes.begin(), nodes.end(), hosts[t.rank]) - nodes.begin());
}

}  // namespace xlr8::distributed
