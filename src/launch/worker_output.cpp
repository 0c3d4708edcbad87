#include "launch/worker_output.hpp"

#include <unistd.h>

#include <cerrno>
#include <regex>

#include "core/text.hpp"

namespace xlr8::launcher {

namespace {
bool names_an_error(const std::string& line) { return text::lower(line).find("error") != std::string::npos; }
}  // namespace

void FailureNotes::add(const std::string& line) {
  if (core::is_backtrace_line(line)) {
    ++backtrace_lines_;
    message_open_ = false;
    return;
  }
  tail_.push_back(line);
  if (tail_.size() > kTailLines) tail_.pop_front();
  const std::string text = text::trim(line);
  static const std::string terminate = "terminate called after throwing an instance of '";
  if (text.starts_with(terminate)) {  // the C++ runtime's report of an uncaught exception; what() follows
    thrown_type_ = text.substr(terminate.size(), text.size() - terminate.size() - (text.ends_with("'") ? 1 : 0));
    headline_ = text;
    message_open_ = true;
  } else if (text.starts_with("what():")) {
    const std::string message = text::trim(text.substr(7));
    headline_ = thrown_type_.empty() ? message : thrown_type_ + ": " + message;
    thrown_type_.clear();
    message_open_ = true;
  } else if (text.empty()) {
    message_open_ = false;
  } else if (!message_open_ && names_an_error(text)) {  // a message's later lines do not replace its first
    headline_ = text;
    message_open_ = true;
  }
}

void WorkerStream::write_console(const std::string& text) const {
  for (size_t done = 0; done < text.size();) {
    ssize_t n = write(console_fd, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

void WorkerStream::leave_open_line() const {
  if (open_line && *open_line && *open_line != this) (*open_line)->write_console("\n"), *open_line = nullptr;
}

void WorkerStream::emit(std::string line) {
  if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF: an ordinary line
  leave_open_line();
  // A line redrawn in place shows (and keeps) only its last frame, without the erase-to-end code.
  const auto cr = line.rfind('\r');
  const std::string frame = cr == std::string::npos ? line : line.substr(cr + 1);
  write_console((cr == std::string::npos ? "" : "\r") + prefix + frame + "\n");
  if (open_line && *open_line == this) *open_line = nullptr;
  std::string text = frame;
  for (size_t at; (at = text.find("\x1b[K")) != std::string::npos;) text.erase(at, 3);
  if (log.is_open()) log << text << '\n' << std::flush;
  if (notes) notes->add(text);
}

void WorkerStream::show_in_place() {
  auto cr = partial.rfind('\r');
  if (cr == std::string::npos) return;
  leave_open_line();
  write_console("\r" + prefix + partial.substr(cr + 1));
  if (open_line) *open_line = this;
  partial.erase(0, cr);  // earlier frames are drawn over: keep only the latest
}

bool WorkerStream::pump() {
  char buffer[65536];
  ssize_t n = read(fd, buffer, sizeof(buffer));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) {
    if (!partial.empty()) emit(partial), partial.clear();
    close(fd);
    fd = -1;
    return false;
  }
  partial.append(buffer, static_cast<size_t>(n));
  size_t start = 0, nl;
  while ((nl = partial.find('\n', start)) != std::string::npos) {
    emit(partial.substr(start, nl - start));
    start = nl + 1;
  }
  partial.erase(0, start);
  show_in_place();
  return true;
}

}  // namespace xlr8::launcher
