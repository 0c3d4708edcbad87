#pragma once
// Rendezvous through a c10d TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it).
#include "compat/torch_compat.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::distributed {

// Returns once every rank has joined; otherwise throws xlr8::TimeoutError naming the missing ranks and
// the address, or xlr8::Error when the server cannot listen (port in use) or cannot be reached.
// `attempt` (TORCHELASTIC_RESTART_COUNT under torchrun's agent store) keys each restart apart: the agent keeps its
// store across restarts, so a restarted group would otherwise read the join count and addresses of the one before.
compat::StorePtr rendezvous(const Topology& topology, std::chrono::milliseconds timeout, int64_t attempt = 0);

// Sets the node index and count from the hosts every rank reported at rendezvous (nodes numbered in the
// order of their lowest rank), for starters that give no node index (OpenMPI, PMI). Throws xlr8::Error
// when the local rank/size the starter gave disagree with the ranks seen on this host.
void place_nodes_by_host(const compat::StorePtr& store, Topology& topology);

}  // namespace xlr8::distributed
