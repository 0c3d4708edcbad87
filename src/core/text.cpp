#include "core/text.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace xlr8::text {

static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      size_t cost = std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1;
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + cost});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_distance) best_distance = d, best = c;
  }
  // Only suggest when at most about a third of the word differs.
  return best_distance <= std::max<size_t>(2, word.size() / 3) ? best : "";
}

std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string hint = closest(word, candidates);
  return hint.empty() ? "" : " (did you mean \"" + hint + "\"?)";
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string capped(const std::vector<std::string>& items, size_t shown) {
  if (items.size() <= shown) return join(items);
  std::vector<std::string> first(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(shown));
  return fmt::format("{}, ... and {} more", join(first), items.size() - shown);
}

std::string listing(const std::vector<std::string>& items, size_t shown) { return "[" + capped(items, shown) + "]"; }

std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected) {
  if (missing.empty() || missing.size() != unexpected.size()) return "";
  auto every = [](const std::vector<std::string>& shorter, const std::vector<std::string>& longer, std::string& prefix) {
    const auto& first = shorter.front();
    auto it = std::find_if(longer.begin(), longer.end(), [&](const std::string& l) {
      return l.size() > first.size() && l.compare(l.size() - first.size(), first.size(), first) == 0;
    });
    if (it == longer.end()) return false;
    prefix = it->substr(0, it->size() - first.size());
    for (const auto& name : shorter)
      if (std::find(longer.begin(), longer.end(), prefix + name) == longer.end()) return false;
    return true;
  };
  std::string prefix;
  if (every(missing, unexpected, prefix))
    return fmt::format("; every missing name is there with \"{}\" in front", prefix);
  if (every(unexpected, missing, prefix))
    return fmt::format("; every missing name is there without its \"{}\" in front", prefix);
  return "";
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(sep, start);
    if (end == std::string::npos) end = text.size();
    std::string part = trim(text.substr(start, end - start));
    if (!part.empty()) parts.push_back(part);
    start = end + 1;
  }
  return parts;
}

std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::toupper(c); });
  return s;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string bytes(int64_t n) {
  if (n < 1000) return fmt::format("{} B", n);
  const char* units[] = {"KB", "MB", "GB", "TB"};
  double v = static_cast<double>(n);
  int u = -1;
  while (v >= 1000 && u < 3) v /= 1000, ++u;
  return fmt::format("{:.1f} {}", v, units[u]);
}

}  // namespace xlr8::text
