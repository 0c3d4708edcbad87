#pragma once
// The parts of Accelerate's config format that configure what xlr8 does not have: SageMaker, TPUs,
// accelerators other than CUDA, TorchDynamo, Megatron-LM, IPEX, fp8, MPS.
// A file that leaves them off loads silently; one that turns one on is refused with one line naming
// the key, the value and what xlr8 supports instead.
#include <string>
#include <vector>

#include "config/config_section.hpp"

namespace xlr8::config {

// Top-level keys that only these checks read.
extern const std::vector<std::string> kCompatTopKeys;

// compute_environment and distributed_type first: a SageMaker file's other keys would read as unknown.
void refuse_foreign_environment(const Section& top);
// Every key of kCompatTopKeys, and the keys inside those sections.
void refuse_unsupported_features(const Section& top);

}  // namespace xlr8::config
