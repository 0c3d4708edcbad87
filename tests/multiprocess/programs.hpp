#pragma once
// The programs the multi-process tests start, at the paths CMake built them to (tests/CMakeLists.txt).
#include <string>

inline const std::string kXlr8 = XLR8_BIN;
inline const std::string kWorker = WORKER_BIN;
inline const std::string kTrain = TRAIN_BIN;
inline const std::string kEngine = ENGINE_BIN;
inline const std::string kFashion = FASHION_BIN;
inline const std::string kGpt = GPT_BIN;
inline const std::string kGptDeepSpeed = GPT_DEEPSPEED_BIN;
inline const std::string kTrainer = TRAINER_BIN;
inline const std::string kPipeline = PIPELINE_BIN;
inline const std::string kPipelineDeepSpeed = PIPELINE_DEEPSPEED_BIN;
inline const std::string kCompare = COMPARE_SAFETENSORS;
inline const std::string kSource = XLR8_SOURCE_DIR;
