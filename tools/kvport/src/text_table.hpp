// SPDX-License-Identifier: Apache-2.0
// A plain-text table with aligned columns, for the reports of the subcommands.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <vector>

namespace kvport::cli {

class TextTable {
 public:
  enum class Align { left, right };

  /// One column per header; `align` per column (default: left for the first,
  /// right for the others, which suits a label followed by numbers).
  explicit TextTable(std::vector<std::string> headers, std::vector<Align> align = {});

  /// Adds a row; missing cells are empty, extra cells are an error (logic_error).
  void add_row(std::vector<std::string> cells);

  /// Writes the header, a rule and the rows, columns separated by two spaces,
  /// each line prefixed with `indent`.
  void print(std::ostream& out, const std::string& indent = "") const;

 private:
  std::vector<std::string> headers_;
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace kvport::cli
