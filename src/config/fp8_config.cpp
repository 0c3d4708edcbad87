#include "config/fp8_config.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::config {

// The keys `accelerate launch` reads (a key k is its flag --fp8_<k>, fp8_format is --fp8_format) and the three
// `accelerate config` writes under other names (amax_history_length, amax_compute_algorithm,
// optimization_level; Accelerate's launch drops those, xlr8 reads them as the same settings).
const std::vector<std::string> kFp8Keys = {
    "backend", "use_autocast_during_eval", "margin", "interval", "fp8_format", "amax_history_len",
    "amax_history_length", "amax_compute_algo", "amax_compute_algorithm", "override_linear_precision", "opt_level",
    "optimization_level", "enable_fsdp_float8_all_gather", "pad_inner_dim", "use_mxfp8_block_scaling"};

namespace {

const std::vector<std::string> kBackends = {"AO", "TE", "MSAMP"};
const std::vector<std::string> kFormats = {"HYBRID", "E4M3", "E5M2"};
const std::vector<std::string> kAmaxAlgos = {"max", "most_recent"};
const std::vector<std::string> kOptLevels = {"O1", "O2"};

// One line for what xlr8 does not have, naming where the value came from.
void refuse_unsupported(const Fp8Settings& f, bool mxfp8, const std::string& where_backend,
                        const std::string& where_format, const std::string& where_mxfp8) {
  if (f.backend == "MSAMP")
    throw ConfigError(fmt::format("{}: MSAMP (MS-AMP, deprecated by Accelerate) is not an xlr8 fp8 backend; use AO "
                                  "(torchao's dynamic scaling) or TE (Transformer Engine's delayed scaling)",
                                  where_backend));
  if (f.fp8_format == "E5M2")
    throw ConfigError(fmt::format("{}: E5M2 for every tensor is not supported (Transformer Engine refuses pure E5M2 "
                                  "training too); use HYBRID (e4m3 forward, e5m2 gradients) or E4M3",
                                  where_format));
  if (mxfp8)
    throw ConfigError(fmt::format("{}: MXFP8 block scaling is not in xlr8; remove it (per-tensor delayed scaling "
                                  "is used)",
                                  where_mxfp8));
}

// Accelerate writes it as a list of three booleans; its docs and one of its test files as the string
// "(false, false, false)", and its launch flag as "true,false,1".
std::array<bool, 3> three_booleans(const std::vector<std::string>& items, const std::string& where) {
  std::array<bool, 3> out{};
  std::vector<std::string> words;
  for (auto item : items) {
    for (char c : {'(', ')', '[', ']', ' '}) item.erase(std::remove(item.begin(), item.end(), c), item.end());
    for (auto& word : text::split(item, ','))
      if (!word.empty()) words.push_back(word);
  }
  if (words.size() != 3)
    throw ConfigError(fmt::format("{}: give three booleans (fprop, dgrad, wgrad), e.g. [false, false, false]", where));
  for (size_t i = 0; i < 3; ++i) {
    auto b = parse_bool(words[i]);
    if (!b) throw ConfigError(fmt::format("{}: {:?} is not a boolean; use true or false", where, words[i]));
    out[i] = *b;
  }
  return out;
}

std::string python_bool(bool b) { return b ? "True" : "False"; }

}  // namespace

void read_fp8(const Section& s, Fp8Settings& f) {
  if (auto v = s.choice("backend", kBackends, /*upper=*/true)) f.backend = *v;
  f.use_autocast_during_eval = s.boolean("use_autocast_during_eval").value_or(f.use_autocast_during_eval);
  if (auto v = s.integer("margin", 0, 1 << 20)) f.margin = static_cast<int>(*v);
  if (auto v = s.integer("interval", 1, 1 << 30)) f.interval = static_cast<int>(*v);
  if (auto v = s.choice("fp8_format", kFormats, /*upper=*/true)) f.fp8_format = *v;
  // The names `accelerate config` writes first, so that Accelerate's own key (and a --fp8_* flag, stored under it) wins.
  for (auto key : {"amax_history_length", "amax_history_len"})
    if (auto v = s.integer(key, 1, 1 << 20)) f.amax_history_len = static_cast<int>(*v);
  for (auto key : {"amax_compute_algorithm", "amax_compute_algo"})
    if (auto v = s.choice(key, kAmaxAlgos, /*upper=*/false)) f.amax_compute_algo = *v;
  if (s.has("override_linear_precision"))
    f.override_linear_precision = three_booleans(s.list("override_linear_precision"), s.where("override_linear_precision"));
  for (auto key : {"optimization_level", "opt_level"})
    if (auto v = s.choice(key, kOptLevels, /*upper=*/true)) f.opt_level = *v;
  f.enable_fsdp_float8_all_gather = s.boolean("enable_fsdp_float8_all_gather").value_or(f.enable_fsdp_float8_all_gather);
  f.pad_inner_dim = s.boolean("pad_inner_dim").value_or(f.pad_inner_dim);
  refuse_unsupported(f, s.boolean("use_mxfp8_block_scaling").value_or(false), s.where("backend"), s.where("fp8_format"),
                     s.where("use_mxfp8_block_scaling"));
}

void check_fp8(const Fp8Settings& f, const std::string& what) {
  if (!f.backend.empty()) check_choice(f.backend, kBackends, what + ".backend");
  check_choice(f.fp8_format, kFormats, what + ".fp8_format");
  check_choice(f.amax_compute_algo, kAmaxAlgos, what + ".amax_compute_algo");
  check_choice(f.opt_level, kOptLevels, what + ".opt_level");
  check_choice(f.ao_recipe, {"tensorwise", "rowwise"}, what + ".ao_recipe");
  if (f.min_linear_features < 0)
    throw ConfigError(fmt::format("{}.min_linear_features {} must be 0 or more", what, f.min_linear_features));
  if (f.margin < 0 || f.interval < 1 || f.amax_history_len < 1)
    throw ConfigError(fmt::format("{}: margin {} must be 0 or more, interval {} and amax_history_len {} at least 1", what,
                                  f.margin, f.interval, f.amax_history_len));
  refuse_unsupported(f, false, what + ".backend", what + ".fp8_format", what);
}

void write_fp8(YAML::Emitter& out, const Fp8Settings& f) {
  out << YAML::Key << "fp8_config" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "amax_compute_algo" << YAML::Value << f.amax_compute_algo;
  out << YAML::Key << "amax_history_len" << YAML::Value << f.amax_history_len;
  if (!f.backend.empty()) out << YAML::Key << "backend" << YAML::Value << f.backend;
  out << YAML::Key << "enable_fsdp_float8_all_gather" << YAML::Value << f.enable_fsdp_float8_all_gather;
  out << YAML::Key << "fp8_format" << YAML::Value << f.fp8_format;
  out << YAML::Key << "interval" << YAML::Value << f.interval;
  out << YAML::Key << "margin" << YAML::Value << f.margin;
  out << YAML::Key << "override_linear_precision" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (bool b : f.override_linear_precision) out << b;
  out << YAML::EndSeq;
  out << YAML::Key << "pad_inner_dim" << YAML::Value << f.pad_inner_dim;
  out << YAML::Key << "use_autocast_during_eval" << YAML::Value << f.use_autocast_during_eval;
  out << YAML::EndMap;
}

void fp8_to_env(const Fp8Settings& f, std::map<std::string, std::string>& env) {
  if (!f.backend.empty()) env["ACCELERATE_FP8_BACKEND"] = f.backend;
  env["ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL"] = python_bool(f.use_autocast_during_eval);
  env["ACCELERATE_FP8_MARGIN"] = std::to_string(f.margin);
  env["ACCELERATE_FP8_INTERVAL"] = std::to_string(f.interval);
  env["ACCELERATE_FP8_FORMAT"] = f.fp8_format;
  env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] = std::to_string(f.amax_history_len);
  env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] = f.amax_compute_algo;
  env["ACCELERATE_FP8_OVERRIDE_FPROP"] = python_bool(f.override_linear_precision[0]);
  env["ACCELERATE_FP8_OVERRIDE_DGRAD"] = python_bool(f.override_linear_precision[1]);
  env["ACCELERATE_FP8_OVERRIDE_WGRAD"] = python_bool(f.override_linear_precision[2]);
  env["ACCELERATE_FP8_OPT_LEVEL"] = f.opt_level;
  env["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] = python_bool(f.enable_fsdp_float8_all_gather);
  env["ACCELERATE_FP8_PAD_INNER_DIM"] = python_bool(f.pad_inner_dim);
}

namespace {
std::string env_choice(const Env& env, const char* name, const std::vector<std::string>& allowed, bool upper,
                       const std::string& otherwise) {
  auto v = env.get(name);
  if (!v) return otherwise;
  const std::string value = upper ? text::upper(*v) : text::lower(*v);
  check_choice(value, allowed, name);
  return value;
}
int env_count(const Env& env, const char* name, long min, int otherwise) {
  auto v = env.get_int(name);
  if (!v) return otherwise;
  if (*v < min || *v > (1L << 30)) throw ConfigError(fmt::format("{}={}: must be at least {}", name, *v, min));
  return static_cast<int>(*v);
}
}  // namespace

Fp8Settings fp8_from_env(const Env& env) {
  Fp8Settings f;
  f.backend = env_choice(env, "ACCELERATE_FP8_BACKEND", kBackends, /*upper=*/true, "");
  f.use_autocast_during_eval = env.get_bool("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL").value_or(false);
  f.margin = env_count(env, "ACCELERATE_FP8_MARGIN", 0, f.margin);
  f.interval = env_count(env, "ACCELERATE_FP8_INTERVAL", 1, f.interval);
  f.fp8_format = env_choice(env, "ACCELERATE_FP8_FORMAT", kFormats, /*upper=*/true, f.fp8_format);
  f.amax_history_len = env_count(env, "ACCELERATE_FP8_AMAX_HISTORY_LEN", 1, f.amax_history_len);
  f.amax_compute_algo = env_choice(env, "ACCELERATE_FP8_AMAX_COMPUTE_ALGO", kAmaxAlgos, /*upper=*/false, f.amax_compute_algo);
  const char* overrides[] = {"ACCELERATE_FP8_OVERRIDE_FPROP", "ACCELERATE_FP8_OVERRIDE_DGRAD", "ACCELERATE_FP8_OVERRIDE_WGRAD"};
  for (size_t i = 0; i < 3; ++i) f.override_linear_precision[i] = env.get_bool(overrides[i]).value_or(false);
  f.opt_level = env_choice(env, "ACCELERATE_FP8_OPT_LEVEL", kOptLevels, /*upper=*/true, f.opt_level);
  f.enable_fsdp_float8_all_gather = env.get_bool("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER").value_or(true);
  f.pad_inner_dim = env.get_bool("ACCELERATE_FP8_PAD_INNER_DIM").value_or(true);
  refuse_unsupported(f, env.get_bool("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING").value_or(false),
                     "ACCELERATE_FP8_BACKEND=" + f.backend, "ACCELERATE_FP8_FORMAT=" + f.fp8_format,
                     "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING");
  return f;
}

}  // namespace xlr8::config
