// SPDX-License-Identifier: Apache-2.0
// The logging facade. spdlog stays behind it (compiled into kvport), so an
// engine that ships its own spdlog or fmt does not clash with kvport's.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace kvport::log {

enum class Level { trace, debug, info, warn, error, critical, off };

/// Parses "trace", "debug", "info", "warn"/"warning", "error", "critical",
/// "off" (case-insensitive). Throws InvalidArgument naming the bad value.
Level parse_level(std::string_view text);

/// The current level. Initialised on first use from `KVPORT_LOG_LEVEL`
/// (default "info"; an unparsable value falls back to info with a warning).
Level level() noexcept;
void set_level(Level level) noexcept;
bool enabled(Level level) noexcept;

/// Writes one message to the "kvport" logger (stderr). Never throws.
void write(Level level, std::string_view message) noexcept;

inline void debug(std::string_view m) noexcept {
  write(Level::debug, m);
}
inline void info(std::string_view m) noexcept {
  write(Level::info, m);
}
inline void warn(std::string_view m) noexcept {
  write(Level::warn, m);
}
inline void error(std::string_view m) noexcept {
  write(Level::error, m);
}

/// Receives every message that passes the level filter, in addition to the
/// logger. For tests and for engines that forward kvport's log elsewhere.
using Sink = std::function<void(Level, std::string_view)>;

/// Installs `sink` (an empty function removes it) and returns the previous one.
Sink set_sink(Sink sink);

/// RAII capture of log messages into a string, restoring the previous sink.
class ScopedCapture {
 public:
  ScopedCapture();
  ~ScopedCapture();
  ScopedCapture(const ScopedCapture&) = delete;
  ScopedCapture& operator=(const ScopedCapture&) = delete;

  /// Every captured message, one per line.
  std::string text() const;

 private:
  Sink previous_;
  struct State;
  State* state_;
};

}  // namespace kvport::log
