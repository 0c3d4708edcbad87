// Precompiled header for the LibTorch-facing translation units (each costs ~15 s without it).
#pragma once
#include "compat/torch_compat.hpp"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include "xlr8/accelerator.hpp"
