// ProgressBar: tqdm's bar on a terminal, periodic plain lines elsewhere.
#include "xlr8/progress.hpp"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace xlr8 {

ProgressMode parse_progress_mode(const std::string& text, const std::string& origin) {
  if (text == "auto" || text.empty()) return ProgressMode::AUTO;
  if (text == "bar") return ProgressMode::BAR;
  if (text == "lines") return ProgressMode::LINES;
  if (text == "off" || text == "none" || text == "0" || text == "false") return ProgressMode::OFF;
  throw ConfigError(fmt::format("{}={:?} is not a progress mode: use auto (a bar on a terminal, lines otherwise), "
                                "bar, lines or off",
                                origin, text));
}

namespace {

constexpr double kRedrawSeconds = 0.1;  // tqdm's mininterval

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}

bool utf8_terminal() {
  for (const char* name : {"LC_ALL", "LC_CTYPE", "LANG"}) {
    if (const auto value = env_var(name)) {
      const std::string& v = *value;
      return v.find("UTF-8") != std::string::npos || v.find("utf8") != std::string::npos ||
             v.find("utf-8") != std::string::npos;
    }
  }
  return false;
}

// Set by `xlr8 launch` for its workers when its own stderr is a terminal: the columns left after the rank
// prefix. The workers' stderr is a pipe to the launcher, which shows in-place lines as they come; a
// program that inherited the variable but writes elsewhere (a worker's child redirected to a file) is
// not on that terminal.
int launcher_terminal_columns() {
  const auto columns = env_var("XLR8_TERMINAL_COLUMNS");
  struct stat info {};
  if (!columns || fstat(fileno(stderr), &info) != 0 || !S_ISFIFO(info.st_mode)) return 0;
  return std::atoi(columns->c_str());
}

bool is_terminal(std::FILE* out) {
  return isatty(fileno(out)) || (out == stderr && launcher_terminal_columns() > 0);
}

int terminal_columns(std::FILE* out) {
  winsize size{};
  if (ioctl(fileno(out), TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;  // 0: a pty nobody sized
  if (int c = launcher_terminal_columns(); c > 0 && out == stderr) return c;
  if (const auto columns = env_var("COLUMNS")) {
    int c = std::atoi(columns->c_str());
    if (c > 0) return c;
  }
  return 80;
}

// `fraction` of `width` cells: whole blocks, then one partial block (eighths) when UTF-8 is available.
std::string bar_cells(double fraction, int width, bool utf8) {
  fraction = std::clamp(fraction, 0.0, 1.0);
  std::string out;
  if (!utf8) {
    int filled = static_cast<int>(fraction * width);
    return std::string(filled, '#') + std::string(width - filled, ' ');
  }
  static const char* const kEighths[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  int eighths = static_cast<int>(fraction * width * 8);
  int full = eighths / 8;
  for (int i = 0; i < full; ++i) out += "█";
  int cells = full;
  if (full < width && eighths % 8) out += kEighths[eighths % 8], ++cells;
  return out + std::string(width - cells, ' ');
}

// `text` cut to `cells` characters (UTF-8 code points; every character drawn is one cell wide): a frame
// wider than the terminal wraps, and the next \r then redraws only its last line, leaving the rest behind.
std::string fit_to_cells(const std::string& text, int cells) {
  int seen = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;  // a continuation byte
    if (seen++ == cells) return text.substr(0, i);
  }
  return text;
}

}  // namespace

ProgressBar::ProgressBar(int64_t total, ProgressOptions options, ProgressMode mode, std::FILE* out)
    : total_(total), count_(options.initial), options_(std::move(options)), mode_(mode), out_(out) {
  if (mode_ == ProgressMode::AUTO) mode_ = out_ && is_terminal(out_) ? ProgressMode::BAR : ProgressMode::LINES;
  if (!out_) mode_ = ProgressMode::OFF;
  start_ = last_draw_ = std::chrono::steady_clock::now();
  count_at_last_line_ = count_;
  closed_ = mode_ == ProgressMode::OFF;
  if (mode_ == ProgressMode::BAR) draw(false);
}

ProgressBar::ProgressBar(ProgressBar&& other) noexcept { *this = std::move(other); }

ProgressBar& ProgressBar::operator=(ProgressBar&& other) noexcept {
  if (this != &other) {
    try {
      close();
    } catch (...) {
    }
    total_ = other.total_;
    count_ = other.count_;
    options_ = std::move(other.options_);
    mode_ = other.mode_;
    out_ = other.out_;
    postfix_ = std::move(other.postfix_);
    start_ = other.start_;
    last_draw_ = other.last_draw_;
    count_at_last_line_ = other.count_at_last_line_;
    closed_ = std::exchange(other.closed_, true);
    other.mode_ = ProgressMode::OFF;
  }
  return *this;
}

ProgressBar::~ProgressBar() {
  try {
    close();
  } catch (...) {  // a failed write to the terminal must not end the program while unwinding
  }
}

double ProgressBar::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void ProgressBar::update(int64_t n) {
  if (closed_) return;
  count_ += n;
  const auto now = std::chrono::steady_clock::now();
  const double since_draw = std::chrono::duration<double>(now - last_draw_).count();
  bool due = false;
  if (mode_ == ProgressMode::BAR) due = since_draw >= kRedrawSeconds || (total_ > 0 && count_ >= total_);
  else if (options_.line_every > 0) due = count_ - count_at_last_line_ >= options_.line_every;
  else due = since_draw >= options_.line_seconds;
  if (due) draw(false);
}

void ProgressBar::set_postfix(const nlohmann::ordered_json& values) {
  postfix_.clear();
  if (!values.is_object()) return;
  for (const auto& [key, value] : values.items()) {
    if (!postfix_.empty()) postfix_ += ", ";
    if (value.is_number_float()) {
      // tqdm's way: 4 significant digits, but a large number whole (13760, not 1.376e+04).
      const double v = value.get<double>();
      postfix_ += std::abs(v) >= 1e3 && std::abs(v) < 1e15 ? fmt::format("{}={:.0f}", key, v) : fmt::format("{}={:.4g}", key, v);
    }
    else if (value.is_string()) postfix_ += fmt::format("{}={}", key, value.get<std::string>());
    else postfix_ += fmt::format("{}={}", key, value.dump());
  }
}

std::string ProgressBar::render(int columns) const {
  const double elapsed = elapsed_seconds();
  const int64_t done_here = count_ - options_.initial;
  const double rate = elapsed > 0 ? done_here / elapsed : 0;
  const double eta = total_ > 0 && rate > 0 ? (total_ - count_) / rate : -1;
  const std::string rate_text = fmt::format("{:.2f} {}/s", rate, options_.unit);
  const std::string description = options_.description.empty() ? "" : options_.description + " ";
  if (mode_ == ProgressMode::LINES) {
    std::string line = description + (total_ > 0 ? fmt::format("{}/{} ({:.0f}%)", count_, total_, 100.0 * count_ / total_)
                                                 : std::to_string(count_));
    line += fmt::format(" {} elapsed {}", rate_text, clock_text(elapsed));
    if (total_ > 0) line += " ETA " + clock_text(eta);
    if (!postfix_.empty()) line += " " + postfix_;
    return line;
  }
  std::string right = total_ > 0 ? fmt::format("| {}/{} [{}<{}, {}", count_, total_, clock_text(elapsed), clock_text(eta), rate_text)
                                 : fmt::format("{} [{}, {}", count_, clock_text(elapsed), rate_text);
  if (!postfix_.empty()) right += ", " + postfix_;
  right += "]";
  const int room = std::max(1, columns - 1);  // the last column left free: a full line would wrap on some terminals
  if (total_ <= 0) return fit_to_cells(description + right, room);
  const double fraction = static_cast<double>(count_) / total_;
  const std::string left = fmt::format("{}{:3.0f}%|", description, std::floor(100 * fraction));
  const int width = std::max(1, std::min(50, room - static_cast<int>(left.size() + right.size())));
  return fit_to_cells(left + bar_cells(fraction, width, utf8_terminal()) + right, room);
}

void ProgressBar::draw(bool final) {
  last_draw_ = std::chrono::steady_clock::now();
  if (mode_ == ProgressMode::BAR) {
    // \r, the frame, then erase what a longer previous frame left (ESC [K).
    fmt::print(out_, "\r{}\x1b[K{}", render(terminal_columns(out_)), final ? "\n" : "");
  } else {
    fmt::print(out_, "{}\n", render());
    count_at_last_line_ = count_;
  }
  std::fflush(out_);
}

void ProgressBar::close() {
  if (closed_) return;
  closed_ = true;
  if (mode_ == ProgressMode::BAR || count_ != count_at_last_line_) draw(true);
}

}  // namespace xlr8
