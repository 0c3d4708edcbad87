#pragma once
// The ONLY place with LibTorch version checks (TORCH_VERSION_MAJOR/MINOR): the rest builds on 1.13 and 2.x.
// 1.13 (Debian, CPU, Gloo): ProcessGroupGloo derives from ProcessGroup; Gloo lacks bf16, AVG,
// _allgather_base and reduce_scatter. 2.x: ProcessGroupGloo/NCCL derive from c10d::Backend.
#include <torch/version.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef XLR8_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define XLR8_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if XLR8_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace xlr8::compat {

#if XLR8_TORCH_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

// Gloo reduces bf16 from PyTorch 2.2 (PR #113557); before that it throws "Invalid scalar type".
constexpr bool kGlooReducesBFloat16 = XLR8_TORCH_AT_LEAST(2, 2);

#ifdef XLR8_WITH_NCCL
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

inline int cuda_device_count() { return static_cast<int>(at::detail::getCUDAHooks().getNumGPUs()); }

inline std::string torch_version() { return TORCH_VERSION; }

// Hands the CUDA caching allocator's unused blocks back to the driver (torch.cuda.empty_cache()).
inline void empty_device_cache() {
#ifdef XLR8_WITH_NCCL
  if (cuda_device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

// NCCL communicators bind to the current device when first used: select it before any collective.
inline void set_cuda_device(int index) {
#ifdef XLR8_WITH_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  (void)index;
#endif
}

// A Gloo device: GLOO_SOCKET_IFNAME wins; a loopback master address binds loopback; else the host's address.
inline std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (master_addr.rfind("127.", 0) == 0 || master_addr == "localhost")
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

inline BackendPtr make_gloo(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout,
                            const std::string& master_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device(master_addr));
  options->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

#ifdef XLR8_WITH_NCCL
// A ProcessGroupNCCL destroyed during exit (the process state's groups are statics) sets its device in
// its destructor, which fails once CUDA's driver is shutting down ("driver shutting down", thrown from a
// destructor: SIGABRT after a finished run, stdout's buffer lost; seen on an H100 with torch 2.11). So an
// exit handler, registered at the first NCCL collective (after our statics, so it runs before their
// destructors), aborts every NCCL group while it can and keeps a reference to each that is never
// released: their destructors never run. (Aborted, not shut down: a shutdown waits for pending work, which
// a failing run may have.)
struct NcclGroupsAtExit {
  struct Entry {
    c10::intrusive_ptr<c10d::ProcessGroupNCCL> group;
  };
  std::mutex mutex;
  std::vector<std::weak_ptr<Entry>> entries;  // alive while their group's owner holds the handle
  static NcclGroupsAtExit& instance() {
    static auto* registry = new NcclGroupsAtExit;  // never destroyed: the handler runs during exit
    return *registry;
  }
  static void abort_all() {
    std::fflush(nullptr);  // what the program printed reaches its pipes whatever happens next
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& weak : r.entries)
      if (auto entry = weak.lock()) {
        try {
          entry->group->abort();
        } catch (...) {  // exiting anyway
        }
        (void)c10::intrusive_ptr<c10d::ProcessGroupNCCL>(entry->group).release();  // never destroyed during exit
      }
    r.entries.clear();
  }
  // The handle registers `group` while it lives: its owner keeps it beside the group and drops it first, so a
  // group dropped during the run is destroyed then, as usual.
  std::shared_ptr<void> add(const c10::intrusive_ptr<c10d::ProcessGroupNCCL>& group) {
    auto entry = std::make_shared<Entry>(Entry{group});
    std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(entries, [](const auto& weak) { return weak.expired(); });
    entries.emplace_back(entry);
    return entry;
  }
  // At every NCCL collective (cheap after the first): registers the handler once.
  static void arm() {
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit(&NcclGroupsAtExit::abort_all); });
  }
};

// `at_exit`: the group's registration with NcclGroupsAtExit (keep it beside the group; drop it first).
inline BackendPtr make_nccl(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout,
                            std::shared_ptr<void>& at_exit) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#if XLR8_TORCH_AT_LEAST(2, 3)
  at_exit = NcclGroupsAtExit::instance().add(group);
#else
  at_exit.reset();
#endif
  return group;
}
#endif

// ------------------------------------------------------------------ autograd
// Autograd nodes (Tensor::grad_fn(), Edge::function) are held by std::shared_ptr<Node> on 1.13 and by
// c10::intrusive_ptr<Node> on newer 2.x (2.15 does).
using NodePtr = std::remove_cvref_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// grad_accumulator() returns std::shared_ptr<Node> on 1.13 and c10::intrusive_ptr<Node> on newer 2.x.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

inline GradAccumulatorPtr grad_accumulator(const at::Tensor& parameter) {
  return torch::autograd::impl::grad_accumulator(parameter);
}

// Runs `callback` when the current backward pass ends; only valid from inside a backward hook. If the
// pass fails instead (an autograd node throws), PyTorch discards its callbacks unrun: `abandoned` is then
// called when the discarded callback is destroyed, so whoever armed it can forget that pass.
inline void at_end_of_backward(std::function<void()> callback, std::function<void()> abandoned = {}) {
  struct Token {
    std::function<void()> abandoned;
    bool ran = false;
    ~Token() {
      if (!ran && abandoned) abandoned();
    }
  };
  auto token = std::make_shared<Token>();
  token->abandoned = std::move(abandoned);
  torch::autograd::Engine::get_default_engine().queue_callback([token, callback = std::move(callback)] {
    token->ran = true;
    callback();
  });
}

// ------------------------------------------------------------------ autocast
// 2.4 made the API device-generic (PR #124359); the old names warn at run time from then on.
inline bool autocast_enabled(c10::DeviceType device) {
#if XLR8_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}
inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if XLR8_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}
inline void set_autocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
#if XLR8_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}
inline void autocast_enter() { at::autocast::increment_nesting(); }
inline void autocast_exit() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

// ------------------------------------------------------------------ optimizers
// Optimizer::state_ is keyed by the parameter's TensorImpl: its address printed as a string before 2.2,
// the address itself from 2.2 on (PR #108480). Subclasses that create state must use the same key.
#if XLR8_TORCH_AT_LEAST(2, 2)
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) { return parameter.unsafeGetTensorImpl(); }
#else
using OptimizerStateKey = std::string;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) {
  std::ostringstream address;
  address << parameter.unsafeGetTensorImpl();
  return address.str();
}
#endif

// TCPStore options: identical fields on 1.13 and 2.x for what we use.
inline StorePtr make_tcp_store(const std::string& host, int port, bool is_server, int world_size,
                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = is_server;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;  // we wait ourselves, to name the ranks that did not join
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

}  // namespace xlr8::compat
