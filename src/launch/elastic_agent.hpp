#pragma once
// `xlr8 launch --rdzv_backend c10d`: this machine's agent in an elastic job (torchrun's elastic agent).
#include <string>

#include "xlr8/launcher.hpp"

namespace xlr8::launcher {

// Joins the rendezvous (serving it when --rdzv_endpoint is this machine), runs this machine's workers at
// the place each round gives it, and starts a new round when a worker fails (charged to max_restarts),
// when a machine leaves (also charged: the job lost workers) or when one waits to join (not charged).
LaunchOutcome launch_elastic(const LaunchOptions& options, const std::string& program);

}  // namespace xlr8::launcher
