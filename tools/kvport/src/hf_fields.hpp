// SPDX-License-Identifier: Apache-2.0
// Typed reads of the fields of one object of a Hugging Face config.json (the
// top level, or a multimodal config's "text_config"), each error one line
// that names the config and the field.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/platform/error.hpp"

namespace kvport::cli {

/// A string of the config (a name, an unknown value) as a message quotes it:
/// in single quotes, control characters and bytes that are not UTF-8 written
/// as \xNN, cut to `max_bytes` with "...".
std::string quote_config_text(std::string_view text, std::size_t max_bytes = 64);

/// A JSON value for a message, cut short (arrays and objects are named only).
std::string short_dump(const nlohmann::json& value);

/// The fields of one config object. A field that is absent or null reads as
/// absent everywhere.
class HfFields {
 public:
  HfFields(const nlohmann::json& object, std::string_view source)
      : object_(object), source_(source) {}

  const nlohmann::json& object() const noexcept { return object_; }
  std::string_view source() const noexcept { return source_; }

  /// An InvalidArgument "HF config 'SOURCE': MESSAGE".
  InvalidArgument error(std::string_view message) const;

  /// Present and not null.
  bool has(std::string_view key) const;

  /// A count > 0 (InvalidArgument "'key' must be a positive integer, got X").
  std::optional<std::size_t> count(std::string_view key) const;
  /// An integer >= 0.
  std::optional<std::size_t> index(std::string_view key) const;
  /// The first of `keys` that is present (aliases: "n_groups" or
  /// "mamba_n_groups"); InvalidArgument when two of them disagree.
  std::optional<std::size_t> count_of(std::initializer_list<std::string_view> keys) const;
  /// count_of(keys), or InvalidArgument "model_type 'T' needs 'KEY'".
  std::size_t require_count(std::initializer_list<std::string_view> keys,
                            std::string_view model_type) const;

  std::optional<std::string> text(std::string_view key) const;
  std::optional<bool> flag(std::string_view key) const;
  /// An array of strings.
  std::optional<std::vector<std::string>> texts(std::string_view key) const;
  /// An array of integers >= 0.
  std::optional<std::vector<std::size_t>> indices(std::string_view key) const;

 private:
  const nlohmann::json* find(std::string_view key) const;

  const nlohmann::json& object_;
  std::string_view source_;
};

}  // namespace kvport::cli
