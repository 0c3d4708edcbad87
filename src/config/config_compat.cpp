#include "config/config_compat.hpp"

#include <fmt/format.h>

#include "core/log.hpp"
#include "core/text.hpp"
#include "xlr8/error.hpp"

namespace xlr8::config {

const std::vector<std::string> kCompatTopKeys = {
    // TPU (written into every file by `accelerate config`, off unless the TPU questions were answered)
    "downcast_bf16", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm",
    "tpu_env",
    // other features and their legacy spellings
    "dynamo_config", "dynamo_backend", "megatron_lm_config", "ipex_config", "fp16",
    "use_mps_device", "tp_config"};

namespace {

const char* kSupportedTypes = "NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED";

void refuse_unless_off(const Section& s, const std::string& key, const std::string& what, const std::string& fix) {
  if (!s.is_off(key)) throw s.error(key, fmt::format("value {} {}; {}", s.shown(key), what, fix));
}

}  // namespace

void refuse_foreign_environment(const Section& top) {
  if (auto v = top.str("compute_environment"); v && *v != "LOCAL_MACHINE") {
    throw top.error("compute_environment",
                    fmt::format("value {:?} is not supported: that compute environment is not supported by xlr8, which "
                                "runs on your own machines (LOCAL_MACHINE: xlr8 launch, Slurm, mpirun); write a config "
                                "with `xlr8 config`",
                                *v));
  }
  auto type = top.str("distributed_type");
  if (!type) return;
  const std::string t = text::upper(*type);
  const bool other_accelerator = t.rfind("MULTI_", 0) == 0 && t != "MULTI_CPU" && t != "MULTI_GPU";
  // Accelerate's distributed types (and older spellings) xlr8 cannot run, and why.
  const std::vector<std::pair<bool, const char*>> refused = {
      {t == "XLA" || t == "TPU", "(TPU) is not supported: the TPU compute environment is not supported by xlr8, which "
                                 "runs on CPUs and CUDA GPUs"},
      {other_accelerator, "is not supported: xlr8 runs on CPUs and CUDA GPUs"},
      {t == "MEGATRON_LM", "is not supported: xlr8 has no Megatron-LM engine"},
      {t == "MPS", "is not supported: Apple MPS is not supported by xlr8"},
      {t == "TP", "is not supported: xlr8 has no tensor parallelism yet"},
  };
  for (const auto& [applies, why] : refused)
    if (applies)
      throw top.error("distributed_type", fmt::format("value {:?} {}; allowed: {}", *type, why, kSupportedTypes));
}

void refuse_unsupported_features(const Section& top) {
  // `accelerate tpu-config` (set-up commands for a TPU pod) reads these; `accelerate launch` runs a file
  // that has them anywhere, and so does xlr8 (a file that selects a TPU was refused above).
  for (const char* key : {"tpu_name", "tpu_zone", "commands", "command_file"})
    if (!top.is_off(key))
      log::debug("{}: {}{} = {} is for `accelerate tpu-config`; ignored", top.origin(), top.prefix(), key, top.shown(key));
  // These turn TPU launching or TPU precision on.
  const std::string tpu = "configures a TPU, and the TPU compute environment is not supported by xlr8";
  for (const char* key : {"downcast_bf16", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env"})
    refuse_unless_off(top, key, tpu, "remove the key (or set it to false / empty)");

  // TorchDynamo: `dynamo_backend: NO` (or no dynamo_config) is off; the legacy top-level key too.
  const std::string dynamo =
      "asks for torch.compile (TorchDynamo), which has no LibTorch C++ counterpart in xlr8";
  refuse_unless_off(top, "dynamo_backend", dynamo, "remove it or set it to NO");
  Section dyn(top.child("dynamo_config"), "dynamo_config.", top.origin());
  dyn.check_keys({"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                  "dynamo_use_regional_compilation", "backend", "mode", "use_fullgraph", "use_dynamic",
                  "use_regional_compilation"},
                 {}, nullptr);
  for (const char* key : {"dynamo_backend", "backend"}) refuse_unless_off(dyn, key, dynamo, "remove dynamo_config");

  // Intel Extension for PyTorch (Accelerate <= 1.12 wrote `ipex_config: {ipex: false}` for CPU jobs).
  Section ipex(top.child("ipex_config"), "ipex_config.", top.origin());
  ipex.check_keys({"ipex", "ipex_enabled", "use_xpu"}, {}, nullptr);
  for (const char* key : {"ipex", "ipex_enabled", "use_xpu"})
    refuse_unless_off(ipex, key, "asks for the Intel Extension for PyTorch, a Python package xlr8 does not use",
                      "set it to false");

  refuse_unless_off(top, "use_mps_device", "asks for Apple MPS, which xlr8 does not support", "set it to false");

  Section tp(top.child("tp_config"), "tp_config.", top.origin());
  tp.check_keys({"tp_size"}, {}, nullptr);
  if (auto size = tp.integer("tp_size", 1, 1 << 20); size && *size > 1)
    throw tp.error("tp_size", fmt::format("value {} asks for tensor parallelism, which xlr8 does not have yet; set it "
                                          "to 1 or remove tp_config",
                                          *size));
  // megatron_lm_config only acts with distributed_type MEGATRON_LM, refused where it is read; Accelerate leaves
  // its keys open, and so do we.
}

}  // namespace xlr8::config
