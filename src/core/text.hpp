#pragma once
// Small string helpers shared by config validation and error messages.
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

}  // namespace xlr8::text
