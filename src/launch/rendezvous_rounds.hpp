#pragma once
// The rendezvous as one document that any agent may change (the etcd backend keeps it under one key and
// writes it by compare-and-swap, so no machine serves it). The same rules as the c10d server
// (launch/rendezvous_server.cpp): rounds form from the waiting machines once at least min_nodes are there
// (a first round after last_call_timeout, or at once with max_nodes; a restart at once), ranked by their
// place in the last round, then by arrival; a member that leaves, fails or vanishes makes the others
// restart; a machine waiting to join makes them restart to admit it ("scale"); once one member finishes,
// no round starts again.
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "launch/rendezvous.hpp"

namespace xlr8::launcher {

struct RoundMachine {
  std::string id;  // unique while the machine lives (its etcd lease)
  std::string node, addr;
  int nproc = 1, port = 0;
  int64_t order = 0;        // when it joined
  int prev_rank = INT_MAX;  // its node rank in the last round it ran (INT_MAX: none yet)
};

struct RoundsState {
  int min_nodes = 1, max_nodes = 1;
  int round = 0;
  std::vector<RoundMachine> members;  // the running round's machines by node rank (those still running)
  std::vector<RoundMachine> waiting;  // asking for a place in the next round
  bool finishing = false;             // a member finished: the job ends when the others do
  int restart_round = 0;              // members of this round must restart, for:
  std::string restart_reason, restart_kind;
  int64_t next_order = 0;

  nlohmann::json to_json() const;
  static RoundsState from_json(const nlohmann::json& j);
};

// Each returns what it has to tell this machine's log ("" for nothing).
// A machine asks for a place (again): its own failure or restart makes the running members restart.
std::string join_round(RoundsState& s, RoundMachine me, const std::string& reason, const std::string& kind);
std::string leave_rounds(RoundsState& s, const std::string& id, const std::string& reason);
void finish_round(RoundsState& s, const std::string& id);
// Machines not in `alive` are gone (their lease expired after `silence_s` without a word).
std::string drop_vanished(RoundsState& s, const std::vector<std::string>& alive, double silence_s);
// True when a round formed (`last_call_over`: a first round may start with fewer than max_nodes).
bool form_round(RoundsState& s, bool last_call_over);
bool can_form_round(const RoundsState& s);  // enough machines wait and none runs
// `id`'s place in the current round, if it is a member.
std::optional<RendezvousAssignment> assignment_of(const RoundsState& s, const std::string& id);
bool is_member(const RoundsState& s, const std::string& id);

}  // namespace xlr8::launcher
