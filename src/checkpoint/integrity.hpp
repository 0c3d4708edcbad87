#pragma once
// What the Trainer needs to know of a checkpoint folder without loading it (implemented with the format,
// in training_checkpoint.cpp).
#include <filesystem>
#include <string>
#include <vector>

namespace xlr8::checkpoints {

// Why the checkpoint in `dir` is not intact, or "" when it is: its MANIFEST.json readable and every file it
// lists there with its size and CRC32 (each file read once). A folder with neither MANIFEST.json nor
// accelerator_state.json is not a save_state checkpoint and has nothing to be checked against: "".
std::string integrity_problem(const std::filesystem::path& dir);

// The files of a save_state checkpoint in `dir` (relative to it, MANIFEST.json included): written once
// and flushed by save_state, never rewritten in place. Empty when `dir` has no readable manifest.
std::vector<std::string> manifest_files(const std::filesystem::path& dir);

}  // namespace xlr8::checkpoints
