#pragma once
// The ONLY place with LibTorch version checks (TORCH_VERSION_MAJOR/MINOR), and what differs between the
// LibTorch releases xlr8 builds against: 2.6 (the oldest, Debian 13's; scripts/check-compat) to the pinned
// wheel's (torch-requirements.txt), the GPU machines' 2.11 among them. LibTorch 1.x was dropped (issue 42).
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
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "compat/cuda_on_demand.hpp"
#include "compat/cuda_plugin.hpp"
#include "xlr8/env.hpp"

#define XLR8_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace xlr8::compat {

using Backend = c10d::Backend;
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

#ifdef XLR8_WITH_NCCL
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

// The GPUs LibTorch sees, its CUDA half loaded where the driver is (compat/cuda_on_demand.hpp).
inline int cuda_device_count() {
  require_cuda_where_it_can_run();
  return static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
}

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
  if (const auto ifname = env_var("GLOO_SOCKET_IFNAME")) return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
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

// A ProcessGroupNCCL, made by xlr8's CUDA plugin (compat/cuda_plugin.hpp); `at_exit`: the group's registration for
// exit (compat/abort_at_exit.hpp; keep it beside the group, drop it first).
inline BackendPtr make_nccl(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout,
                            std::shared_ptr<void>& at_exit) {
  return cuda_plugin().make_nccl(store, rank, size, timeout, at_exit);
}

// Arms the exit handler that aborts the NCCL groups before CUDA's teardown.
inline void abort_nccl_groups_at_exit() { cuda_plugin().abort_nccl_groups_at_exit(); }

// ------------------------------------------------------------------ autograd
// Autograd nodes (Tensor::grad_fn(), Edge::function) are held by std::shared_ptr<Node> up to 2.11 at least and
// by c10::intrusive_ptr<Node> in 2.15.
using NodePtr = std::remove_cvref_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// grad_accumulator() returns std::shared_ptr<Node> or c10::intrusive_ptr<Node>, as NodePtr above.
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
// The device-generic API (2.4, PR #124359; the older per-device names warn at run time since).
inline bool autocast_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
inline at::ScalarType autocast_dtype(c10::DeviceType device) { return at::autocast::get_autocast_dtype(device); }
inline void set_autocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
}
inline void autocast_enter() { at::autocast::increment_nesting(); }
inline void autocast_exit() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

// ------------------------------------------------------------------ optimizers
// Optimizer::state_ is keyed by the parameter's TensorImpl address (2.2 on, PR #108480; a string before).
// Subclasses that create state must use the same key.
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) { return parameter.unsafeGetTensorImpl(); }

// TCPStore options: the fields we use are the same across 2.x.
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
