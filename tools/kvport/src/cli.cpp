// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/cli.hpp"

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "command.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "text.hpp"

#ifndef KVPORT_VERSION
#define KVPORT_VERSION "unknown"
#endif

namespace kvport::cli {
namespace {

// Every subcommand, in the order `kvport --help` lists them. To add one, write
// its <name>_command.cpp with a make_<name>_command() and add a row here.
constexpr CommandInfo kCommands[] = {
    {"plan", "Capacity planning: blocks and tokens of a model's KV cache in a memory budget",
     &make_plan_command},
    {"demo", "Run a simulated serving loop on a PagedKvCache and check its invariants",
     &make_demo_command},
    {"conformance", "Run the backend conformance suite and print a pass/skip/fail summary",
     &make_conformance_command},
    {"bench", "Compare block-zeroing strategies on a backend and print the throughput ratios",
     &make_bench_command},
    {"replay", "Replay a Mooncake request trace over the prefix cache: hit rate, evictions",
     &make_replay_command},
    {"disagg",
     "Move KV blocks between prefill and decode processes over UCX: throughput, leases, kills",
     &make_disagg_command},
    {"cluster",
     "Route a trace over engine instances by their KV events: cluster hits, load balance, kills",
     &make_cluster_command},
};

void print_error(std::ostream& err, std::string_view message) {
  err << "kvport: error: " << text::one_line(message) << '\n' << std::flush;
}

// Sets the log level for one run() and restores the previous level after it.
class LogLevelScope {
 public:
  explicit LogLevelScope(std::optional<log::Level> level) : previous_(log::level()) {
    if (level) {
      log::set_level(*level);
    } else if (const char* env = std::getenv("KVPORT_LOG_LEVEL"); env == nullptr || *env == '\0') {
      // The commands print their own reports; the library's info lines
      // ("KV cache on host: ...") would only repeat them.
      log::set_level(log::Level::warn);
    }
  }
  ~LogLevelScope() { log::set_level(previous_); }
  LogLevelScope(const LogLevelScope&) = delete;
  LogLevelScope& operator=(const LogLevelScope&) = delete;

 private:
  log::Level previous_;
};

int run_unchecked(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"kvport: a vendor-portable paged KV-cache runtime", "kvport"};
  app.set_version_flag("--version", std::string("kvport ") + KVPORT_VERSION);
  app.require_subcommand(0, 1);
  std::string log_level_text;
  CLI::Option* log_level_option =
      app.add_option("--log-level", log_level_text,
                     "Library log level: trace, debug, info, warn, error, critical, off "
                     "(default: $KVPORT_LOG_LEVEL, else warn)");
  log_level_option->type_name("LEVEL");

  std::vector<std::pair<CLI::App*, std::unique_ptr<Command>>> commands;
  for (const CommandInfo& info : kCommands) {
    CLI::App* sub = app.add_subcommand(info.name, info.description);
    std::unique_ptr<Command> command = info.make();
    command->add_options(*sub);
    commands.emplace_back(sub, std::move(command));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help and --version are successes; every other parse error is bad input.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      app.exit(e, out, err);
      out << std::flush;
      return kExitOk;
    }
    print_error(err, e.what());
    return kExitError;
  }

  // parse_level's own message names $KVPORT_LOG_LEVEL; a bad environment value
  // is bad input too (the library would warn and fall back to info).
  std::optional<log::Level> log_level;
  if (log_level_option->count() > 0) {
    try {
      log_level = log::parse_level(log_level_text);
    } catch (const InvalidArgument&) {
      throw InvalidArgument("--log-level: unknown log level '" + log_level_text +
                            "' (expected trace, debug, info, warn, error, critical or off)");
    }
  } else if (const char* env = std::getenv("KVPORT_LOG_LEVEL"); env != nullptr && *env != '\0') {
    (void)log::parse_level(env);
  }
  const LogLevelScope log_scope(log_level);

  for (auto& [sub, command] : commands) {
    if (sub->parsed()) {
      const int code = command->execute(out, err);
      out << std::flush;
      return code;
    }
  }
  std::string names;
  for (const CommandInfo& info : kCommands)
    names += (names.empty() ? "" : ", ") + std::string(info.name);
  print_error(err, "missing subcommand (one of: " + names + "); see kvport --help");
  return kExitError;
}

}  // namespace

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  try {
    return run_unchecked(argc, argv, out, err);
  } catch (const Error& e) {
    print_error(err, e.what());
  } catch (const CLI::Error& e) {
    print_error(err, e.what());
  } catch (const std::exception& e) {
    print_error(err, std::string("unexpected failure: ") + e.what());
  } catch (...) {
    print_error(err, "unexpected failure of an unknown kind");
  }
  return kExitError;
}

}  // namespace kvport::cli
