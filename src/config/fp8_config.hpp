#pragma once
// Accelerate's fp8 settings in each of their three forms: the config file's fp8_config section (with the key
// names `accelerate config` writes and those `accelerate launch` reads), the ACCELERATE_FP8_* variables
// `accelerate launch` exports, and back. Which backends xlr8 has is decided here: AO and TE; MS-AMP and
// MXFP8 block scaling are refused in one line.
#include <yaml-cpp/yaml.h>

#include <map>
#include <string>
#include <vector>

#include "config/config_section.hpp"
#include "xlr8/env.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::config {

extern const std::vector<std::string> kFp8Keys;

void read_fp8(const Section& section, Fp8Settings& fp8);
void write_fp8(YAML::Emitter& out, const Fp8Settings& fp8);

// As `accelerate launch` exports them: every setting, booleans as Python writes them ("True"/"False"), the
// backend only when one was named, override_linear_precision as three variables.
void fp8_to_env(const Fp8Settings& fp8, std::map<std::string, std::string>& env);
// A program's own settings (AcceleratorOptions::fp8), checked as the file's are; `what` names them in errors.
void check_fp8(const Fp8Settings& fp8, const std::string& what);

// What `accelerate launch` (or xlr8 launch) exported, read with Accelerate's rules (case-insensitive choices,
// its boolean spellings); a value it would refuse names the variable.
Fp8Settings fp8_from_env(const Env& env);

}  // namespace xlr8::config
