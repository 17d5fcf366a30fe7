// SPDX-License-Identifier: Apache-2.0
// Kept for compatibility: kMaxCacheBlocks now lives in block_id.hpp, beside
// BlockId. Include that instead.
#pragma once

#include "kvport/core/block_id.hpp"
