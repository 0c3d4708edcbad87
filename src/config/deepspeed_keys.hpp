#pragma once
// DeepSpeed's config keys, section by section (runtime/config.py, runtime/zero/config.py,
// offload_config.py), with how xlr8 treats each: read, accepted as a hint, or a feature xlr8 lacks.
#include <vector>

namespace xlr8::deepspeed::keys {

// How xlr8 treats a key DeepSpeed has.
enum class Use {
  READ,     // implemented: read below
  HINT,     // a performance hint or a setting without a counterpart here: accepted, no effect
  DEFAULT,  // a feature xlr8 lacks: accepted only at its default value (`off`)
  FEATURE,  // a section of a feature xlr8 lacks: accepted while nothing inside it is "enabled": true
};

struct Key {
  const char* name;
  Use use;
  const char* off = "null";  // DEFAULT: the JSON value that keeps the feature off
  const char* feature = "";  // DEFAULT / FEATURE: what it turns on, for the refusal
};

extern const std::vector<Key> kTopLevel;
extern const std::vector<Key> kFp16;
extern const std::vector<Key> kBf16;
extern const std::vector<Key> kZero;
extern const std::vector<Key> kOffloadOptimizer;
extern const std::vector<Key> kOffloadParam;
extern const std::vector<Key> kAio;
extern const std::vector<Key> kLeafModule;
extern const std::vector<Key> kCheckpoint;
extern const std::vector<Key> kTensorParallel;
extern const std::vector<Key> kPipeline;

}  // namespace xlr8::deepspeed::keys
