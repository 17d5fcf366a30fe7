// SPDX-License-Identifier: Apache-2.0
// The --events-form flag's value (and a cluster spec's events_form), shared
// by `kvport replay` and `kvport cluster`.
#pragma once

#include <fmt/format.h>

#include <string>

#include "kvport/events/wire.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli {

/// The form named "map" or "positional". Throws InvalidArgument otherwise
/// (the message names --events-form).
inline events::EventForm event_form(const std::string& name) {
  if (name == "map") return events::EventForm::map;
  if (name == "positional") return events::EventForm::positional;
  throw InvalidArgument(
      fmt::format("--events-form: unknown form '{}' (expected map or positional)", name));
}

}  // namespace kvport::cli
