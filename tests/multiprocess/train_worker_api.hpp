#pragma once
// train_worker's modes for the everyday API (train_worker_api.cpp).
#include <string>

#include "xlr8/accelerator.hpp"

int run_nested_mode(xlr8::Accelerator& acc, const std::string& mode);
int run_free_memory_mode(xlr8::Accelerator& acc, const std::string& mode);
