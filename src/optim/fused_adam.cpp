// Fused Adam/AdamW step (include/xlr8/fused_adam.hpp): one pass per CPU float32 parameter, vectorised
// with AVX2+FMA where the CPU has it, split over the intra-op threads; LibTorch's fused multi-tensor
// kernel (_fused_adamw_) for CUDA parameters; LibTorch's tensor arithmetic for everything else.
#include "xlr8/fused_adam.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>

#include <atomic>
#include <cmath>
#include <map>
#include <tuple>
#include <type_traits>

#include "compat/torch_compat.hpp"
#include "optim/fused_adam_testing.hpp"
#include "xlr8/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define XLR8_FUSED_ADAM_AVX2 1
#endif

namespace xlr8::optim {
namespace {

// One parameter's update constants for this step, in float32 as the update runs.
struct AdamCoefficients {
  float decay;  // AdamW: 1 - lr * weight_decay; Adam: 1
  float l2;     // Adam: weight_decay, added to the gradient; AdamW: 0
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_sqrt_bias_correction2, eps, neg_step_size;
};

// m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  p <- decay p - step (m / (sqrt(v)/sqrt(bc2) + eps)).
template <bool kL2>
void update_portable(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamCoefficients& c) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float grad = kL2 ? g[i] + c.l2 * p[i] : g[i];
    const float mi = m[i] * c.beta1 + c.one_minus_beta1 * grad;
    const float vi = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(vi) * c.inv_sqrt_bias_correction2 + c.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * c.decay + c.neg_step_size * (mi / denom);
  }
}

#ifdef XLR8_FUSED_ADAM_AVX2
#define XLR8_AVX2 __attribute__((target("avx2,fma")))

struct AvxCoefficients {
  __m256 decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps, neg_step;
};

// The same update on eight lanes: all of them, or (kMasked) those whose sign bit is set in `mask`. The
// arithmetic is identical either way; only the tail pays for masked moves (slow stores on AMD).
template <bool kL2, bool kMasked>
XLR8_AVX2 inline __attribute__((always_inline)) void update_lanes(float* p, const float* g, float* m, float* v,
                                                                  __m256i mask, const AvxCoefficients& c) {
  auto load = [mask](const float* from) XLR8_AVX2 {
    if constexpr (kMasked) return _mm256_maskload_ps(from, mask);
    return _mm256_loadu_ps(from);
  };
  auto store = [mask](float* to, __m256 value) XLR8_AVX2 {
    if constexpr (kMasked) return _mm256_maskstore_ps(to, mask, value);
    _mm256_storeu_ps(to, value);
  };
  __m256 pi = load(p), gi = load(g);
  if constexpr (kL2) gi = _mm256_fmadd_ps(c.l2, pi, gi);
  const __m256 mi = _mm256_fmadd_ps(c.one_minus_beta1, gi, _mm256_mul_ps(load(m), c.beta1));
  const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, gi), gi, _mm256_mul_ps(load(v), c.beta2));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), c.inv_sqrt_bc2, c.eps);
  pi = _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(mi, denom), _mm256_mul_ps(pi, c.decay));
  store(m, mi);
  store(v, vi);
  store(p, pi);
}

// The tail goes through masked loads and stores with the same arithmetic, so an element's result does
// not depend on which chunk of the thread split it falls in, nor on the number of threads.
template <bool kL2>
XLR8_AVX2 void update_avx2(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamCoefficients& c) {
  const AvxCoefficients k{_mm256_set1_ps(c.decay),           _mm256_set1_ps(c.l2),
                          _mm256_set1_ps(c.beta1),           _mm256_set1_ps(c.one_minus_beta1),
                          _mm256_set1_ps(c.beta2),           _mm256_set1_ps(c.one_minus_beta2),
                          _mm256_set1_ps(c.inv_sqrt_bias_correction2), _mm256_set1_ps(c.eps),
                          _mm256_set1_ps(c.neg_step_size)};
  const __m256i all = _mm256_set1_epi32(-1);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) update_lanes<kL2, false>(p + i, g + i, m + i, v + i, all, k);
  if (i < n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // lane k is on when k < n - i
    update_lanes<kL2, true>(p + i, g + i, m + i, v + i,
                      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane), k);
  }
}

bool cpu_has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

std::atomic<bool> g_force_portable{false};
std::atomic<bool> g_torch_kernel_on_cpu{false};

template <bool kL2>
void update_range(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamCoefficients& c) {
#ifdef XLR8_FUSED_ADAM_AVX2
  if (cpu_has_avx2_fma() && !g_force_portable.load(std::memory_order_relaxed)) return update_avx2<kL2>(p, g, m, v, n, c);
#endif
  update_portable<kL2>(p, g, m, v, n, c);
}

void fused_update(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                  const AdamCoefficients& c) {
  constexpr std::int64_t kGrain = std::int64_t{1} << 15;  // 128 KB per stream: a thread's worth
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, p.numel(), kGrain, [&](std::int64_t begin, std::int64_t end) {
    if (c.l2 != 0)
      update_range<true>(pp + begin, gp + begin, mp + begin, vp + begin, end - begin, c);
    else
      update_range<false>(pp + begin, gp + begin, mp + begin, vp + begin, end - begin, c);
  });
  // Raw stores bypass autograd's version counter; bump it as LibTorch's in-place ops would.
  torch::autograd::impl::bump_version(p);
}

// Which arithmetic steps a parameter: our CPU float32 pass, LibTorch's fused multi-tensor kernel (CUDA:
// one launch per batch of parameters instead of about nine per parameter), or LibTorch's tensor ops.
enum class Kernel { ours, torch_fused, tensor_ops };

bool dense_alike(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (t->layout() != at::kStrided || !t->is_contiguous() || !t->sizes().equals(p.sizes()) ||
        t->device() != p.device() || t->scalar_type() != p.scalar_type())
      return false;
  return true;
}

Kernel kernel_for(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v, bool amsgrad) {
  if (amsgrad || !dense_alike(p, g, m, v)) return Kernel::tensor_ops;
  const auto dtype = p.scalar_type();
  const bool floating = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  if (p.device().is_cuda()) return floating ? Kernel::torch_fused : Kernel::tensor_ops;
  if (!p.device().is_cpu()) return Kernel::tensor_ops;
  if (g_torch_kernel_on_cpu.load(std::memory_order_relaxed))
    return floating || dtype == at::kDouble ? Kernel::torch_fused : Kernel::tensor_ops;
  return dtype == at::kFloat ? Kernel::ours : Kernel::tensor_ops;
}

// Parameters LibTorch's fused kernel steps in one call: the same device, dtype and step count.
struct TorchBatch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
};
using TorchBatchKey = std::tuple<int, int, int, int64_t>;  // device type, device index, dtype, step

template <class Options>
void run_torch_batches(const std::map<TorchBatchKey, TorchBatch>& batches, const Options& options, bool decoupled) {
  const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
  for (auto& [key, batch] : batches) {
    const auto& p = batch.params.front();
    // The kernel reads (does not advance) one float step per parameter; equal counts share one tensor,
    // written by a fill on the device: no host synchronisation.
    const auto step = at::full({}, static_cast<double>(std::get<3>(key)), p.options().dtype(at::kFloat));
    const std::vector<at::Tensor> steps(batch.params.size(), step);
    if (decoupled)
      at::_fused_adamw_(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, {}, steps, options.lr(), beta1,
                        beta2, options.weight_decay(), options.eps(), /*amsgrad=*/false, /*maximize=*/false);
    else
      at::_fused_adam_(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, {}, steps, options.lr(), beta1,
                       beta2, options.weight_decay(), options.eps(), /*amsgrad=*/false, /*maximize=*/false);
  }
}

// LibTorch's own arithmetic, for what the fused pass does not cover.
template <class Options, class State>
void tensor_update(const at::Tensor& p, const at::Tensor& grad, State& state, const Options& options, bool decoupled,
                   double bias_correction2, double step_size) {
  at::Tensor g = grad;
  const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
  if (options.weight_decay() != 0) {
    if (decoupled)
      p.mul_(1 - options.lr() * options.weight_decay());
    else
      g = g.add(p, options.weight_decay());
  }
  state.exp_avg().mul_(beta1).add_(g, 1 - beta1);
  state.exp_avg_sq().mul_(beta2).addcmul_(g, g, 1 - beta2);
  at::Tensor second_moment = state.exp_avg_sq();
  if (options.amsgrad()) {
    at::max_out(state.max_exp_avg_sq(), state.exp_avg_sq(), state.max_exp_avg_sq());
    second_moment = state.max_exp_avg_sq();
  }
  const at::Tensor denom = (second_moment.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  p.addcdiv_(state.exp_avg(), denom, -step_size);
}

template <class Options, class State, class StateMap>
torch::Tensor adam_step(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states,
                        const torch::optim::Optimizer::LossClosure& closure, bool decoupled, const char* name) {
  static_assert(std::is_same_v<typename StateMap::key_type, compat::OptimizerStateKey>,
                "compat::optimizer_state_key does not match this LibTorch's Optimizer::state_");
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : groups) {
    const auto& options = static_cast<const Options&>(group.options());
    std::map<TorchBatchKey, TorchBatch> batches;  // this group's (its options are the kernel's arguments)
    for (auto& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (grad.is_sparse())
        throw Error(fmt::format("{}: the parameter of shape [{}] has a sparse gradient; Adam needs dense gradients "
                                "(make the module produce dense ones, e.g. Embedding without sparse=true)",
                                name, fmt::join(p.sizes(), ", ")));
      const auto key = compat::optimizer_state_key(p);
      auto found = states.find(key);
      if (found == states.end()) {
        auto fresh = std::make_unique<State>();
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        found = states.emplace(key, std::move(fresh)).first;
      }
      auto& state = static_cast<State&>(*found->second);
      state.step(state.step() + 1);
      const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
      const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(state.step()));
      const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(state.step()));
      const double step_size = options.lr() / bias_correction1;
      const auto kernel = kernel_for(p, grad, state.exp_avg(), state.exp_avg_sq(), options.amsgrad());
      if (kernel == Kernel::tensor_ops) {
        tensor_update(p, grad, state, options, decoupled, bias_correction2, step_size);
        continue;
      }
      if (kernel == Kernel::torch_fused) {
        auto& batch = batches[{static_cast<int>(p.device().type()), p.device().index(),
                               static_cast<int>(p.scalar_type()), state.step()}];
        batch.params.push_back(p);
        batch.grads.push_back(grad);
        batch.exp_avgs.push_back(state.exp_avg());
        batch.exp_avg_sqs.push_back(state.exp_avg_sq());
        continue;
      }
      const double weight_decay = options.weight_decay();
      const AdamCoefficients c{
          .decay = static_cast<float>(decoupled ? 1 - options.lr() * weight_decay : 1.0),
          .l2 = static_cast<float>(decoupled ? 0.0 : weight_decay),
          .beta1 = static_cast<float>(beta1),
          .one_minus_beta1 = static_cast<float>(1 - beta1),
          .beta2 = static_cast<float>(beta2),
          .one_minus_beta2 = static_cast<float>(1 - beta2),
          .inv_sqrt_bias_correction2 = static_cast<float>(1 / std::sqrt(bias_correction2)),
          .eps = static_cast<float>(options.eps()),
          .neg_step_size = static_cast<float>(-step_size),
      };
      fused_update(p, grad, state.exp_avg(), state.exp_avg_sq(), c);
    }
    run_torch_batches(batches, options, decoupled);
  }
  return loss;
}

}  // namespace

namespace detail {
void force_portable_kernel(bool on) { g_force_portable.store(on); }
void use_torch_kernel_on_cpu(bool on) { g_torch_kernel_on_cpu.store(on); }
}  // namespace detail

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return adam_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(param_groups_, state_, closure,
                                                                              /*decoupled=*/true, "FusedAdamW");
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  return adam_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(param_groups_, state_, closure,
                                                                            /*decoupled=*/false, "FusedAdam");
}

}  // namespace xlr8::optim
