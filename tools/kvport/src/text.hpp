// Small string helpers shared by the command-line parsers.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace kvport::cli::text {

/// `s` without leading and trailing whitespace.
inline std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

/// ASCII lower case.
inline std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

/// `s` on one line: every run of line breaks and tabs becomes "; ", trailing
/// ones are dropped. Error messages from libraries (CLI11, JSON) can span lines,
/// and kvport promises one error line.
inline std::string one_line(std::string_view s) {
  std::string out;
  bool pending = false;
  for (char c : s) {
    if (c == '\n' || c == '\r' || c == '\t') {
      pending = true;
      continue;
    }
    if (pending && !out.empty()) out += "; ";
    pending = false;
    out += c;
  }
  return out;
}

}  // namespace kvport::cli::text
