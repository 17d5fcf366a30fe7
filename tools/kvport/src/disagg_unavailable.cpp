// SPDX-License-Identifier: Apache-2.0
// `kvport disagg` in a build without block transfer (KVPORT_WITH_TRANSFER=OFF,
// or no UCX found): the command is listed, takes any arguments, and says in
// one line that it was not built (exit 2, as for bad input).
#include <CLI/CLI.hpp>
#include <memory>
#include <ostream>

#include "command.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

class DisaggUnavailableCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    // Whatever a disagg run would be given: the answer is the same.
    app.allow_extras();
  }

  int execute(std::ostream& /*out*/, std::ostream& /*err*/) override {
    throw InvalidArgument(
        "disagg: not built: this kvport was configured without block transfer "
        "(KVPORT_WITH_TRANSFER=OFF or UCX not found); reconfigure with libucx-dev installed "
        "and -DKVPORT_WITH_TRANSFER=ON");
  }
};

}  // namespace

std::unique_ptr<Command> make_disagg_unavailable_command() {
  return std::make_unique<DisaggUnavailableCommand>();
}

#ifndef KVPORT_HAVE_TRANSFER
std::unique_ptr<Command> make_disagg_command() {
  return make_disagg_unavailable_command();
}
#endif

}  // namespace kvport::cli
