// SPDX-License-Identifier: Apache-2.0
// Private: one report of every KV cache group's invariants.
#pragma once

#include <span>

#include "kvport/core/paged_kv_cache.hpp"

namespace kvport::detail {

/// The groups' reports summed, each violation prefixed with "group g: ".
InvariantReport merge_group_reports(std::span<const InvariantReport> reports);

}  // namespace kvport::detail
