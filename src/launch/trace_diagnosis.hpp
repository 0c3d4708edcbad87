#pragma once
// Reads the flight recorder's dumps (<dir>/rank<R>.json, core/flight_recorder.hpp) of a failed or hung job
// and says in one paragraph who was where: which ranks wait in which collective (group and sequence
// number), which rank never arrived and what its last collective was, which ranks issued different
// collectives at the same position, and which ranks left no trace.
#include <string>

namespace xlr8::launcher {

struct TraceDiagnosisOptions {
  int world_size = 0;               // names the ranks that should have left a dump (0: those seen)
  bool only_after_timeout = false;  // empty unless some rank dumped because a collective timed out (a hang,
                                    // not a rank that failed on its own while the others were wherever they were)
  std::string shown_as;             // how the paragraph names `dir` (empty: the path itself)
};

// Empty when `dir` holds no dump (or, with only_after_timeout, no timeout's).
std::string diagnose_traces(const std::string& dir, const TraceDiagnosisOptions& options = {});

}  // namespace xlr8::launcher
