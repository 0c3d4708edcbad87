// `xlr8 env`: what a bug report needs: versions, BLAS actually loaded, backends, cores, GPUs, config.
#include <ATen/Version.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "cli/commands.hpp"
#include "compat/torch_compat.hpp"
#include "xlr8/config.hpp"
#include "xlr8/env.hpp"

namespace xlr8::cli {
namespace {

// The CPU BLAS that runs a CPU matmul: a library mapped after one (a Debian LibTorch's OpenBLAS), else the one
// built into LibTorch (the wheels link MKL statically; their cuBLAS is mapped too, but it is the GPUs').
std::string loaded_blas() {
  auto a = at::ones({64, 64});
  (void)at::mm(a, a);
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> libs;
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    std::string name = std::filesystem::path(path).filename();
    if ((name.find("blas") != std::string::npos || name.find("mkl") != std::string::npos) &&
        name.find("cublas") == std::string::npos)
      libs.insert(std::filesystem::canonical(path).string());
  }
  std::string out;
  for (auto& l : libs) out += (out.empty() ? "" : ", ") + l;
  if (!out.empty()) return out;
  const std::string config = at::show_config();
  auto info = config.find("BLAS_INFO=");
  if (info == std::string::npos) return "none found";
  return "built into LibTorch (" + config.substr(info, config.find_first_of(",\n", info) - info) + ")";
}

}  // namespace

Handler add_env(CLI::App& app) {
  auto* cmd = app.add_subcommand("env", "Print versions, backends, hardware and the active config");
  auto path = std::make_shared<std::string>();
  cmd->add_option("--config_file,--config-file", *path, "Config file to show (default: the default config)");
  return [=]() {
    fmt::print("- xlr8 version: {}\n", XLR8_VERSION);
    fmt::print("- LibTorch version: {}\n", compat::torch_version());
    fmt::print("- BLAS in use: {}\n", loaded_blas());
    // This process's count is not what a worker gets: the launcher sets OMP_NUM_THREADS per worker.
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const auto omp = env_var("OMP_NUM_THREADS");
    fmt::print("- intra-op threads: {} in this `xlr8 env` process; a worker started by `xlr8 launch` gets {}\n",
               at::get_num_threads(),
               omp ? fmt::format("OMP_NUM_THREADS={} (set in this environment)", *omp)
                           : fmt::format("cores / local workers ({} with 1 worker, {} with 2; OMP_NUM_THREADS or "
                                         "--num_cpu_threads_per_process override it)",
                                         cores, std::max(1u, cores / 2)));
    fmt::print("- Gloo: available\n");
    fmt::print("- NCCL: {}\n", compat::kHaveNccl ? "available (built with NCCL)" : "not built (CPU LibTorch)");
    fmt::print("- CPU cores: {}\n", std::thread::hardware_concurrency());
    fmt::print("- GPUs: {}\n", compat::cuda_device_count());
    std::string config = path->empty() ? default_config_path() : *path;
    if (std::filesystem::exists(config)) {
      fmt::print("- config ({}):\n", config);
      std::ifstream in(config);
      std::string line;
      while (std::getline(in, line)) fmt::print("    {}\n", line);
    } else {
      fmt::print("- config: none ({} does not exist)\n", config);
    }
    return 0;
  };
}

}  // namespace xlr8::cli
