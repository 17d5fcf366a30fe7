// SPDX-License-Identifier: Apache-2.0
#include "text_table.hpp"

#include <algorithm>
#include <ostream>
#include <stdexcept>

namespace kvport::cli {

TextTable::TextTable(std::vector<std::string> headers, std::vector<Align> align)
    : headers_(std::move(headers)), align_(std::move(align)) {
  for (std::size_t i = align_.size(); i < headers_.size(); ++i) {
    align_.push_back(i == 0 ? Align::left : Align::right);
  }
}

void TextTable::add_row(std::vector<std::string> cells) {
  if (cells.size() > headers_.size()) throw std::logic_error("TextTable: row has too many cells");
  cells.resize(headers_.size());
  rows_.push_back(std::move(cells));
}

void TextTable::print(std::ostream& out, const std::string& indent) const {
  std::vector<std::size_t> width(headers_.size());
  for (std::size_t c = 0; c < headers_.size(); ++c) {
    width[c] = headers_[c].size();
    for (const auto& row : rows_)
      width[c] = std::max(width[c], row[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string text = indent;
    for (std::size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) text += "  ";
      const std::string pad(width[c] - cells[c].size(), ' ');
      text += align_[c] == Align::left ? cells[c] + pad : pad + cells[c];
    }
    while (!text.empty() && text.back() == ' ')
      text.pop_back();
    out << text << '\n';
  };
  line(headers_);
  std::vector<std::string> rule;
  for (std::size_t w : width)
    rule.emplace_back(w, '-');
  line(rule);
  for (const auto& row : rows_)
    line(row);
}

}  // namespace kvport::cli
