#pragma once
// Fused Adam and AdamW: LibTorch's optimizers with a step that updates each CPU float32 parameter in
// one pass over parameter, gradient and both moments (the idea of DeepSpeed's CPU Adam). LibTorch's own
// step makes about ten passes and allocates a temporary per parameter; on the 5.8M-parameter MLP of
// bench/ the optimizer phase drops from ~15 ms to ~4-5 ms a step.
//
// Drop-in: the same constructors, options and per-parameter state (AdamWParamState / AdamParamState),
// so torch::save/torch::load, Accelerator::save_state and a later plain torch::optim::AdamW all read
// what these write. Results match LibTorch's arithmetic to float32 rounding (the fused pass uses FMA
// and a reciprocal where LibTorch rounds twice). CUDA parameters (float32, float16, bfloat16; contiguous;
// not amsgrad) go through LibTorch's fused multi-tensor kernel, _fused_adamw_ / _fused_adam_ (what
// PyTorch's AdamW(fused=True) runs): one launch per batch of parameters of one device, dtype and step
// count, no host synchronisation. Anything else (non-contiguous, amsgrad, other dtypes) is stepped with
// LibTorch's own tensor arithmetic.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

namespace xlr8::optim {

// AdamW: decoupled weight decay, p <- p * (1 - lr * weight_decay) before the Adam update.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// Adam: weight decay as L2, added to the gradient (grad + weight_decay * p), as LibTorch's Adam does.
class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace xlr8::optim
