#pragma once
// Progress of a training loop, as tqdm shows it: on a terminal a bar redrawn in place
//   train  45%|██████▎       | 450/1000 [00:12<00:15, 37.20 it/s, loss=2.31]
// and elsewhere (a pipe, a log file, a batch job) plain lines now and then
//   train 450/1000 (45%) 37.20 it/s elapsed 00:12 ETA 00:15 loss=2.31
// Accelerator::progress() makes one that is active on the main process only, with the mode from
// AcceleratorOptions::progress or XLR8_PROGRESS (auto | bar | lines | off).
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace xlr8 {

enum class ProgressMode { AUTO, BAR, LINES, OFF };

// "auto", "bar", "lines", "off" (ConfigError naming `origin`, the value and the choices otherwise).
ProgressMode parse_progress_mode(const std::string& text, const std::string& origin);

struct ProgressOptions {
  std::string description;    // shown first ("train")
  std::string unit = "it";    // the rate's unit: "it/s"
  int64_t initial = 0;        // already done (a resumed run), not counted in the rate
  int64_t line_every = 0;     // lines mode: a line every N updates; 0: every line_seconds
  double line_seconds = 10;   // lines mode without line_every
};

class ProgressBar {
 public:
  ProgressBar() = default;  // inactive: every call does nothing
  // `mode` AUTO resolves to BAR when `out` is a terminal (or stderr of a worker whose `xlr8 launch` runs
  // on one: XLR8_TERMINAL_COLUMNS), else LINES. `total` <= 0: unknown (no ETA).
  ProgressBar(int64_t total, ProgressOptions options, ProgressMode mode, std::FILE* out = stderr);
  ProgressBar(ProgressBar&& other) noexcept;
  ProgressBar& operator=(ProgressBar&& other) noexcept;
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ~ProgressBar();

  void update(int64_t n = 1);
  // Values shown after the rate ("loss=2.31"); numbers are written with 4 significant digits.
  void set_postfix(const nlohmann::ordered_json& values);  // in the order given
  // Draws the final state (the bar's last frame and a newline, or a last line). Idempotent.
  void close();

  ProgressMode mode() const { return mode_; }  // BAR, LINES or OFF once constructed
  int64_t count() const { return count_; }
  // The text of the current state in this bar's mode, without control characters (for tests and logs).
  std::string render(int columns = 80) const;

 private:
  void draw(bool final);
  double elapsed_seconds() const;

  int64_t total_ = 0;
  int64_t count_ = 0;
  ProgressOptions options_;
  ProgressMode mode_ = ProgressMode::OFF;
  std::FILE* out_ = nullptr;
  std::string postfix_;
  std::chrono::steady_clock::time_point start_{};
  std::chrono::steady_clock::time_point last_draw_{};
  int64_t count_at_last_line_ = 0;
  bool closed_ = true;
};

}  // namespace xlr8
