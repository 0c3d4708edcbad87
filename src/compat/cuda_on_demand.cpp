// Loading xlr8's CUDA plugin where CUDA can run (cuda_on_demand.hpp).
#include "compat/cuda_on_demand.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <cstring>
#include <mutex>
#include <string>

#include "compat/cuda_plugin.hpp"
#include "xlr8/error.hpp"

namespace xlr8::compat {
namespace {

struct PluginState {
  std::mutex mutex;
  const CudaPlugin* plugin = nullptr;
  std::string failure;  // why the last attempt failed
};

PluginState& plugin_state() {
  static auto* state = new PluginState;  // never destroyed: used while the program starts and exits
  return *state;
}

#ifdef XLR8_WITH_NCCL
#ifndef XLR8_CUDA_PLUGIN_PATH  // CMake sets the build's path; otherwise the dynamic loader's search finds it
#define XLR8_CUDA_PLUGIN_PATH "libxlr8_cuda.so"
#endif
using PluginEntry = const CudaPlugin* (*)();

// Linked into the program (an installed package's consumers), or loaded from where this build put it.
const CudaPlugin* open_plugin(std::string& failure) {
  auto entry = reinterpret_cast<PluginEntry>(::dlsym(RTLD_DEFAULT, kCudaPluginEntry));
  const char* path = XLR8_CUDA_PLUGIN_PATH;
  if (!entry) {
    // Global: the CUDA kernels and hooks libtorch_cuda.so registers serve every library of the process.
    void* handle = ::dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
      failure = fmt::format("cannot load xlr8's CUDA plugin {}: {}", path, ::dlerror());
      return nullptr;
    }
    entry = reinterpret_cast<PluginEntry>(::dlsym(handle, kCudaPluginEntry));
    if (!entry) {
      failure = fmt::format("{} has no {}: not xlr8's CUDA plugin", path, kCudaPluginEntry);
      return nullptr;
    }
  }
  const CudaPlugin* plugin = entry();
  if (std::strcmp(plugin->torch_version, TORCH_VERSION) != 0 || plugin->layout != kCudaPluginLayout) {
    failure = fmt::format("xlr8's CUDA plugin ({}) was built against LibTorch {} (layout {}), this program against {} "
                          "(layout {}): rebuild both from one build",
                          path, plugin->torch_version, plugin->layout, TORCH_VERSION, kCudaPluginLayout);
    return nullptr;
  }
  return plugin;
}
#else
const CudaPlugin* open_plugin(std::string& failure) {
  failure = "this xlr8 build has no NCCL support (it was built against a LibTorch without CUDA, or without nccl.h)";
  return nullptr;
}
#endif

// The plugin, or null with `why` it did not load.
const CudaPlugin* load_plugin(std::string& why) {
  auto& s = plugin_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.plugin) s.plugin = open_plugin(s.failure);
  if (!s.plugin) why = s.failure;
  return s.plugin;
}

// While the program starts, before the program's other statics: LibTorch answers "no CUDA" for good to a question
// asked before its CUDA half is loaded (getCUDAHooks() keeps the first answer), and main() may ask.
struct LoadWhereItCanRun {
  LoadWhereItCanRun() {
    try {
      require_cuda_where_it_can_run();
    } catch (const Error&) {  // kept, and reported when the program asks for its GPUs
    }
  }
};
[[maybe_unused]] const LoadWhereItCanRun g_loaded_at_start __attribute__((init_priority(101)));

}  // namespace

bool cuda_driver_loads() {
#ifdef XLR8_WITH_NCCL
  // Kept loaded: CUDA's runtime opens it again.
  static const bool loads = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) != nullptr;
  return loads;
#else
  return false;  // a LibTorch without CUDA, or one linked whole (no plugin to load)
#endif
}

void require_cuda_where_it_can_run() {
  std::string why;
  if (cuda_driver_loads() && !load_plugin(why))
    throw Error(fmt::format("the NVIDIA driver loads (libcuda.so.1), but {}; without it LibTorch sees no GPU. Set "
                            "use_cpu to run on the CPU",
                            why));
}

const CudaPlugin& cuda_plugin() {
  std::string why;
  if (const auto* plugin = load_plugin(why)) return *plugin;
  throw Error(why);
}

}  // namespace xlr8::compat
