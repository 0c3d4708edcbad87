#pragma once
// Reads the flight recorder's dumps (<dir>/rank<R>.json, core/flight_recorder.hpp) of a failed or hung job
// and says in one paragraph who was where: which ranks wait in which collective (group and sequence
// number), which rank never arrived and what its last collective was, which ranks issued different
// collectives at the same position, and which ranks left no trace.
#include <string>

namespace xlr8::detail {

// Empty when `dir` holds no dump. `world_size` names the ranks that should have left one (0: those seen).
std::string diagnose_traces(const std::string& dir, int world_size);
// Whether some rank's dump was written because one of its collectives timed out (a hang, as opposed to a rank
// that failed on its own while the others were wherever they were).
bool traces_show_a_timeout(const std::string& dir);

}  // namespace xlr8::detail
