#pragma once
// The static training memory per rank of each strategy (reference/003): what `xlr8 estimate-memory` prints
// and `xlr8 advise` prunes with. See cmd_estimate_memory.cpp for the formulas.
#include <fmt/format.h>

#include <string>

#include "xlr8/error.hpp"

namespace xlr8::cli {

struct DtypeBytes {
  std::string name;
  double param, grad, optimizer, activation;
};

inline DtypeBytes dtype_bytes(const std::string& text) {
  if (text == "float32" || text == "fp32") return {"float32", 4, 4, 8, 4};
  if (text == "bfloat16" || text == "bf16") return {"bfloat16", 2, 2, 12, 2};
  if (text == "float16" || text == "fp16") return {"float16", 2, 2, 12, 2};
  throw ConfigError(fmt::format("--dtypes {:?} is not a training dtype; use float32, bfloat16 or float16 "
                                "(or fp32, bf16, fp16)",
                                text));
}

inline double per_rank(const std::string& strategy, const DtypeBytes& d, double psi, int n) {
  if (strategy == "ddp") return (d.param + d.grad + d.optimizer) * psi;
  if (strategy == "zero1") return (d.param + d.grad) * psi + d.optimizer * psi / n;
  if (strategy == "zero2") return d.param * psi + (d.grad + d.optimizer) * psi / n;
  if (strategy == "zero3") return (d.param + d.grad + d.optimizer) * psi / n;
  throw ConfigError(fmt::format("--strategies {:?} is not a strategy; use ddp, zero1, zero2 or zero3 (FSDP's "
                                "NO_SHARD, SHARD_GRAD_OP and FULL_SHARD are ddp, zero2 and zero3)",
                                strategy));
}

inline std::string human(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) bytes /= 1000, ++u;
  return fmt::format("{:.2f} {}", bytes, units[u]);
}

}  // namespace xlr8::cli
