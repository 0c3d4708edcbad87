#pragma once
// LibTorch 1.x's CPU kernels of layer_norm, group_norm and batch_norm need the input's dtype for their
// weights, and its CPU autocast leaves them out: a Linear's bf16 output fed to a LayerNorm with fp32
// weights fails. 2.x's kernels take such mixed inputs (computing in fp32, returning the input's dtype);
// src/precision/autocast.cpp gives 1.x the same policy. (Kept out of torch_compat.hpp, which the
// precompiled header holds.)
#include <torch/version.h>

#define XLR8_NEEDS_CPU_NORM_AUTOCAST (TORCH_VERSION_MAJOR < 2)
