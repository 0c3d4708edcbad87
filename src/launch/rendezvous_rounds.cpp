#include "launch/rendezvous_rounds.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace xlr8::launcher {

using nlohmann::json;

namespace {

json machine_json(const RoundMachine& m) {
  return json{{"id", m.id},       {"node", m.node},   {"addr", m.addr},          {"nproc", m.nproc},
              {"port", m.port},   {"order", m.order}, {"prev_rank", m.prev_rank}};
}

RoundMachine machine_of(const json& j) {
  return {.id = j.at("id"),
          .node = j.at("node"),
          .addr = j.at("addr"),
          .nproc = j.at("nproc"),
          .port = j.at("port"),
          .order = j.at("order"),
          .prev_rank = j.at("prev_rank")};
}

// Removes `id` from `list`; the removed machine, if it was there.
std::optional<RoundMachine> take(std::vector<RoundMachine>& list, const std::string& id) {
  auto it = std::find_if(list.begin(), list.end(), [&](const RoundMachine& m) { return m.id == id; });
  if (it == list.end()) return std::nullopt;
  RoundMachine m = *it;
  list.erase(it);
  return m;
}

// The first reason given in a round wins (the c10d server tells each member once).
void restart_members(RoundsState& s, const std::string& reason, const std::string& kind) {
  if (s.members.empty() || s.restart_round == s.round) return;
  s.restart_round = s.round;
  s.restart_reason = reason;
  s.restart_kind = kind;
}

}  // namespace

json RoundsState::to_json() const {
  json m = json::array(), w = json::array();
  for (const auto& x : members) m.push_back(machine_json(x));
  for (const auto& x : waiting) w.push_back(machine_json(x));
  return json{{"min_nodes", min_nodes},         {"max_nodes", max_nodes},       {"round", round},
              {"members", m},                   {"waiting", w},                 {"finishing", finishing},
              {"restart_round", restart_round}, {"restart_reason", restart_reason}, {"restart_kind", restart_kind},
              {"next_order", next_order}};
}

RoundsState RoundsState::from_json(const json& j) {
  RoundsState s;
  s.min_nodes = j.at("min_nodes");
  s.max_nodes = j.at("max_nodes");
  s.round = j.at("round");
  for (const json& m : j.at("members")) s.members.push_back(machine_of(m));
  for (const json& m : j.at("waiting")) s.waiting.push_back(machine_of(m));
  s.finishing = j.at("finishing");
  s.restart_round = j.at("restart_round");
  s.restart_reason = j.at("restart_reason");
  s.restart_kind = j.at("restart_kind");
  s.next_order = j.at("next_order");
  return s;
}

std::string join_round(RoundsState& s, RoundMachine me, const std::string& reason, const std::string& kind) {
  const auto was_member = take(s.members, me.id);
  if (auto earlier = take(s.waiting, me.id)) me.prev_rank = earlier->prev_rank;
  if (was_member) me.prev_rank = was_member->prev_rank;
  me.order = s.next_order++;
  s.waiting.push_back(me);
  if (was_member) {
    restart_members(s, fmt::format("machine {} restarts its workers: {}", me.node, reason), kind);
  } else if (!s.members.empty()) {
    if (s.members.size() < static_cast<size_t>(s.max_nodes))
      restart_members(s, fmt::format("machine {} is waiting to join", me.node), "scale");
    else
      return fmt::format("the job runs on --nnodes max {} machines; this one is admitted when one of them leaves",
                         s.max_nodes);
  }
  return "";
}

std::string leave_rounds(RoundsState& s, const std::string& id, const std::string& reason) {
  take(s.waiting, id);
  const auto member = take(s.members, id);
  if (!member) return "";
  const std::string why = fmt::format("machine {} left: {}", member->node, reason);
  restart_members(s, why, "failure");
  return why;
}

void finish_round(RoundsState& s, const std::string& id) {
  take(s.members, id);
  take(s.waiting, id);
  s.finishing = true;
}

std::string drop_vanished(RoundsState& s, const std::vector<std::string>& alive, double silence_s) {
  auto gone = [&](const RoundMachine& m) { return std::find(alive.begin(), alive.end(), m.id) == alive.end(); };
  std::erase_if(s.waiting, gone);
  std::vector<std::string> lost;
  for (const auto& m : s.members)
    if (gone(m)) lost.push_back(m.node);
  if (lost.empty()) return "";
  std::erase_if(s.members, gone);
  const std::string why = fmt::format("machine {} is gone: its etcd lease expired ({:.0f} s without a word)",
                                      fmt::join(lost, ", "), silence_s);
  restart_members(s, why, "failure");
  return why;
}

bool can_form_round(const RoundsState& s) {
  return !s.finishing && s.members.empty() && s.waiting.size() >= static_cast<size_t>(s.min_nodes);
}

bool form_round(RoundsState& s, bool last_call_over) {
  if (!can_form_round(s)) return false;
  if (s.waiting.size() < static_cast<size_t>(s.max_nodes) && s.round == 0 && !last_call_over) return false;
  std::stable_sort(s.waiting.begin(), s.waiting.end(), [](const RoundMachine& x, const RoundMachine& y) {
    return std::tie(x.prev_rank, x.order) < std::tie(y.prev_rank, y.order);
  });
  const size_t n = std::min(s.waiting.size(), static_cast<size_t>(s.max_nodes));
  s.members.assign(s.waiting.begin(), s.waiting.begin() + static_cast<std::ptrdiff_t>(n));
  s.waiting.erase(s.waiting.begin(), s.waiting.begin() + static_cast<std::ptrdiff_t>(n));
  for (size_t i = 0; i < n; ++i) s.members[i].prev_rank = static_cast<int>(i);  // the next round keeps the order
  ++s.round;
  return true;
}

bool is_member(const RoundsState& s, const std::string& id) {
  return std::any_of(s.members.begin(), s.members.end(), [&](const RoundMachine& m) { return m.id == id; });
}

std::optional<RendezvousAssignment> assignment_of(const RoundsState& s, const std::string& id) {
  if (!is_member(s, id)) return std::nullopt;
  RendezvousAssignment a{.round = s.round,
                         .num_nodes = static_cast<int>(s.members.size()),
                         .world_size = 0,
                         .master_addr = s.members.front().addr,
                         .master_port = s.members.front().port};
  for (size_t i = 0; i < s.members.size(); ++i) {
    const RoundMachine& m = s.members[i];
    if (m.id == id) a.node_rank = static_cast<int>(i), a.rank_offset = a.world_size;
    a.world_size += m.nproc;
    a.nodes.push_back(m.node);
  }
  return a;
}

}  // namespace xlr8::launcher
