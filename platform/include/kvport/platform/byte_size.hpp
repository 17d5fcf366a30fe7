// SPDX-License-Identifier: Apache-2.0
// Human-readable byte sizes: "80GiB", "512 MiB", "1.5GB", "4096".
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvport {

/// Parses a byte count with an optional unit: B, KB/MB/GB/TB (powers of 1000)
/// or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive, with an optional
/// space and a decimal fraction ("1.5GiB"). Throws InvalidArgument naming the
/// text when it is empty, negative, malformed, has an unknown unit or does not
/// fit in size_t.
std::size_t parse_byte_size(std::string_view text);

/// Formats `bytes` with a binary unit and two decimals: "1.50 GiB".
std::string format_bytes(std::size_t bytes);

}  // namespace kvport
