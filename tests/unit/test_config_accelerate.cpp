// Every config file shape that `accelerate config` writes (tests/data/accelerate_configs: its real
// output) either loads, or is refused with one line that names the key and the value. Plus the shapes
// older Accelerate versions wrote, which current files no longer show.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "parallel/shard/zero_strategy.hpp"
#include "xlr8/config.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/settings.hpp"

using namespace xlr8;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& load) {
  try {
    load();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string error_of_text(const std::string& yaml) {
  return error_of([&] { parse_config(yaml, "test.yaml"); });
}

// What each file must give: "" loads; otherwise every listed piece is in the one-line error.
const std::map<std::string, std::vector<std::string>> kExpected = {
    // Accelerate's own test fixtures (tests/test_configs in its repository).
    {"accelerate_tests_0_11_0.yaml", {}},
    {"accelerate_tests_0_12_0.yaml", {}},
    {"accelerate_tests_0_28_0_mpi.yaml", {}},
    {"accelerate_tests_0_30_0_sagemaker.yaml",
     {"compute_environment", "\"AMAZON_SAGEMAKER\"", "compute environment is not supported"}},
    {"accelerate_tests_0_34_0_fp8.yaml", {}},
    {"accelerate_tests_invalid_keys.yaml", {"unknown key \"invalid_key\""}},
    {"accelerate_tests_latest.yaml", {}},  // tpu-config's keys on a file that selects no TPU
    {"accelerate_tests_latest_fsdp.yaml", {}},
    {"accelerate_tests_validate_launch_cmd.yaml", {}},
    // Its ND-parallel examples (examples/torch_native_parallelism/configs in its repository).
    {"accelerate_nd_parallel_cp.yaml", {}},
    {"accelerate_nd_parallel_tp_hsdp.yaml", {}},
    // What `accelerate config` writes.
    {"basic_ngpu0.yaml", {}},
    {"basic_ngpu4.yaml", {}},
    {"ds_file.yaml", {}},
    {"ds_file_multinode.yaml", {"deepspeed_config.deepspeed_multinode_launcher", "\"pdsh\"", "\"standard\""}},
    {"ds_nofile_multinode_standard.yaml", {}},
    {"ds_nofile_z0.yaml", {}},
    {"ds_nofile_z2.yaml", {}},
    {"ds_nofile_z3_nvme.yaml", {"deepspeed_config.deepspeed_moe_layer_cls_names", "MixtralSparseMoeBlock"}},
    {"ds_single.yaml", {}},
    {"fp8_ao.yaml", {}},
    {"fp8_msamp.yaml", {"fp8_config.backend", "MSAMP", "AO", "TE"}},
    {"fp8_te.yaml", {}},
    {"fp8_te_default.yaml", {}},
    {"fsdp_v1.yaml", {}},
    {"fsdp_v1_nowrap.yaml", {}},
    {"fsdp_v1_size.yaml", {}},
    {"fsdp_v2.yaml", {}},
    // Accelerate's own test file: a 2x2x2x2 mesh (cp 2 with the ring) on 8 processes, which it refuses too.
    {"fsdp_v2_pc.yaml", {"parallelism_config sizes multiply to 16", "cp 2", "num_processes is 8"}},
    {"megatron.yaml", {"distributed_type", "\"MEGATRON_LM\"", "MULTI_GPU"}},
    {"megatron_min.yaml", {"distributed_type", "\"MEGATRON_LM\"", "MULTI_GPU"}},
    {"multi_cpu.yaml", {}},
    {"multi_cpu_mpirun.yaml", {}},
    {"multi_gpu.yaml", {}},
    {"multi_gpu_json.json", {}},
    {"multi_hpu.yaml", {"distributed_type", "\"MULTI_HPU\"", "CUDA GPUs"}},
    {"multi_node_gpu.yaml", {}},
    {"multi_xpu.yaml", {"distributed_type", "\"MULTI_XPU\"", "CUDA GPUs"}},
    {"no_dist_cpu.yaml", {}},
    {"no_dist_default.yaml", {}},
    {"no_dist_dynamo_custom.yaml", {"dynamo_config.dynamo_backend", "INDUCTOR", "torch.compile"}},
    {"no_dist_gpu_bf16_dynamo.yaml", {"dynamo_config.dynamo_backend", "INDUCTOR", "torch.compile"}},
    {"no_dist_mps.yaml", {}},
    {"sagemaker_dp.yaml", {"compute_environment", "\"AMAZON_SAGEMAKER\"", "compute environment is not supported"}},
    {"sagemaker_json.json", {"compute_environment", "\"AMAZON_SAGEMAKER\"", "compute environment is not supported"}},
    {"sagemaker_no.yaml", {"compute_environment", "\"AMAZON_SAGEMAKER\"", "compute environment is not supported"}},
    {"tpu.yaml", {"distributed_type", "\"XLA\"", "TPU compute environment is not supported"}},
    {"tpu_cluster_cmds.yaml", {"distributed_type", "\"XLA\"", "TPU compute environment is not supported"}},
    {"tpu_cluster_file.yaml", {"distributed_type", "\"XLA\"", "TPU compute environment is not supported"}},
};

}  // namespace

TEST(AccelerateConfigs, EveryShapeAccelerateWritesLoadsOrIsRefusedInOneLine) {
  const fs::path dir = fs::path(XLR8_SOURCE_DIR) / "tests/data/accelerate_configs";
  size_t seen = 0, loaded = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    auto name = entry.path().filename().string();
    if (name == "README.md") continue;
    ++seen;
    auto expected = kExpected.find(name);
    ASSERT_NE(expected, kExpected.end()) << name << " has no expectation in this test";
    std::string message = error_of([&] { load_config(entry.path().string()).settings(); });
    if (expected->second.empty()) {
      EXPECT_EQ(message, "") << name;
      loaded += message.empty();
      continue;
    }
    EXPECT_EQ(message.find('\n'), std::string::npos) << name << ": " << message;
    EXPECT_NE(message.find(name), std::string::npos) << message;  // the file is named
    for (const auto& piece : expected->second) EXPECT_NE(message.find(piece), std::string::npos) << name << ": " << message;
  }
  EXPECT_EQ(seen, kExpected.size());
  EXPECT_GE(loaded, 15u);
}

TEST(AccelerateConfigs, TheNdParallelExamplesShardAsAccelerateShardsThem) {
  // FSDP2 without fsdp_sharding_strategy on dp_replicate 2 x dp_shard 2 x tp 2 is HSDP (Accelerate's
  // fully_shard takes both dimensions); TRANSFORMER_BASED_WRAP without layer classes leaves them to the model.
  const fs::path dir = fs::path(XLR8_SOURCE_DIR) / "tests/data/accelerate_configs";
  auto tp_hsdp = load_config((dir / "accelerate_nd_parallel_tp_hsdp.yaml").string()).settings();
  auto options = xlr8::shard::resolve_zero_options({}, tp_hsdp, /*node_size=*/8);
  EXPECT_EQ(options.stage, 3);
  EXPECT_EQ(options.hybrid_shard_size, 2);  // shards over dp_shard, replicated over dp_replicate
  EXPECT_EQ(options.auto_wrap_policy, AutoWrapPolicy::TRANSFORMER_BASED_WRAP);
  EXPECT_TRUE(options.layer_classes.empty());
  tp_hsdp.fsdp->reshard_after_forward = false;  // HYBRID_SHARD_ZERO2's counterpart
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, tp_hsdp, 8).stage, 2);
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, tp_hsdp, 8).hybrid_shard_size, 2);
  tp_hsdp.fsdp->version = 1;  // FSDP1 (which Accelerate refuses on a mesh): FULL_SHARD over every dp rank, as before
  tp_hsdp.fsdp->reshard_after_forward.reset();
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, tp_hsdp, 8).hybrid_shard_size, 0);
  // cp 8: FULL_SHARD over dp_shard x cp, each block checkpointed.
  auto cp = load_config((dir / "accelerate_nd_parallel_cp.yaml").string()).settings();
  ASSERT_TRUE(cp.fsdp && cp.parallelism);
  EXPECT_EQ(cp.parallelism->cp, 8);
  EXPECT_TRUE(cp.fsdp->activation_checkpointing);
  EXPECT_EQ(cp.mixed_precision, MixedPrecision::BF16);
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, cp, 8).stage, 3);
  EXPECT_EQ(xlr8::shard::resolve_zero_options({}, cp, 8).hybrid_shard_size, 0);
}

TEST(AccelerateConfigs, WhatTheAcceptedFilesSayIsWhatTheWorkersGet) {
  const fs::path dir = fs::path(XLR8_SOURCE_DIR) / "tests/data/accelerate_configs";
  auto fsdp2 = load_config((dir / "fsdp_v2.yaml").string());
  ASSERT_EQ(fsdp2.distributed_type, DistributedType::FSDP);
  EXPECT_EQ(fsdp2.fsdp.version, 2);
  auto z2 = load_config((dir / "ds_nofile_z2.yaml").string());
  EXPECT_EQ(z2.deepspeed.zero_stage, 2);
  EXPECT_EQ(z2.deepspeed.offload_optimizer_device, "cpu");
  EXPECT_EQ(z2.gradient_accumulation_steps, 4);
  auto ds_file = load_config((dir / "ds_file.yaml").string());
  EXPECT_EQ(ds_file.deepspeed.config_file, "/path/ds_config.json");
  auto node = load_config((dir / "multi_node_gpu.yaml").string());
  EXPECT_EQ(node.num_machines, 2);
  EXPECT_EQ(node.machine_rank, 1);
  EXPECT_EQ(node.main_process_ip, "10.0.0.1");
  EXPECT_EQ(node.rdzv_backend, "c10d");
  // Accelerate's latest.yaml carries `accelerate tpu-config`'s keys but selects no TPU: one process, no strategy.
  auto latest = load_config((dir / "accelerate_tests_latest.yaml").string());
  EXPECT_EQ(latest.distributed_type, DistributedType::NO);
  EXPECT_EQ(latest.num_processes, 1);
  EXPECT_EQ(latest.settings(), Settings{});
  auto mpi = load_config((dir / "accelerate_tests_0_28_0_mpi.yaml").string());  // mpirun starts 16 over 4 machines
  EXPECT_EQ(mpi.mpirun_hostfile, "/home/user/hostfile");
  EXPECT_EQ(mpi.processes_per_machine(), 4);
  EXPECT_EQ(load_config((dir / "multi_cpu.yaml").string()).mpirun_hostfile, "");
  auto basic = load_config((dir / "basic_ngpu0.yaml").string());  // JSON text in a .yaml file
  EXPECT_TRUE(basic.use_cpu);
  EXPECT_EQ(basic.distributed_type, DistributedType::NO);
}

TEST(AccelerateConfigs, OlderVersionsShapesLoad) {
  // Accelerate <= 0.17: nulls and empty sections; <= 0.5: fp16; 0.15-0.16: top-level dynamo_backend;
  // 0.19-1.12: ipex_config; 0.7-0.11: FSDP keys without the prefix; tests' fsdp_ignored_modules: null.
  auto c = parse_config(R"(compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: FSDP
downcast_bf16: 'no'
dynamo_backend: 'NO'
fp16: true
fsdp_config:
  sharding_strategy: 2
  offload_params: false
  min_num_params: 2000
  transformer_layer_cls_to_wrap: Block
  fsdp_ignored_modules: null
gpu_ids: null
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: null
main_process_port: null
megatron_lm_config: {}
mpirun_config:
  mpirun_ccl: 1
num_machines: 1
num_processes: 2
tp_config:
  tp_size: 1
use_cpu: true
)");
  EXPECT_EQ(c.mixed_precision, MixedPrecision::FP16);
  EXPECT_EQ(c.fsdp.sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  EXPECT_EQ(c.fsdp.min_num_params, 2000);
  EXPECT_EQ(c.fsdp.transformer_layer_cls_to_wrap, std::vector<std::string>{"Block"});
  // dp-only parallelism_config, as Accelerate writes it with its comm strategy.
  auto p = parse_config(R"(distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
num_processes: 4
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 1
  parallelism_config_cp_size: 1
  parallelism_config_cp_comm_strategy: allgather
)");
  ASSERT_TRUE(p.parallelism);
  EXPECT_EQ(p.parallelism->dp_replicate, 2);
  // A 4-D mesh with context parallelism on the ring.
  auto four = parse_config(R"(distributed_type: FSDP
num_processes: 16
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 2
  parallelism_config_cp_comm_strategy: alltoall
)").settings();
  ASSERT_TRUE(four.parallelism);
  EXPECT_EQ(four.parallelism->cp, 2);
  EXPECT_EQ(four.parallelism->cp_comm_strategy, "alltoall");
  EXPECT_EQ(four.parallelism->total(), 16);
  // Ulysses as Accelerate's sequence-parallelism guide writes it (dp_shard 2 x sp 2 on 4 processes).
  auto ulysses = parse_config(R"(distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
mixed_precision: bf16
num_processes: 4
parallelism_config:
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
  parallelism_config_dp_shard_size: 2
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
)").settings();
  ASSERT_TRUE(ulysses.parallelism);
  EXPECT_EQ(ulysses.parallelism->sp, 2);
  EXPECT_EQ(ulysses.parallelism->cp, 1);
  EXPECT_TRUE(ulysses.parallelism->sp_seq_length_is_variable);
  EXPECT_EQ(ulysses.parallelism->total(), 4);
  auto fixed = parse_config("num_processes: 2\nparallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_seq_length: "
                            "256\n  parallelism_config_sp_seq_length_is_variable: false\n")
                   .settings();
  EXPECT_EQ(fixed.parallelism->sp_seq_length, 256);
  EXPECT_FALSE(fixed.parallelism->sp_seq_length_is_variable);
  EXPECT_EQ(settings_from_env(Env(settings_to_env(fixed))), fixed);
}

// Found running the real `accelerate launch` (1.16) beside xlr8 launch on the same files and flags.
TEST(AccelerateConfigs, TheShardingStrategyKeyWinsOverAStrategyUnderReshardAndFsdp2DefaultsToShardedStateDicts) {
  auto both = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: FULL_SHARD\n"
                           "  fsdp_sharding_strategy: SHARD_GRAD_OP\n");
  EXPECT_EQ(both.fsdp.sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  auto questionnaire = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: NO_SHARD\n");
  EXPECT_EQ(questionnaire.fsdp.sharding_strategy, ShardingStrategy::NO_SHARD);
  EXPECT_EQ(questionnaire.fsdp.state_dict_type, "FULL_STATE_DICT");
  auto v2 = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n");
  EXPECT_EQ(v2.fsdp.state_dict_type, "SHARDED_STATE_DICT");
  auto v2_full = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: FULL_STATE_DICT\n");
  EXPECT_EQ(v2_full.fsdp.state_dict_type, "FULL_STATE_DICT");
  auto numbered = parse_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: 2\n");
  EXPECT_EQ(numbered.fsdp.state_dict_type, "LOCAL_STATE_DICT");
  // Accelerate's one context-parallel backend is accepted; another is refused by name.
  EXPECT_NO_THROW(parse_config("parallelism_config:\n  parallelism_config_cp_backend: torch\n", "cp.yaml"));
  EXPECT_THROW(parse_config("parallelism_config:\n  parallelism_config_cp_backend: deepspeed\n", "cp.yaml"), ConfigError);
}

TEST(AccelerateConfigs, KeysThatTurnOnMissingFeaturesAreRefusedByName) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"tpu_use_sudo: 'yes'\n", {"tpu_use_sudo", "yes", "TPU"}},
      {"tpu_vm:\n- my-vm\n", {"tpu_vm", "my-vm", "TPU"}},
      {"downcast_bf16: 'yes'\n", {"downcast_bf16", "TPU"}},
      {"dynamo_backend: INDUCTOR\n", {"dynamo_backend", "INDUCTOR", "torch.compile"}},
      {"ipex_config:\n  ipex: true\n", {"ipex_config.ipex", "true", "Intel Extension"}},
      {"use_mps_device: true\n", {"use_mps_device", "MPS"}},
      {"tp_config:\n  tp_size: 2\n", {"tp_config.tp_size", "2", "tensor parallelism"}},
      {"distributed_type: TP\n", {"distributed_type", "TP", "tensor parallelism"}},
      {"distributed_type: MPS\n", {"distributed_type", "MPS"}},
      {"fsdp_config:\n  fsdp_ignored_modules: [head]\n", {"fsdp_config.fsdp_ignored_modules", "head"}},
      {"deepspeed_config:\n  deepspeed_moe_layer_cls_names: MoEBlock\n", {"deepspeed_moe_layer_cls_names", "MoEBlock"}},
      {"parallelism_config:\n  parallelism_config_sp_attn_implementation: flash_attention_2\n",
       {"parallelism_config_sp_attn_implementation", "flash_attention_2", "sdpa"}},
      {"parallelism_config:\n  parallelism_config_sp_backend: torch\n", {"parallelism_config_sp_backend", "deepspeed"}},
      {"parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_seq_length_is_variable: false\n",
       {"parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_seq_length is not set"}},
      {"parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_seq_length: 255\n",
       {"parallelism_config_sp_seq_length", "255", "not divisible by parallelism_config_sp_size 2"}},
      {"parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_cp_size: 2\n",
       {"parallelism_config_sp_size 2", "parallelism_config_cp_size 2", "set one of them to 1"}},
      {"parallelism_config:\n  parallelism_config_cp_comm_strategy: ring\n",
       {"parallelism_config_cp_comm_strategy", "\"ring\"", "allgather, alltoall"}},
      {"dynamo_config:\n  dynamo_bakend: NO\n", {"dynamo_config.dynamo_bakend", "did you mean"}},
  };
  for (const auto& [yaml, pieces] : cases) {
    auto m = error_of_text(yaml);
    ASSERT_FALSE(m.empty()) << yaml;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    for (const auto& piece : pieces) EXPECT_NE(m.find(piece), std::string::npos) << yaml << " -> " << m;
  }
  // The same keys left off load silently.
  EXPECT_EQ(error_of_text("tpu_use_sudo: 'no'\ntpu_vm:\n- ''\ndowncast_bf16: false\ndynamo_config:\n  dynamo_backend: NO\n"
                          "use_mps_device: false\ndeepspeed_config:\n  deepspeed_multinode_launcher: pdsh\n"),
            "");
}

namespace {

// The message of the ConfigError plan_launch throws for `r`, or "" when it throws none.
std::string launch_error(const LaunchRequest& r) {
  return error_of([&] { plan_launch(r); });
}

}  // namespace

// What a user types twice, or wrongly, at the launch: the flag's accumulation wins over the file's DeepSpeed section
// (Accelerate keeps an explicit flag); torchrun's and Accelerate's counts must agree; a directory or a file that is not
// a mapping, or with a key written twice, is refused naming it; an old file's unprefixed FSDP key gives way to the
// --fsdp_* flag.
TEST(LaunchPlan, WhatIsGivenTwiceOrWronglyIsDecidedOrRefusedInOneLine) {
  const auto dir = std::filesystem::temp_directory_path() / ("xlr8_plan_twice_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto file = [&](const std::string& name, const std::string& text) {
    const auto path = (dir / name).string();
    std::ofstream(path) << text;
    return path;
  };
  LaunchRequest r;
  r.command = {"prog"};
  r.config_file = file("ds.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 4\n  zero_stage: 2\nnum_processes: 16\n");
  r.num_machines = 1;
  r.num_processes = 2;
  r.gradient_accumulation_steps = 3;
  EXPECT_EQ(plan_launch(r).settings.gradient_accumulation_steps, 3);
  r.deepspeed["gradient_clipping"] = "-1";  // refused as a DeepSpeed JSON's is, not taken as no clipping
  EXPECT_NE(launch_error(r).find("value -1 must be >= 0 (0 disables clipping)"), std::string::npos) << launch_error(r);

  LaunchRequest counts;
  counts.command = {"prog"};
  counts.config_file = "";
  counts.nproc_per_node = 2;
  counts.num_processes = 3;
  EXPECT_NE(launch_error(counts).find("--nproc_per_node 2 on 1 machine(s) is 2 processes, but --num_processes is 3"),
            std::string::npos)
      << launch_error(counts);
  counts.num_processes = 2;
  EXPECT_EQ(launch_error(counts), "");
  counts.nnodes = "2";
  counts.num_machines = 3;
  EXPECT_NE(launch_error(counts).find("--nnodes 2 and --num_machines 3 disagree"), std::string::npos) << launch_error(counts);
  counts.num_machines.reset();
  counts.nnodes.reset();
  counts.num_processes.reset();
  counts.nproc_per_node = 0;
  EXPECT_NE(launch_error(counts).find("--nproc_per_node 0 must be at least 1"), std::string::npos) << launch_error(counts);

  LaunchRequest files;
  files.command = {"prog"};
  files.config_file = dir.string();
  EXPECT_NE(launch_error(files).find("is a directory: give the YAML file"), std::string::npos) << launch_error(files);
  files.config_file = file("scalar.yaml", "hello\n");
  EXPECT_NE(launch_error(files).find("must be a mapping of keys to values (such as `num_processes: 2`), not a single value"),
            std::string::npos)
      << launch_error(files);
  files.config_file = file("fsdp_yes.yaml", "distributed_type: FSDP\nfsdp_config: yes\n");  // named once, with its value
  EXPECT_NE(launch_error(files).find("fsdp_yes.yaml: fsdp_config must be a mapping of key: value, not \"yes\""),
            std::string::npos)
      << launch_error(files);
  files.config_file = file("list.yaml", "- a\n");
  EXPECT_NE(launch_error(files).find("not a list"), std::string::npos) << launch_error(files);

  files.config_file = file("twice.yaml", "num_processes: 2\nnum_processes: 3\n");  // PyYAML reads 3, yaml-cpp 2
  EXPECT_NE(launch_error(files).find("twice.yaml: key num_processes is written twice with different values (lines 1 and 2); keep one"),
            std::string::npos)
      << launch_error(files);
  files.config_file = file("twice_nested.yaml", "fsdp_config:\n  fsdp_version: 1\n  fsdp_version: 2\n");
  EXPECT_NE(launch_error(files).find("key fsdp_config.fsdp_version is written twice with different values (lines 2 and 3)"), std::string::npos)
      << launch_error(files);
  files.config_file = file("twice_in_list.yaml", "tpu_env:\n- {A: 1, A: 2}\n");  // inside a list too
  EXPECT_NE(launch_error(files).find("key tpu_env[0].A is written twice with different values (lines 2 and 2)"),
            std::string::npos)
      << launch_error(files);
  files.config_file = file("same_twice.yaml", "num_processes: 2\nnum_processes: 2\n");  // one meaning: loads
  EXPECT_EQ(launch_error(files), "");
  files.num_processes = 3;  // and a flag sets its one entry
  EXPECT_EQ(plan_launch(files).nproc_per_node, 3);
  files.num_processes.reset();
  files.config_file = file("old_fsdp.yaml", "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: 1\nnum_processes: 2\n");
  ASSERT_TRUE(plan_launch(files).settings.fsdp);
  EXPECT_EQ(plan_launch(files).settings.fsdp->sharding_strategy, ShardingStrategy::FULL_SHARD);
  files.fsdp["fsdp_sharding_strategy"] = "SHARD_GRAD_OP";
  EXPECT_EQ(plan_launch(files).settings.fsdp->sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  // A strategy's flag on a launch of another did nothing, silently (disk offload under DDP wrote no swap file).
  LaunchRequest ddp;
  ddp.command = {"prog"};
  ddp.config_file = file("ddp.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n");
  ddp.deepspeed["offload_optimizer_device"] = "nvme";
  EXPECT_NE(launch_error(ddp).find("--offload_optimizer_device is a DeepSpeed option, but this launch is MULTI_GPU: add "
                                   "--use_deepspeed"),
            std::string::npos)
      << launch_error(ddp);
  ddp.deepspeed.clear();
  ddp.fsdp["fsdp_offload_params"] = "true";
  EXPECT_NE(launch_error(ddp).find("--fsdp_offload_params is an FSDP option, but this launch is MULTI_GPU"),
            std::string::npos)
      << launch_error(ddp);
  ddp.use_fsdp = true;
  EXPECT_EQ(launch_error(ddp), "");
  // A micro-batch count alone (pipeline_step without stages) leaves the mesh every launch has without the section:
  // FSDP's ranks sharded, the others replicas. It was a mesh of 1 that a launch of 2 refused.
  ddp.fsdp.clear();
  ddp.parallelism["parallelism_config_pp_microbatches"] = "3";
  ASSERT_EQ(launch_error(ddp), "");
  EXPECT_EQ(plan_launch(ddp).settings.parallelism->dp_shard, 2);
  ddp.use_fsdp = false;
  EXPECT_EQ(plan_launch(ddp).settings.parallelism->dp_replicate, 2);
  EXPECT_EQ(plan_launch(ddp).settings.parallelism->pp_microbatches, 3);
  std::filesystem::remove_all(dir);
}

// `xlr8 config` writes what Accelerate (PyYAML, YAML 1.1) reads back as written: distributed_type NO quoted, since
// a bare NO is false there; a directory given as the file is refused and leaves nothing behind.
TEST(Config, SavedFileQuotesNoAndRefusesADirectory) {
  const auto dir = std::filesystem::temp_directory_path() / ("xlr8_cfg_no_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto c = parse_config("distributed_type: 'NO'\nnum_processes: 1\n");
  save_config(c, (dir / "c.yaml").string());
  std::ifstream in(dir / "c.yaml");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("distributed_type: 'NO'\n"), std::string::npos) << text;
  EXPECT_EQ(load_config((dir / "c.yaml").string()).distributed_type, DistributedType::NO);
  try {
    save_config(c, dir.string());
    ADD_FAILURE() << "a directory was taken as the config file";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("it is a directory; give a file's path"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.string() + ".tmp"));
  std::filesystem::remove_all(dir);
}
