#pragma once
// Small string helpers shared by config validation and error messages.
#include <cstdint>
#include <string>
#include <vector>

namespace xlr8::text {

// The candidate closest to `word` by edit distance, or "" when none is reasonably close.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);
// " (did you mean "x"?)" for the closest candidate, or "" when none is close: appended to error messages.
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates);
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");
std::vector<std::string> split(const std::string& text, char sep);
std::string upper(std::string s);
std::string lower(std::string s);
std::string trim(const std::string& s);
// Up to the first newline: exception texts from LibTorch carry a stack trace after it.
std::string first_line(const std::string& s);
// "a, b, c", or the first `shown` items and "... and N more": messages name what differs, briefly.
std::string capped(const std::vector<std::string>& items, size_t shown = 10);
// The same in brackets: "[a, b, c]".
std::string listing(const std::vector<std::string>& items, size_t shown = 10);
// Names that match a model's but for a prefix (a wrapper's "module.", a model saved as a submodule):
// when every missing name is an unexpected one with one prefix added or removed, a clause saying so
// ("; every missing name is there with \"module.\" in front"), else "".
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected);
// A size for people: "168 B", "2.4 KB", "1.2 MB", "3.1 GB" (powers of 1000, as the memory figures).
std::string bytes(int64_t n);

}  // namespace xlr8::text
