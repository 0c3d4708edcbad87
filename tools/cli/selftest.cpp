// `xlr8 test`: launches the self-check on N processes through the real launcher and reports pass/fail.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <climits>

#include "cli/commands.hpp"
#include "compat/torch_compat.hpp"
#include "distributed/self_check.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/error.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/process_state.hpp"

namespace xlr8::cli {
namespace {

std::string self_path() {
  char buffer[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) throw Error("cannot find the xlr8 executable through /proc/self/exe");
  return std::string(buffer, static_cast<size_t>(n));
}

CheckResult mesh_check(const ProcessState& state) {
  CheckResult result{"device_mesh dp_replicate x dp_shard all_reduce", false, ""};
  try {
    int P = state.world_size();
    ParallelismSettings sizes;
    sizes.dp_replicate = P % 2 == 0 ? 2 : 1;
    sizes.dp_shard = P / sizes.dp_replicate;
    DeviceMesh mesh(state.world(), MeshLayout::from(sizes, P));
    auto x = at::full({3}, state.rank(), at::kLong);
    mesh.group(MeshDim::dp_shard).all_reduce(x);
    long want = 0;
    for (int r : mesh.layout().group_ranks(state.rank(), MeshDim::dp_shard)) want += r;
    result.ok = x[0].item<long>() == want && mesh.group(MeshDim::dp).size() == P;
    if (!result.ok) result.detail = fmt::format("got {} want {}", x[0].item<long>(), want);
  } catch (const std::exception& e) {
    result.detail = e.what();
  }
  return result;
}

}  // namespace

Handler add_test(CLI::App& app) {
  auto* cmd = app.add_subcommand("test", "Run the collective self-check on N local processes");
  auto req = std::make_shared<LaunchRequest>();
  cmd->add_option("--num_processes,--num-processes", req->num_processes, "Processes (default 2)");
  cmd->add_option("--config_file,--config-file", req->config_file, "Config file for the launch");
  return [req]() {
    if (!req->num_processes) req->num_processes = 2;
    req->command = {self_path(), "selftest"};
    auto options = plan_launch(*req);
    int code = launch(options);
    fmt::print("xlr8 test: {}\n", code == 0 ? "PASSED" : fmt::format("FAILED (exit code {})", code));
    return code;
  };
}

Handler add_selftest_worker(CLI::App& app) {
  app.add_subcommand("selftest", "The self-check worker: run it under `xlr8 launch` (what `xlr8 test` does)");
  return []() {
    const auto& state = ProcessState::instance();
    auto results = run_collective_checks(state.world());  // CPU tensors: the Gloo paths
    if (state.device() != "cpu") {                        // CUDA tensors: the NCCL paths
      auto device_results = run_collective_checks(state.world(), state.device());
      results.insert(results.end(), device_results.begin(), device_results.end());
    }
    results.push_back(mesh_check(state));
    nlohmann::json mine = nlohmann::json::array();
    for (auto& r : results) mine.push_back({{"name", r.name}, {"ok", r.ok}, {"detail", r.detail}});
    auto all = state.world().all_gather_object(mine.dump());
    int failures = 0;
    if (state.is_main_process()) {
      for (size_t i = 0; i < results.size(); ++i) {
        std::vector<std::string> bad;
        for (int r = 0; r < state.world_size(); ++r) {
          auto entry = nlohmann::json::parse(all[r])[i];
          if (!entry["ok"].get<bool>()) bad.push_back(fmt::format("rank {}: {}", r, entry["detail"].get<std::string>()));
        }
        failures += bad.empty() ? 0 : 1;
        fmt::print("{} {}\n", bad.empty() ? "PASS" : "FAIL", results[i].name);
        for (auto& b : bad) fmt::print("     {}\n", b);
      }
      fmt::print("{} checks on {} ranks ({} backend{}, LibTorch {}): {} failed\n", results.size(), state.world_size(),
                 state.backend(), state.world().uses_shared_memory() ? " + shared memory for CPU tensors" : "",
                 compat::torch_version(), failures);
    }
    int any = failures;
    auto flag = at::full({1}, any, at::kInt);
    state.world().all_reduce(flag, ReduceOp::MAX);
    state.world().barrier();  // rank 0 serves the store: nobody leaves while others still use it
    return flag.item<int>() ? 1 : 0;
  };
}

}  // namespace xlr8::cli
