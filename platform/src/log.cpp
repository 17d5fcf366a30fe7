// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include "kvport/platform/error.hpp"

namespace kvport::log {
namespace {

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace:
      return spdlog::level::trace;
    case Level::debug:
      return spdlog::level::debug;
    case Level::info:
      return spdlog::level::info;
    case Level::warn:
      return spdlog::level::warn;
    case Level::error:
      return spdlog::level::err;
    case Level::critical:
      return spdlog::level::critical;
    case Level::off:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

struct Logger {
  std::shared_ptr<spdlog::logger> logger;
  std::atomic<Level> level{Level::info};
  std::mutex sink_mutex;
  Sink sink;

  Logger() {
    logger = spdlog::get("kvport");
    if (!logger) {
      logger = std::make_shared<spdlog::logger>(
          "kvport", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
      logger->set_pattern("[%H:%M:%S.%e] [kvport] [%l] %v");
    }
    logger->set_level(spdlog::level::trace);  // filtering happens in `enabled`
    if (const char* env = std::getenv("KVPORT_LOG_LEVEL"); env != nullptr && *env != '\0') {
      try {
        level = parse_level(env);
      } catch (const InvalidArgument& e) {
        logger->warn("{}; using 'info'", e.what());
      }
    }
  }
};

Logger& instance() {
  static Logger logger;
  return logger;
}

}  // namespace

Level parse_level(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "trace") return Level::trace;
  if (lower == "debug") return Level::debug;
  if (lower == "info") return Level::info;
  if (lower == "warn" || lower == "warning") return Level::warn;
  if (lower == "error" || lower == "err") return Level::error;
  if (lower == "critical") return Level::critical;
  if (lower == "off") return Level::off;
  throw InvalidArgument("KVPORT_LOG_LEVEL: unknown log level '" + std::string(text) +
                        "' (expected trace, debug, info, warn, error, critical or off)");
}

Level level() noexcept {
  return instance().level.load(std::memory_order_relaxed);
}

void set_level(Level level) noexcept {
  instance().level.store(level, std::memory_order_relaxed);
}

bool enabled(Level lvl) noexcept {
  return lvl != Level::off && lvl >= level();
}

void write(Level lvl, std::string_view message) noexcept {
  if (!enabled(lvl)) return;
  try {
    Logger& l = instance();
    {
      std::lock_guard lock(l.sink_mutex);
      if (l.sink) l.sink(lvl, message);
    }
    l.logger->log(to_spdlog(lvl), "{}", message);
  } catch (...) {  // logging must never take the caller down
  }
}

Sink set_sink(Sink sink) {
  Logger& l = instance();
  std::lock_guard lock(l.sink_mutex);
  std::swap(l.sink, sink);
  return sink;
}

struct ScopedCapture::State {
  mutable std::mutex mutex;
  std::string text;
};

ScopedCapture::ScopedCapture() : state_(new State) {
  State* state = state_;
  previous_ = set_sink([state](Level, std::string_view message) {
    std::lock_guard lock(state->mutex);
    state->text.append(message);
    state->text.push_back('\n');
  });
}

ScopedCapture::~ScopedCapture() {
  set_sink(std::move(previous_));
  delete state_;
}

std::string ScopedCapture::text() const {
  std::lock_guard lock(state_->mutex);
  return state_->text;
}

}  // namespace kvport::log
