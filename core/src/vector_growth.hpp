// SPDX-License-Identifier: Apache-2.0
// reserve() with geometric growth, for the block and token vectors of the
// block tables (private to core).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvport::detail {

/// libstdc++'s reserve allocates exactly what is asked, which would make
/// one-token decode appends copy the whole vector every time: grow to at
/// least twice the capacity instead.
template <typename T>
void reserve_total(std::vector<T>& v, std::size_t total) {
  if (total > v.capacity()) v.reserve(std::max(total, 2 * v.capacity()));
}

}  // namespace kvport::detail
