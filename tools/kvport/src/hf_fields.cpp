// SPDX-License-Identifier: Apache-2.0
#include "hf_fields.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <limits>

#include "text.hpp"

namespace kvport::cli {

using nlohmann::json;

std::string quote_config_text(std::string_view text, std::size_t max_bytes) {
  return "'" + text::one_line(text, max_bytes) + "'";
}

// Arrays and objects are named, not printed: dump() recurses once per level
// of nesting.
std::string short_dump(const json& value) {
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  if (value.is_string())
    return "\"" + text::one_line(value.get_ref<const std::string&>(), 37) + "\"";
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

InvalidArgument HfFields::error(std::string_view message) const {
  return InvalidArgument(fmt::format("HF config '{}': {}", source_, message));
}

const json* HfFields::find(std::string_view key) const {
  if (!object_.is_object()) return nullptr;
  const auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

bool HfFields::has(std::string_view key) const {
  return find(key) != nullptr;
}

namespace {

std::optional<std::size_t> as_size(const json& value, bool allow_zero) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const auto n = value.get<std::uint64_t>();
  if ((n == 0 && !allow_zero) || n > std::numeric_limits<std::size_t>::max()) return std::nullopt;
  return static_cast<std::size_t>(n);
}

}  // namespace

std::optional<std::size_t> HfFields::count(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (const auto n = as_size(*value, false)) return n;
  throw error(fmt::format("'{}' must be a positive integer, got {}", key, short_dump(*value)));
}

std::optional<std::size_t> HfFields::index(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (const auto n = as_size(*value, true)) return n;
  throw error(fmt::format("'{}' must be an integer >= 0, got {}", key, short_dump(*value)));
}

std::optional<std::size_t> HfFields::count_of(std::initializer_list<std::string_view> keys) const {
  std::optional<std::size_t> result;
  std::string_view first;
  for (std::string_view key : keys) {
    const std::optional<std::size_t> value = count(key);
    if (!value) continue;
    if (result && *result != *value) {
      throw error(fmt::format("'{}' is {} but '{}' is {}: the two name the same size", first,
                              *result, key, *value));
    }
    if (!result) {
      result = value;
      first = key;
    }
  }
  return result;
}

std::size_t HfFields::require_count(std::initializer_list<std::string_view> keys,
                                    std::string_view model_type) const {
  if (const std::optional<std::size_t> value = count_of(keys)) return *value;
  std::string names;
  for (std::string_view key : keys)
    names += fmt::format("{}'{}'", names.empty() ? "" : " or ", key);
  throw error(
      fmt::format("model_type {} needs {} for its KV cache", quote_config_text(model_type), names));
}

std::optional<std::string> HfFields::text(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) {
    throw error(fmt::format("'{}' must be a string, got {}", key, short_dump(*value)));
  }
  return value->get<std::string>();
}

std::optional<bool> HfFields::flag(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) {
    throw error(fmt::format("'{}' must be true or false, got {}", key, short_dump(*value)));
  }
  return value->get<bool>();
}

std::optional<std::vector<std::string>> HfFields::texts(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_array()) {
    throw error(fmt::format("'{}' must be an array of strings, got {}", key, short_dump(*value)));
  }
  std::vector<std::string> out;
  out.reserve(value->size());
  for (std::size_t i = 0; i < value->size(); ++i) {
    const json& item = (*value)[i];
    if (!item.is_string()) {
      throw error(fmt::format("'{}'[{}] must be a string, got {}", key, i, short_dump(item)));
    }
    out.push_back(item.get<std::string>());
  }
  return out;
}

std::optional<std::vector<std::size_t>> HfFields::indices(std::string_view key) const {
  const json* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_array()) {
    throw error(fmt::format("'{}' must be an array of integers, got {}", key, short_dump(*value)));
  }
  std::vector<std::size_t> out;
  out.reserve(value->size());
  for (std::size_t i = 0; i < value->size(); ++i) {
    const json& item = (*value)[i];
    const std::optional<std::size_t> n = as_size(item, true);
    if (!n) {
      throw error(
          fmt::format("'{}'[{}] must be an integer >= 0, got {}", key, i, short_dump(item)));
    }
    out.push_back(*n);
  }
  return out;
}

}  // namespace kvport::cli
