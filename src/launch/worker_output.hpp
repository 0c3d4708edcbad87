#pragma once
// A worker's output as the launcher handles it: lines split, prefixed, copied to the console and a log
// file, and, for stderr, what the failure report needs (the error's first line, backtraces aside).
#include <deque>
#include <fstream>
#include <string>

#include "core/error_file.hpp"  // is_backtrace_line

namespace xlr8::launcher {

// What a worker's stderr said about its failure. Backtrace lines (LibTorch's "Exception raised from ...",
// "frame #N: ...", "C++ CapturedTraceback:" and its "#N ..." entries) stay in the log and on the console
// but not here, so the report shows the message they would otherwise push out of view.
class FailureNotes {
 public:
  static constexpr size_t kTailLines = 20;
  void add(const std::string& line);
  // The first line of the latest error message (a line naming an error, or the C++ runtime's
  // "terminate called ... 'T'" + "what(): M" as "T: M"); empty when none was seen.
  const std::string& headline() const { return headline_; }
  const std::deque<std::string>& tail() const { return tail_; }  // last lines, backtraces left out
  size_t backtrace_lines() const { return backtrace_lines_; }

 private:
  std::deque<std::string> tail_;
  size_t backtrace_lines_ = 0;
  std::string headline_, thrown_type_;
  bool message_open_ = false;  // the lines since the headline belong to its message
};

// One output stream of one worker: split into lines, prefixed, copied to the console and a log file.
// A line redrawn in place (a progress bar: "\r<frame>" again and again) is shown as it arrives, prefixed
// after its last carriage return; the log file and the failure notes get only its final text.
struct WorkerStream {
  int fd = -1;
  int console_fd = 1;
  std::string prefix;
  std::string partial;
  std::ofstream log;
  FailureNotes* notes = nullptr;               // stderr only
  const WorkerStream** open_line = nullptr;    // the stream whose in-place line the console shows, shared

  void write_console(const std::string& text) const;
  // Another stream's in-place line stays where it is: this output starts below it.
  void leave_open_line() const;
  void emit(std::string line);
  // The unfinished line being redrawn: show its latest frame now.
  void show_in_place();
  // Reads what is available; returns false at end of file.
  bool pump();
};

}  // namespace xlr8::launcher
