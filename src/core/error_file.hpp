#pragma once
// torchelastic's error file: a worker that fails writes why to $TORCHELASTIC_ERROR_FILE (torch's @record
// format, {"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}), and the
// launcher that set the variable reads it to name the root cause.
#include <exception>
#include <optional>
#include <string>

namespace xlr8::core {

struct ErrorFileRecord {
  std::string message;     // "<exception type>: <what()>"
  long long timestamp = 0;  // seconds since the epoch, when written
};

// A line of a LibTorch backtrace (c10::Error's what() in 1.x and 2.x, 2.x's captured tracebacks): what the error
// file and the launcher's failure report leave out.
bool is_backtrace_line(const std::string& line);
// "<demangled type>: <what()>" of a caught exception.
std::string describe_exception(const std::exception& e);
// Writes `message` to $TORCHELASTIC_ERROR_FILE when the variable is set and the file does not exist yet
// (the first error is the root cause; later ones are its consequences). Never throws.
void write_error_file(const std::string& message);
// Reads one such file; nullopt when it is missing or not torch's format.
std::optional<ErrorFileRecord> read_error_file(const std::string& path);
// std::terminate with an exception in flight (an uncaught one) writes it to the error file first, then
// goes on to the handler installed before. Idempotent.
void install_error_file_handler();

}  // namespace xlr8::core
