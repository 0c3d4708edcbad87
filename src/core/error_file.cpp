// The worker's side (writing, the terminate handler) and the launcher's side (reading) of the error file.
#include "core/error_file.hpp"

#include <cxxabi.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <typeinfo>

#include "xlr8/env.hpp"

namespace xlr8::core {

bool is_backtrace_line(const std::string& line) {
  // Every worker stderr line passes here: most have none of the patterns' fixed parts, skip the regex.
  if (line.find('#') == std::string::npos && line.find("Exception raised") == std::string::npos &&
      line.find("CapturedTraceback") == std::string::npos && line.find("<omitting") == std::string::npos)
    return false;
  // c10::Error's what() (LibTorch 1.x and 2.x), and 2.x's captured tracebacks.
  static const std::regex pattern(
      R"(\s*(frame #\d+: .*|#\d+ .* from .*|Exception raised from .*\(most recent call first\):|C\+\+ CapturedTraceback:|<omitting python frames>))");
  return std::regex_match(line, pattern);
}

std::string describe_exception(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status),
                                              std::free);
  return std::string(status == 0 && name ? name.get() : typeid(e).name()) + ": " + e.what();
}

namespace {
// LibTorch's c10::Error carries its backtrace in what(): the message is what comes before it, the whole
// text goes where torch keeps the traceback.
std::string without_backtrace(const std::string& text) {
  std::string message;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    if (is_backtrace_line(line)) break;
    message += (message.empty() ? "" : "\n") + line;
    start = end + 1;
  }
  return message;
}
}  // namespace

void write_error_file(const std::string& message) {
  const std::string path = env_var("TORCHELASTIC_ERROR_FILE").value_or("");
  if (path.empty()) return;
  try {
    namespace fs = std::filesystem;
    if (fs::exists(path)) return;
    if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path());
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    nlohmann::json record{
        {"message",
         {{"message", without_backtrace(message)},
          {"extraInfo",
           {{"py_callstack", message},
            {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
    std::ofstream out(path);
    out << record.dump(2) << "\n";
  } catch (...) {  // reporting an error must not become one
  }
}

std::optional<ErrorFileRecord> read_error_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  try {
    auto record = nlohmann::json::parse(in);
    const auto& message = record.at("message");
    ErrorFileRecord result;
    if (message.is_string()) {  // torch also accepts a plain string message
      result.message = message.get<std::string>();
      return result;
    }
    result.message = message.at("message").get<std::string>();
    if (auto info = message.find("extraInfo"); info != message.end() && info->contains("timestamp")) {
      const auto& stamp = info->at("timestamp");
      result.timestamp = stamp.is_string() ? std::stoll(stamp.get<std::string>()) : stamp.get<long long>();
    }
    return result;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

namespace {
std::terminate_handler previous_handler = nullptr;

[[noreturn]] void record_then_terminate() {
  if (auto in_flight = std::current_exception()) {
    try {
      std::rethrow_exception(in_flight);
    } catch (const std::exception& e) {
      write_error_file(describe_exception(e));
    } catch (...) {
      write_error_file("unknown exception (not derived from std::exception)");
    }
  }
  if (previous_handler) previous_handler();
  std::abort();
}
}  // namespace

void install_error_file_handler() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  previous_handler = std::set_terminate(record_then_terminate);
}

}  // namespace xlr8::core
