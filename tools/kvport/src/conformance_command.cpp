// SPDX-License-Identifier: Apache-2.0
// `kvport conformance`: runs the backend conformance suite (the
// kvport_conformance test binary beside this program) for one backend or all
// of them, and prints a pass / skip / fail summary per backend.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "command.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"

namespace kvport::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSuiteBinary = "kvport_conformance";

struct BackendTally {
  int passed = 0;
  int skipped = 0;
  int failed = 0;
  std::vector<std::string> failed_tests;
  std::string skip_reason;  // why the backend has no device (the suite skips for that reason)
};

// The suite binary: --suite, else $KVPORT_CONFORMANCE, else beside this
// executable (bin/kvport -> bin/kvport_conformance).
fs::path find_suite(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("KVPORT_CONFORMANCE"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw InvalidArgument("conformance: cannot locate this executable; pass --suite PATH");
  return self.parent_path() / kSuiteBinary;
}

// Runs `argv` with its stdout and stderr sent to `log`; returns the exit status.
int run_process(const std::vector<std::string>& argv, const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("conformance: fork failed");
  if (pid == 0) {
    std::FILE* f = std::fopen(log.c_str(), "w");
    if (f != nullptr) {
      ::dup2(::fileno(f), STDOUT_FILENO);
      ::dup2(::fileno(f), STDERR_FILENO);
    }
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A scratch folder for the suite's report and log, removed unless kept.
struct ScratchDir {
  fs::path path = fs::temp_directory_path() / fmt::format("kvport-conformance-{}", ::getpid());
  bool keep = false;
  ScratchDir() { fs::create_directories(path); }
  ~ScratchDir() {
    std::error_code ec;
    if (!keep) fs::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
};

// The backends the suite is instantiated for (compiled ones plus its test
// backends), from --gtest_list_tests: "  MemsetSizes/host  # GetParam() = ...".
std::vector<std::string> suite_backends(const fs::path& suite, const fs::path& listing) {
  run_process({suite.string(), "--gtest_list_tests", "--gtest_filter=Backends/Conformance.*"},
              listing);
  std::vector<std::string> names;
  std::ifstream in(listing);
  for (std::string line; std::getline(in, line);) {
    if (!line.starts_with("  ")) continue;
    const std::string test = line.substr(2, line.find(' ', 2) - 2);
    const std::string name = test.substr(test.rfind('/') + 1);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

// Test names look like "Backends/Conformance.MemsetSizes/host": the backend
// is the parameter after the last '/'.
std::map<std::string, BackendTally> tally(const nlohmann::json& report) {
  std::map<std::string, BackendTally> out;
  for (const auto& suite : report.at("testsuites")) {
    for (const auto& test : suite.at("testsuite")) {
      const std::string name = test.at("name").get<std::string>();
      const std::string backend = name.substr(name.rfind('/') + 1);
      BackendTally& t = out[backend];
      const bool failed = test.contains("failures") && !test.at("failures").empty();
      if (failed) {
        ++t.failed;
        t.failed_tests.push_back(suite.at("name").get<std::string>() + "." + name);
      } else if (test.value("result", "") == "SKIPPED") {
        ++t.skipped;
      } else {
        ++t.passed;
      }
    }
  }
  return out;
}

class ConformanceCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Examples:\n"
        "  kvport conformance                   # every compiled backend\n"
        "  kvport conformance --backend cuda --json\n"
        "A backend without a device reports its tests as skipped, with the reason.");
    backend_option_ =
        app.add_option("--backend", backend_, "Backend to check (default: every compiled backend)")
            ->type_name("NAME");
    filter_option_ =
        app.add_option("--filter", filter_, "Only tests whose name matches this gtest pattern")
            ->type_name("PATTERN");
    suite_option_ = app.add_option("--suite", suite_,
                                   "Path of the kvport_conformance binary (default: "
                                   "$KVPORT_CONFORMANCE, else beside kvport)")
                        ->type_name("PATH");
    app.add_flag("--json", json_, "Print one JSON object instead of the summary");
  }

  int execute(std::ostream& out, std::ostream& /*err*/) override {
    check_flags();
    const fs::path suite = find_suite(suite_);
    std::error_code ec;
    if (!fs::exists(suite, ec)) {
      throw InvalidArgument(fmt::format(
          "conformance: suite binary '{}' not found (build the kvport_conformance target, or "
          "pass --suite PATH)",
          suite.string()));
    }
    if (!fs::is_regular_file(suite, ec) || ::access(suite.c_str(), X_OK) != 0) {
      throw InvalidArgument(
          fmt::format("conformance: suite binary '{}' is not an executable file{}", suite.string(),
                      fs::is_directory(suite, ec) ? " (it is a directory)" : ""));
    }
    ScratchDir scratch;
    const fs::path& dir = scratch.path;
    if (!backend_.empty()) {
      const std::vector<std::string> names = suite_backends(suite, dir / "list.txt");
      if (std::find(names.begin(), names.end(), backend_) == names.end()) {
        throw InvalidArgument(fmt::format("--backend: unknown backend '{}' (the suite has: {})",
                                          backend_, fmt::join(names, ", ")));
      }
    }

    const fs::path report_path = dir / "report.json", log_path = dir / "suite.log";
    const std::string filter =
        fmt::format("Backends/Conformance.{}/{}", filter_.empty() ? "*" : filter_,
                    backend_.empty() ? "*" : backend_);
    const int status = run_process(
        {suite.string(), "--gtest_filter=" + filter, "--gtest_output=json:" + report_path.string()},
        log_path);
    nlohmann::json report;
    {
      std::ifstream in(report_path);
      if (!in) {
        scratch.keep = true;  // keep the log the message points to
        throw Error(
            fmt::format("conformance: the suite exited with status {} and wrote no report; "
                        "its log is {}",
                        status, log_path.string()));
      }
      report = nlohmann::json::parse(in);
    }
    std::map<std::string, BackendTally> results = tally(report);
    // gtest's JSON report carries no skip message; the suite skips a backend
    // for exactly the reason its probe gives, so take that.
    for (const BackendInfo& info : compiled_backends()) {
      auto it = results.find(info.name);
      if (it != results.end() && it->second.skipped > 0) {
        it->second.skip_reason = info.unavailable_reason;
      }
    }
    if (results.empty()) {
      throw InvalidArgument(fmt::format("conformance: no test matches '{}'", filter));
    }
    bool any_failed = false;
    for (const auto& [name, t] : results)
      any_failed = any_failed || t.failed > 0;
    if (json_) {
      print_json(out, results, suite);
    } else {
      print_text(out, results, suite);
    }
    if (any_failed) {
      scratch.keep = true;  // the user wants the suite's log
      out << "Suite log: " << log_path.string() << '\n';
    }
    return any_failed ? kExitCheckFailed : kExitOk;
  }

 private:
  static void print_text(std::ostream& out, const std::map<std::string, BackendTally>& results,
                         const fs::path& suite) {
    out << fmt::format("kvport conformance ({})\n\n", suite.string());
    out << fmt::format("{:<10} {:>7} {:>8} {:>7}\n", "Backend", "passed", "skipped", "failed");
    for (const auto& [name, t] : results) {
      out << fmt::format("{:<10} {:>7} {:>8} {:>7}\n", name, t.passed, t.skipped, t.failed);
    }
    for (const auto& [name, t] : results) {
      if (t.skipped > 0 && !t.skip_reason.empty()) {
        out << fmt::format("\n{} tests skipped: {}", t.skipped, t.skip_reason);
      }
      for (const std::string& test : t.failed_tests)
        out << fmt::format("\n{}: FAILED {}", name, test);
    }
    out << '\n';
  }

  static void print_json(std::ostream& out, const std::map<std::string, BackendTally>& results,
                         const fs::path& suite) {
    nlohmann::json j;
    j["suite"] = suite.string();
    j["backends"] = nlohmann::json::array();
    for (const auto& [name, t] : results) {
      j["backends"].push_back({{"backend", name},
                               {"passed", t.passed},
                               {"skipped", t.skipped},
                               {"failed", t.failed},
                               {"failed_tests", t.failed_tests},
                               {"skip_reason", t.skip_reason}});
    }
    out << j.dump(2) << '\n';
  }

  // The flags are spliced into a gtest filter "Backends/Conformance.<filter>/<backend>",
  // where ':' starts another pattern and '-' the negative ones; test and
  // backend names are identifiers. An empty value is an error, not "all".
  void check_flags() const {
    const auto require = [](const CLI::Option* option, const std::string& value, const char* flag) {
      if (option != nullptr && option->count() > 0 && value.empty()) {
        throw InvalidArgument(fmt::format("{}: empty value", flag));
      }
    };
    require(backend_option_, backend_, "--backend");
    require(filter_option_, filter_, "--filter");
    require(suite_option_, suite_, "--suite");
    const auto name_chars = [](const std::string& value, bool wildcards) {
      return std::all_of(value.begin(), value.end(), [&](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' ||
               (wildcards && (c == '*' || c == '?'));
      });
    };
    if (!name_chars(filter_, true)) {
      throw InvalidArgument(fmt::format(
          "--filter: '{}' is not a test name pattern (letters, digits, '_', '*' and '?' only)",
          filter_));
    }
    if (!name_chars(backend_, false)) {
      throw InvalidArgument(fmt::format(
          "--backend: '{}' is not a backend name (letters, digits and '_' only)", backend_));
    }
  }

  std::string backend_;
  std::string filter_;
  std::string suite_;
  CLI::Option* backend_option_ = nullptr;
  CLI::Option* filter_option_ = nullptr;
  CLI::Option* suite_option_ = nullptr;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_conformance_command() {
  return std::make_unique<ConformanceCommand>();
}

}  // namespace kvport::cli
