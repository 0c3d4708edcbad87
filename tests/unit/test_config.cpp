// The launch config file: Accelerate-written YAML loads unchanged; bad input names key, value and fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "xlr8/config.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/trackers.hpp"

using namespace xlr8;

namespace {

// As written by `accelerate config` (Accelerate's own FSDP template).
const char* kAccelerateFsdp = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: GPT2Block
  fsdp_use_orig_params: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
)";

// An older Accelerate multi-CPU file: empty sections, nulls and ipex_config.
const char* kAccelerateMultiCpu = R"(compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_CPU
downcast_bf16: 'no'
fsdp_config: {}
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
)";

const char* kAccelerateDeepSpeed = R"(compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 2
main_process_ip: 10.1.2.3
main_process_port: 29555
num_processes: 16
rdzv_backend: static
same_network: true
use_cpu: false
)";

std::string error_of(const std::string& yaml) {
  try {
    parse_config(yaml, "test.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, AccelerateFsdpFileLoadsUnchanged) {
  auto c = parse_config(kAccelerateFsdp);
  EXPECT_EQ(c.distributed_type, DistributedType::FSDP);
  EXPECT_EQ(c.mixed_precision, MixedPrecision::BF16);
  EXPECT_EQ(c.num_processes, 8);
  EXPECT_EQ(c.fsdp.state_dict_type, "SHARDED_STATE_DICT");
  EXPECT_EQ(c.fsdp.transformer_layer_cls_to_wrap, std::vector<std::string>{"GPT2Block"});
  EXPECT_FALSE(c.fsdp.use_orig_params);
  auto s = c.settings();
  ASSERT_TRUE(s.fsdp);
  EXPECT_FALSE(s.deepspeed);
  EXPECT_EQ(settings_to_env(s).at("FSDP_STATE_DICT_TYPE"), "SHARDED_STATE_DICT");
}

TEST(Config, AccelerateMultiCpuFileLoadsUnchanged) {
  auto c = parse_config(kAccelerateMultiCpu);
  EXPECT_EQ(c.distributed_type, DistributedType::MULTI_CPU);
  EXPECT_EQ(c.num_processes, 2);
  EXPECT_TRUE(c.use_cpu);
  EXPECT_FALSE(c.main_process_port);
  EXPECT_FALSE(c.ignored_keys.empty());  // ipex_config, megatron_lm_config: accepted, no effect
}

TEST(Config, AccelerateDeepSpeedFileLoadsUnchanged) {
  auto c = parse_config(kAccelerateDeepSpeed);
  EXPECT_EQ(c.deepspeed.zero_stage, 3);
  EXPECT_EQ(c.deepspeed.offload_optimizer_device, "cpu");
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(c.processes_per_machine(), 8);
  EXPECT_EQ(*c.main_process_port, 29555);
  auto env = settings_to_env(c.settings());
  EXPECT_EQ(env.at("ACCELERATE_DEEPSPEED_ZERO_STAGE"), "3");
  EXPECT_EQ(env.at("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), "4");
  EXPECT_EQ(env.at("ACCELERATE_GRADIENT_CLIPPING"), "1");
}

TEST(Config, UnknownKeyNamesClosestValidOne) {
  auto m = error_of("num_proceses: 2\n");
  EXPECT_NE(m.find("unknown key \"num_proceses\""), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean \"num_processes\""), std::string::npos) << m;
  m = error_of("fsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n");
  EXPECT_NE(m.find("fsdp_config.fsdp_sharding_stratgy"), std::string::npos) << m;
  EXPECT_NE(m.find("fsdp_config.fsdp_sharding_strategy"), std::string::npos) << m;
}

// Two typos in one file: both named in one error, each with its closest key, the sections' as the top level's.
TEST(Config, EveryUnknownKeyOfAFileIsNamedAtOnce) {
  const auto m = error_of("num_proceses: 2\nmixed_precison: bf16\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n");
  EXPECT_NE(m.find("unknown key \"num_proceses\" (did you mean \"num_processes\"?)"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown key \"mixed_precison\" (did you mean \"mixed_precision\"?)"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown key \"fsdp_config.fsdp_sharding_stratgy\""), std::string::npos) << m;
}

TEST(Config, WrongTypeOrValueNamesKeyValueAndAllowed) {
  auto m = error_of("num_processes: two\n");
  EXPECT_NE(m.find("num_processes"), std::string::npos) << m;
  EXPECT_NE(m.find("\"two\""), std::string::npos) << m;
  m = error_of("mixed_precision: fp32\n");
  EXPECT_NE(m.find("fp32"), std::string::npos) << m;
  EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  m = error_of("distributed_type: XLA\n");
  EXPECT_NE(m.find("distributed_type"), std::string::npos) << m;
  EXPECT_NE(m.find("MULTI_CPU"), std::string::npos) << m;
  m = error_of("deepspeed_config:\n  zero_stage: 4\n");
  EXPECT_NE(m.find("deepspeed_config.zero_stage"), std::string::npos) << m;
  EXPECT_NE(m.find("[0, 3]"), std::string::npos) << m;
  m = error_of("use_cpu: perhaps\n");
  EXPECT_NE(m.find("use_cpu"), std::string::npos) << m;
  m = error_of("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARDS\n");
  EXPECT_NE(m.find("did you mean \"FULL_SHARD\""), std::string::npos) << m;
  EXPECT_NE(m.find("fsdp_config.fsdp_sharding_strategy: invalid value \"FULL_SHARDS\""), std::string::npos) << m;
  EXPECT_EQ(m.find(": :"), std::string::npos) << m;
  m = error_of("num_processes: [1, 2]\n");
  EXPECT_NE(m.find("num_processes"), std::string::npos) << m;
  m = error_of("log_with: csv, tensorbord\n");
  EXPECT_NE(m.find("log_with: value \"tensorbord\" is not a tracker; allowed: jsonl, csv, tensorboard, all (did you "
                   "mean \"tensorboard\"?)"),
            std::string::npos)
      << m;
  // Every tracker xlr8 builds in is accepted.
  for (const auto& name : builtin_trackers()) EXPECT_EQ(parse_config("log_with: " + name + "\n", "t.yaml").log_with, name);
  m = error_of("num_processes: 2\n  bad indent: 1\n");
  EXPECT_NE(m.find("not valid YAML"), std::string::npos) << m;
}

TEST(Config, InconsistentSettingsRejected) {
  auto m = error_of("num_machines: 2\nmachine_rank: 2\nmain_process_ip: h\nnum_processes: 4\n");
  EXPECT_NE(m.find("machine_rank 2 must be below num_machines 2"), std::string::npos) << m;
  m = error_of("num_machines: 2\nnum_processes: 3\nmain_process_ip: h\n");
  EXPECT_NE(m.find("not divisible"), std::string::npos) << m;
  m = error_of("num_machines: 2\nnum_processes: 4\n");
  EXPECT_NE(m.find("main_process_ip is required"), std::string::npos) << m;
  m = error_of("num_processes: 4\nparallelism_config:\n  parallelism_config_dp_shard_size: 3\n");
  EXPECT_NE(m.find("multiply to 3"), std::string::npos) << m;
}

TEST(Config, SaveAndLoadRoundTrip) {
  auto dir = std::filesystem::temp_directory_path() / ("xlr8_cfg_" + std::to_string(getpid()));
  auto path = (dir / "nested" / "default_config.yaml").string();
  for (const char* text : {kAccelerateFsdp, kAccelerateDeepSpeed, kAccelerateMultiCpu}) {
    auto c = parse_config(text);
    save_config(c, path);
    auto back = load_config(path);
    EXPECT_EQ(back.settings(), c.settings());
    EXPECT_EQ(back.num_processes, c.num_processes);
    EXPECT_EQ(back.num_machines, c.num_machines);
    EXPECT_EQ(back.main_process_port, c.main_process_port);
  }
  std::filesystem::remove_all(dir);
}

TEST(Config, MissingFileSaysHowToCreateOne) {
  try {
    load_config("/nonexistent/x.yaml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("xlr8 config"), std::string::npos);
  }
}

TEST(LaunchPlan, FlagsOverrideConfigFile) {
  auto dir = std::filesystem::temp_directory_path() / ("xlr8_plan_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto path = (dir / "c.yaml").string();
  std::ofstream(path) << kAccelerateDeepSpeed;
  LaunchRequest r;
  r.config_file = path;
  r.command = {"prog"};
  auto o = plan_launch(r);
  EXPECT_EQ(o.nproc_per_node, 8);
  EXPECT_EQ(o.num_machines, 2);
  EXPECT_EQ(o.master_addr, "10.1.2.3");
  EXPECT_EQ(o.master_port, 29555);
  ASSERT_TRUE(o.settings.deepspeed);
  EXPECT_EQ(o.settings.deepspeed->zero_stage, 3);

  r.num_processes = 4;
  r.machine_rank = 1;
  r.deepspeed["zero_stage"] = "1";
  r.mixed_precision = "bf16";
  o = plan_launch(r);
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_EQ(o.machine_rank, 1);
  EXPECT_EQ(o.settings.deepspeed->zero_stage, 1);
  EXPECT_EQ(o.settings.mixed_precision, MixedPrecision::BF16);

  r.deepspeed["zero_stage"] = "7";
  EXPECT_THROW(plan_launch(r), ConfigError);
  std::filesystem::remove_all(dir);
}

// The message of the ConfigError plan_launch throws for `r`, or "" when it throws none.
std::string plan_error(const LaunchRequest& r) {
  try {
    plan_launch(r);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchPlan, ElasticRendezvousFlagsAsTorchrunHasThemAndTheirErrors) {
  LaunchRequest r;
  r.config_file = "";
  r.command = {"prog"};
  r.nproc_per_node = 2;
  r.nnodes = "1:4";
  EXPECT_NE(plan_error(r).find("--nnodes 1:4 is a range, which needs the elastic rendezvous: add --rdzv_backend c10d"),
            std::string::npos);
  r.rdzv_backend = "c10d";
  EXPECT_NE(plan_error(r).find("needs --rdzv_endpoint host[:port]"), std::string::npos);
  r.rdzv_endpoint = "node7";
  r.rdzv_id = "job42";
  r.rdzv_conf = "join_timeout=20,last_call_timeout=0.5,keep_alive_interval=2,keep_alive_max_attempt=4,close_timeout=9";
  auto o = plan_launch(r);
  ASSERT_TRUE(o.elastic);
  EXPECT_EQ(o.elastic->min_nodes, 1);
  EXPECT_EQ(o.elastic->max_nodes, 4);
  EXPECT_EQ(o.elastic->endpoint_host, "node7");
  EXPECT_EQ(o.elastic->endpoint_port, 29400);  // torchrun's default c10d port
  EXPECT_EQ(o.elastic->run_id, "job42");
  EXPECT_EQ(o.run_id, "job42");  // TORCHELASTIC_RUN_ID
  EXPECT_EQ(o.elastic->join_timeout_s, 20);
  EXPECT_EQ(o.elastic->last_call_timeout_s, 0.5);
  EXPECT_EQ(o.elastic->keep_alive_interval_s, 2);
  EXPECT_EQ(o.elastic->keep_alive_max_attempt, 4);
  EXPECT_EQ(o.elastic->close_timeout_s, 9);
  EXPECT_EQ(o.nproc_per_node, 2);
  r.rdzv_endpoint = "node7:29999";
  EXPECT_EQ(plan_launch(r).elastic->endpoint_port, 29999);
  r.rdzv_endpoint = "node7:http";
  EXPECT_NE(plan_error(r).find("--rdzv_endpoint \"node7:http\": \"http\" is not a TCP port"), std::string::npos);
  r.rdzv_endpoint = "node7";
  r.rdzv_conf = "join_timeout=soon";
  EXPECT_NE(plan_error(r).find("--rdzv_conf join_timeout=\"soon\": give a positive number of seconds"), std::string::npos);
  r.rdzv_conf = "keep_alive_max_attempt=1";  // one missed beat would drop a live machine
  EXPECT_NE(plan_error(r).find("--rdzv_conf keep_alive_max_attempt=\"1\": give a whole number of 2 or more"),
            std::string::npos);
  r.rdzv_conf = "timeout=3";
  EXPECT_NE(plan_error(r).find("unknown key \"timeout\"; known: join_timeout"), std::string::npos);
  r.rdzv_conf.reset();
  r.nnodes = "4:2";
  EXPECT_NE(plan_error(r).find("the minimum 4 is above the maximum 2"), std::string::npos);
  r.nnodes = "two";
  EXPECT_NE(plan_error(r).find("--nnodes \"two\": give a number of machines N, or MIN:MAX"), std::string::npos);
  r.nnodes = "1:2";
  r.machine_rank = 1;
  EXPECT_NE(plan_error(r).find("the rendezvous assigns machine ranks; remove it"), std::string::npos);
  r.machine_rank.reset();
  r.nproc_per_node.reset();
  r.num_processes = 4;
  EXPECT_NE(plan_error(r).find("give --nproc_per_node"), std::string::npos);
  r.nproc_per_node = 2;
  r.rdzv_backend = "zookeeper";
  EXPECT_NE(plan_error(r).find("--rdzv_backend \"zookeeper\" is not supported: use c10d or etcd (elastic) or static"),
            std::string::npos);
  // etcd (torchrun's etcd-v2 name too): the members' addresses, and torchrun's etcd keys of --rdzv_conf.
  r.rdzv_backend = "etcd-v2";
  r.rdzv_endpoint = "http://10.0.0.1:2379/,10.0.0.2";
  r.rdzv_conf = "read_timeout=1.5,etcd_prefix=/jobs/,protocol=http,keep_alive_interval=2";
  o = plan_launch(r);
  ASSERT_TRUE(o.elastic);
  EXPECT_EQ(o.elastic->backend, "etcd");
  EXPECT_EQ(o.elastic->etcd_endpoints, (std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"}));
  EXPECT_EQ(o.elastic->etcd_timeout_s, 1.5);
  EXPECT_EQ(o.elastic->etcd_key_prefix, "/jobs");
  EXPECT_EQ(o.elastic->keep_alive_interval_s, 2);
  r.rdzv_conf = "read_timeout=3,keep_alive_interval=1";  // a lease of 3 s: one request could outlast it
  EXPECT_NE(plan_error(r).find("read_timeout=3 must be below the etcd lease's life"), std::string::npos);
  r.rdzv_conf = "keep_alive_interval=1";  // not given: a third of the lease's life
  EXPECT_EQ(plan_launch(r).elastic->etcd_timeout_s, 1);
  r.rdzv_conf = "cacert=/etc/ca.pem";
  EXPECT_NE(plan_error(r).find("--rdzv_conf cacert: TLS to etcd is not supported"), std::string::npos);
  r.rdzv_conf.reset();
  r.rdzv_endpoint = "https://10.0.0.1:2379";
  EXPECT_NE(plan_error(r).find("TLS to etcd is not supported; give its http client address"), std::string::npos);
  r.rdzv_endpoint.reset();
  EXPECT_NE(plan_error(r).find("--rdzv_backend etcd needs --rdzv_endpoint"), std::string::npos);
  // A fixed --nnodes N with the static backend is torchrun's plain multi-machine launch.
  r = LaunchRequest{};
  r.config_file = "";
  r.command = {"prog"};
  r.nproc_per_node = 2;
  r.nnodes = "3";
  r.machine_rank = 2;
  r.main_process_ip = "10.0.0.1";
  o = plan_launch(r);
  EXPECT_FALSE(o.elastic);
  EXPECT_EQ(o.num_machines, 3);
  EXPECT_EQ(o.world_size(), 6);
  r.rdzv_endpoint = "a:1";
  EXPECT_NE(plan_error(r).find("--rdzv_endpoint needs --rdzv_backend c10d"), std::string::npos);
}

TEST(LaunchPlan, TorchrunSpellingsAndDefaults) {
  LaunchRequest r;
  r.config_file = "";
  r.command = {"prog"};
  r.nproc_per_node = 3;
  r.num_machines = 2;
  r.main_process_ip = "127.0.0.1";
  auto o = plan_launch(r);
  EXPECT_EQ(o.nproc_per_node, 3);
  EXPECT_EQ(o.world_size(), 6);
  EXPECT_EQ(o.master_port, 29500);  // several machines must agree on a port
  r.use_fsdp = true;
  r.fsdp["fsdp_sharding_strategy"] = "SHARD_GRAD_OP";
  o = plan_launch(r);
  ASSERT_TRUE(o.settings.fsdp);
  EXPECT_EQ(o.settings.fsdp->sharding_strategy, ShardingStrategy::SHARD_GRAD_OP);
  r.machine_rank = 5;
  EXPECT_THROW(plan_launch(r), ConfigError);
}

// Ports from bind(0) are the kernel's ephemeral ones, which any process's next outgoing connection may take
// before rank 0 listens (a rendezvous failed so under ctest -j 2); picked ones lie below them, at random.
TEST(FreePort, PickedBelowTheKernelsEphemeralPortsAtRandomAndFree) {
  int first_ephemeral = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> first_ephemeral;
  ASSERT_GT(first_ephemeral, 10001) << "this machine's ephemeral ports start too low for the rule";
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    const int port = xlr8::pick_free_port();
    EXPECT_GE(port, 10000);
    EXPECT_LT(port, first_ephemeral);
    EXPECT_TRUE(xlr8::port_is_free(port)) << port;
    seen.insert(port);
  }
  EXPECT_GT(seen.size(), 15u);  // 20 draws from over 20,000 ports
}

// log_with names each tracker once (a name given twice wrote every value twice into one file), checks every name even
// after "all", and refuses a value naming none (it started no tracker, silently).
TEST(Trackers, LogWithNamesEachTrackerOnceChecksEveryNameAndRefusesNone) {
  EXPECT_EQ(parse_log_with("jsonl,jsonl, csv jsonl"), (std::vector<std::string>{"jsonl", "csv"}));
  EXPECT_EQ(parse_log_with("csv,all"), builtin_trackers());
  EXPECT_THROW(parse_log_with("all,bogus"), ConfigError);
  EXPECT_THROW(parse_log_with(" , "), ConfigError);
}
