#pragma once
// fp8 training (mixed_precision fp8): xlr8::nn::Linear layers compute their three gemms from float8 casts of
// their operands, with the two recipes Accelerate's backends use:
//   - dynamic scaling (backend AO, torchao's float8 training): each cast's scale comes from the amax of the
//     tensor it casts, per tensor ("tensorwise") or per row of the gemm's operand ("rowwise");
//   - delayed scaling (backend TE, Transformer Engine's recipe): each cast uses a scale computed from a history
//     of earlier amaxes, and records its own amax for the scales to come.
// Where LibTorch has an fp8 gemm (`_scaled_mm`: CUDA from Ada/Hopper, the CPU in recent releases) it runs;
// elsewhere the product is computed in fp32 from the dequantised fp8 values: every operand rounds exactly as on
// the GPU, so the CPU run is a numerical model of the GPU one. The Accelerator converts the model's layers at
// prepare(); a program may call convert_to_float8_training itself.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/communicator.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::fp8 {

enum class Scaling { Tensorwise, Rowwise, Delayed };
std::string to_string(Scaling scaling);

struct Recipe {
  Scaling scaling = Scaling::Tensorwise;
  bool gradients_e5m2 = true;  // grad_output cast to e5m2 (tensorwise; TE's HYBRID), else e4m3 (rowwise; TE's E4M3)
  // Delayed scaling: the scale leaves 2^margin of headroom, is recomputed every `interval` casts from the last
  // `amax_history_len` amaxes, taking the most recent or their max.
  int margin = 0;
  int interval = 1;
  int amax_history_len = 1024;
  bool amax_most_recent = true;
  std::array<bool, 3> compute_precision{};  // fprop, dgrad, wgrad gemms in the compute dtype (TE's override)
  bool use_autocast_during_eval = false;    // evaluation (module.eval()) in fp8 too; else in the compute dtype
};

// The recipe of Accelerate's settings: backend TE is delayed scaling; AO (the default) is torchao's dynamic
// scaling, tensorwise unless the program's settings name torchao's "rowwise" recipe.
Recipe recipe_from(const Fp8Settings& settings);

// Which xlr8::nn::Linear layers run in fp8: Accelerate's filter for AO skips the model's first and last Linear
// (kept in high precision for stability) and any whose in or out features are not multiples of 16 (the fp8
// gemm's rule); torchao's size filter skips small layers, whose casts cost more than their gemm saves.
struct LayerFilter {
  bool skip_first_and_last = true;
  int64_t min_features = 0;  // skip a layer whose in_features or out_features is below this (0: none)
  bool strict = false;       // a width that is not a multiple of 16 is an error instead of a skipped layer
};
LayerFilter filter_from(const Fp8Settings& settings);

struct ConversionReport {
  std::vector<std::string> converted;                        // module paths
  std::vector<std::pair<std::string, std::string>> skipped;  // module path, why
  std::string describe() const;                              // one line per layer, for the prepare() log
};

// Gives every xlr8::nn::Linear of `model` the filter admits its fp8 state (recipe, amax histories); a plain
// torch::nn::Linear is reported as skipped, naming xlr8::nn::Linear. Call it after a tensor-parallel split (the
// layers' groups reduce their amaxes) and give the group of ranks that hold other rows of the batch (data and
// context parallel), so every rank casts with the scales one process would. Converting twice is an error.
ConversionReport convert_to_float8_training(torch::nn::Module& model, const Recipe& recipe, const LayerFilter& filter,
                                            const Communicator& batch_group = Communicator());

// ------------------------------------------------------------------------------------ the building blocks

// The largest finite value of a float8 dtype (kFloat8_e4m3fn: 448, kFloat8_e5m2: 57344).
double max_finite(at::ScalarType float8);
// fp8 max / amax / 2^margin in fp32 (amax clamped below at 1e-12, as torchao does, so a zero tensor casts to 0).
at::Tensor scale_for(const at::Tensor& amax, at::ScalarType float8, int margin = 0);
// x * scale, saturated to the dtype's finite range and rounded to nearest even into `float8` (NaN stays NaN,
// ±inf becomes ±max). Within the range it equals LibTorch's own conversion of x * scale.
at::Tensor cast_to_float8(const at::Tensor& x, const at::Tensor& scale, at::ScalarType float8);
// (a / a_scale) @ (b / b_scale) in `out_dtype`: a [M, K] and b [K, N] float8; scales are the cast's (scalars, or
// a [M, 1] and b [1, N] per row). `_scaled_mm` on a GPU that has it, else (and always on the CPU) the dequantised
// product in fp32.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                     at::ScalarType out_dtype);
// What scaled_mm computes where the device has no fp8 gemm: the product of the dequantised values in fp32 (every fp8
// value is exact in fp32, so only the order of the sums differs from the real gemm).
at::Tensor dequantised_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                          const at::Tensor& b_scale, at::ScalarType out_dtype);
// Whether scaled_mm runs a real fp8 gemm on `device` (asked of a GPU once, with a small product; never on the CPU,
// so that a CPU run does not depend on a timing).
bool has_fp8_gemm(c10::Device device, bool rowwise);

}  // namespace xlr8::fp8
