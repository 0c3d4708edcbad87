#pragma once
// Everything public in xlr8.
#include "xlr8/accelerator.hpp"
#include "xlr8/communicator.hpp"
#include "xlr8/config.hpp"
#include "xlr8/device_mesh.hpp"
#include "xlr8/env.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/launcher.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/safetensors.hpp"
#include "xlr8/settings.hpp"
