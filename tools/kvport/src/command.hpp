// SPDX-License-Identifier: Apache-2.0
// One `kvport` subcommand. Each lives in its own file (plan_command.cpp,
// demo_command.cpp, ...) and is listed once in cli.cpp's command table.
#pragma once

#include <iosfwd>
#include <memory>

namespace CLI {
class App;
}

namespace kvport::cli {

class Command {
 public:
  virtual ~Command() = default;

  /// Declares the subcommand's options on `app` (the subcommand's own
  /// CLI::App, already named and described), bound to members of this object.
  virtual void add_options(CLI::App& app) = 0;

  /// Runs after a successful parse; returns the exit code (0 success, 1 a
  /// check failed). Bad input is reported by throwing kvport::InvalidArgument:
  /// run() prints it as one "kvport: error: " line and exits 2.
  virtual int execute(std::ostream& out, std::ostream& err) = 0;
};

/// A subcommand's entry in the command table.
struct CommandInfo {
  const char* name;
  const char* description;
  std::unique_ptr<Command> (*make)();
};

/// The subcommands, one factory per <name>_command.cpp: `kvport plan`
/// (capacity planning), `kvport demo` (a serving loop on a real cache),
/// `kvport conformance` (the backend conformance suite), `kvport bench`
/// (the block-zeroing comparison of kvport::sim::ZeroingBench) and `kvport
/// replay` (a Mooncake trace over the prefix cache, replay.hpp) and `kvport
/// disagg` (prefill and decode processes moving blocks over UCX) and `kvport
/// cluster` (instances publishing KV events, routed by a router process).
std::unique_ptr<Command> make_plan_command();
std::unique_ptr<Command> make_demo_command();
std::unique_ptr<Command> make_conformance_command();
std::unique_ptr<Command> make_bench_command();
std::unique_ptr<Command> make_replay_command();
std::unique_ptr<Command> make_disagg_command();
/// What `kvport disagg` is in a build without block transfer
/// (KVPORT_WITH_TRANSFER=OFF): any arguments, and execute() throws
/// InvalidArgument "disagg: not built: ..." (one line, exit 2).
std::unique_ptr<Command> make_disagg_unavailable_command();
std::unique_ptr<Command> make_cluster_command();

}  // namespace kvport::cli
