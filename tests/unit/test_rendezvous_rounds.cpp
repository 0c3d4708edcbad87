// The rendezvous rules as one document (launch/rendezvous_rounds.hpp), which the etcd backend's agents
// change by compare-and-swap: the same behaviour the c10d server has, checked step by step.
#include <gtest/gtest.h>

#include "launch/etcd_client.hpp"
#include "launch/rendezvous_rounds.hpp"

using namespace xlr8::launcher;

namespace {

RoundMachine machine(const std::string& id, int nproc = 2) {
  return {.id = id, .node = "host-" + id, .addr = "10.0.0." + id, .nproc = nproc, .port = 29500 + std::stoi(id)};
}

RoundsState fresh(int min_nodes, int max_nodes) { return RoundsState{.min_nodes = min_nodes, .max_nodes = max_nodes}; }

}  // namespace

TEST(RendezvousRounds, AFirstRoundWaitsForTheLastCallUnlessMaxNodesJoinedAndRanksByArrival) {
  RoundsState s = fresh(1, 3);
  join_round(s, machine("2"), "first start", "start");
  EXPECT_FALSE(form_round(s, /*last_call_over=*/false));
  join_round(s, machine("1", 4), "first start", "start");
  ASSERT_TRUE(form_round(s, /*last_call_over=*/true));
  EXPECT_EQ(s.round, 1);
  const auto first = assignment_of(s, "2"), second = assignment_of(s, "1");
  ASSERT_TRUE(first && second);
  EXPECT_EQ(first->node_rank, 0);
  EXPECT_EQ(second->node_rank, 1);
  EXPECT_EQ(second->rank_offset, 2);
  EXPECT_EQ(second->world_size, 6);
  EXPECT_EQ(second->master_addr, "10.0.0.2");
  EXPECT_EQ(second->master_port, 29502);
  EXPECT_EQ(second->nodes, (std::vector<std::string>{"host-2", "host-1"}));
  RoundsState full = fresh(1, 2);
  join_round(full, machine("1"), "", "start");
  join_round(full, machine("2"), "", "start");
  EXPECT_TRUE(form_round(full, /*last_call_over=*/false));  // max_nodes joined: no last call
}

TEST(RendezvousRounds, AFailingMemberRestartsTheOthersAndTheNextRoundKeepsTheOrderAtOnce) {
  RoundsState s = fresh(1, 2);
  join_round(s, machine("1"), "", "start");
  join_round(s, machine("2"), "", "start");
  ASSERT_TRUE(form_round(s, false));
  join_round(s, machine("2"), "rank 3 failed (exit code 1)", "failure");
  EXPECT_EQ(s.restart_round, 1);
  EXPECT_EQ(s.restart_kind, "failure");
  EXPECT_EQ(s.restart_reason, "machine host-2 restarts its workers: rank 3 failed (exit code 1)");
  EXPECT_FALSE(form_round(s, false));  // machine 1 still runs
  join_round(s, machine("1"), s.restart_reason, "failure");
  EXPECT_EQ(s.restart_reason, "machine host-2 restarts its workers: rank 3 failed (exit code 1)");  // the first wins
  ASSERT_TRUE(form_round(s, false));  // a restart goes at once
  EXPECT_EQ(s.round, 2);
  EXPECT_EQ(assignment_of(s, "1")->node_rank, 0);  // the places of the last round
  EXPECT_EQ(assignment_of(s, "2")->node_rank, 1);
}

// Three machines rejoin after a failure in another order than their ranks, and one joins twice (a write retried
// after a member's answer was lost): the next round still has the last round's order.
TEST(RendezvousRounds, RanksSurviveRejoiningInAnyOrderAndARepeatedJoin) {
  RoundsState s = fresh(1, 3);
  for (const char* id : {"1", "2", "3"}) join_round(s, machine(id), "", "start");
  ASSERT_TRUE(form_round(s, false));
  join_round(s, machine("2"), "rank 2 failed", "failure");
  join_round(s, machine("1"), s.restart_reason, "failure");
  join_round(s, machine("1"), s.restart_reason, "failure");
  join_round(s, machine("3"), s.restart_reason, "failure");
  ASSERT_TRUE(form_round(s, false));
  for (const auto& [id, rank] : {std::pair{"1", 0}, std::pair{"2", 1}, std::pair{"3", 2}})
    EXPECT_EQ(assignment_of(s, id)->node_rank, rank) << id;
}

TEST(RendezvousRounds, AVanishedMemberIsDroppedAndAJoiningOneAskedForOrMadeToWait) {
  RoundsState s = fresh(1, 2);
  join_round(s, machine("1"), "", "start");
  join_round(s, machine("2"), "", "start");
  ASSERT_TRUE(form_round(s, false));
  EXPECT_EQ(drop_vanished(s, {"1", "2"}, 3), "");
  EXPECT_EQ(drop_vanished(s, {"2"}, 3), "machine host-1 is gone: its etcd lease expired (3 s without a word)");
  EXPECT_EQ(s.restart_kind, "failure");
  join_round(s, machine("2"), s.restart_reason, "failure");
  ASSERT_TRUE(form_round(s, false));
  EXPECT_EQ(s.members.size(), 1u);
  EXPECT_EQ(assignment_of(s, "2")->world_size, 2);
  // A machine waiting to join: the running one restarts to admit it ("scale"), not as a failure.
  EXPECT_EQ(join_round(s, machine("3"), "first start", "start"), "");
  EXPECT_EQ(s.restart_kind, "scale");
  EXPECT_EQ(s.restart_reason, "machine host-3 is waiting to join");
  join_round(s, machine("2"), s.restart_reason, "scale");
  ASSERT_TRUE(form_round(s, false));
  // Full: a third machine waits for a place.
  EXPECT_NE(join_round(s, machine("4"), "", "start").find("admitted when one of them leaves"), std::string::npos);
  EXPECT_EQ(s.restart_round, 2);  // no restart asked for round 3
}

TEST(RendezvousRounds, OnceAMemberFinishesNoRoundStartsAndTheDocumentRoundTrips) {
  RoundsState s = fresh(1, 2);
  join_round(s, machine("1"), "", "start");
  join_round(s, machine("2"), "", "start");
  ASSERT_TRUE(form_round(s, false));
  EXPECT_EQ(leave_rounds(s, "2", "interrupted by signal 2"), "machine host-2 left: interrupted by signal 2");
  const RoundsState copy = RoundsState::from_json(nlohmann::json::parse(s.to_json().dump()));
  EXPECT_EQ(copy.to_json(), s.to_json());
  finish_round(s, "1");
  EXPECT_TRUE(s.finishing);
  join_round(s, machine("2"), "", "start");
  EXPECT_FALSE(can_form_round(s));
  EXPECT_FALSE(form_round(s, true));
  EXPECT_FALSE(is_member(s, "1"));
}

TEST(RendezvousRounds, Base64RoundTripsEveryLengthAndByteAsEtcdsGatewayWritesIt) {
  EXPECT_EQ(base64_encode("foo"), "Zm9v");  // etcd's own answers (curl against the gateway)
  EXPECT_EQ(base64_encode("fo"), "Zm8=");
  EXPECT_EQ(base64_encode("f"), "Zg==");
  EXPECT_EQ(base64_decode("YmFy"), "bar");
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes += static_cast<char>(i);
  for (size_t n = 0; n <= bytes.size(); n += 37) EXPECT_EQ(base64_decode(base64_encode(bytes.substr(0, n))), bytes.substr(0, n));
  EXPECT_EQ(base64_decode(base64_encode(bytes)), bytes);
}
