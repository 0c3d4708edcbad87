#pragma once
// A phase that can fail on one rank while the others succeed, before a collective the failed rank would never join:
// every rank learns the outcome, so that none goes on into the collective and waits for its timeout.
#include <fmt/format.h>

#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

// Runs `phase` here, then agrees with every rank of `world` (collective): when any failed, each rank throws the
// first failed rank's message ("rank r: " where several run), followed by "; `consequence`" unless it says so already.
// An exception not xlr8's own (LibTorch's, the library's) is prefixed with `context`, the operation it interrupted.
template <class Phase>
void on_every_rank_or_none(Communicator& world, Phase&& phase, std::string_view context,
                           std::string_view consequence = {}) {
  std::string problem;
  try {
    phase();
  } catch (const Error& e) {
    problem = e.what();
  } catch (const std::exception& e) {
    problem = fmt::format("{}: {}", context, e.what());
  }
  const auto problems = world.size() > 1 ? world.all_gather_object(problem) : std::vector<std::string>{problem};
  for (size_t r = 0; r < problems.size(); ++r) {
    if (problems[r].empty()) continue;
    const auto said = problems[r].find(consequence) != std::string::npos  // an empty one is found too
                          ? problems[r]
                          : fmt::format("{}; {}", problems[r], consequence);
    throw Error(problems.size() == 1 ? said : fmt::format("rank {}: {}", r, said));
  }
}

}  // namespace xlr8
