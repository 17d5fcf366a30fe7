// SPDX-License-Identifier: Apache-2.0
// `kvport bench`: a short version of the block-zeroing comparison of the
// Google Benchmark suite (benchmarks/zeroing_bench.cpp), run in-process with
// kvport::sim::ZeroingBench on one backend: (a) reference, (b) batched and
// (c) limit on the same cache in the same run, and the ratios between them.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "command.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "kvport/sim/zeroing.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using sim::IdPattern;
using sim::StrategyResult;
using sim::ZeroingBench;
using sim::ZeroingResult;
using sim::ZeroingShape;

// What a run measures: every shape x layout x batch x id pattern selected.
struct BenchPlan {
  std::vector<ZeroingShape> shapes;
  std::vector<KvCacheLayout> layouts;
  std::vector<std::size_t> batches;  // ascending, no duplicates
  std::vector<IdPattern> patterns{IdPattern::contiguous, IdPattern::scattered};
  int repetitions = 0;

  std::size_t num_cases() const {
    return shapes.size() * layouts.size() * batches.size() * patterns.size();
  }
};

// The case the host target is stated for: 256 scattered llama-3-70b blocks,
// batched zeroing at >= 0.8x the limit.
constexpr std::string_view kTargetModel = "llama-3-70b";
constexpr std::size_t kTargetBatch = 256;
constexpr double kTargetRatio = 0.8;

constexpr int kFullRepetitions = 5;
constexpr int kQuickRepetitions = 2;
constexpr std::size_t kQuickMaxBatch = 32;
constexpr std::size_t kMaxBatch = std::size_t{1} << 20;
// Each batch size is a case per model, layout and id pattern.
constexpr std::size_t kMaxBatchSizes = 64;

// A comma-separated list of positive counts ("1,16,256"), sorted, duplicates
// dropped.
std::vector<std::size_t> parse_batches(std::string_view text) {
  std::vector<std::size_t> out;
  std::size_t start = 0;
  while (true) {
    if (out.size() == kMaxBatchSizes) {
      throw InvalidArgument(fmt::format("--batches: at most {} sizes", kMaxBatchSizes));
    }
    const std::size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    out.push_back(parse_positive_count(item, "--batches"));
    // The bench's cache holds 2 x batch blocks; keep ids and byte counts far
    // from overflow (memory runs out long before).
    if (out.back() > kMaxBatch) {
      throw InvalidArgument(
          fmt::format("--batches: at most {} blocks, got '{}'", kMaxBatch, text::trim(item)));
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

ZeroingShape find_shape(std::string_view name) {
  std::vector<ZeroingShape> shapes = sim::zeroing_shapes();
  const std::string wanted = text::lower(text::trim(name));
  std::vector<std::string> names;
  for (ZeroingShape& shape : shapes) {
    if (shape.name == wanted) return std::move(shape);
    names.push_back(shape.name);
  }
  throw InvalidArgument(
      fmt::format("--model: unknown bench model '{}' (known: {})", name, fmt::join(names, ", ")));
}

// Calls per batch are averages over identical repetitions, hence whole
// numbers; they are written as integers unless one is not.
nlohmann::ordered_json calls_json(double calls) {
  if (calls >= 0 && std::floor(calls) == calls) {
    return static_cast<std::uint64_t>(calls);
  }
  return calls;
}

nlohmann::ordered_json strategy_json(const StrategyResult& r) {
  return {{"seconds", r.seconds}, {"bytes_per_s", r.bytes_per_s}, {"calls", calls_json(r.calls)}};
}

std::string format_calls(double calls) {
  if (calls >= 0 && std::floor(calls) == calls) return fmt::format("{}", calls);
  return fmt::format("{:.1f}", calls);
}

double gb_per_s(double bytes_per_s) {
  return bytes_per_s / 1e9;
}

// One text row; fixed widths so that rows can be printed as they are measured.
constexpr std::string_view kRowFormat =
    "{:<16}  {:<11}  {:<10}  {:>5}  {:>10}  {:>8}  {:>8}  {:>8}  {:>7}  {:>7}  {:>7}  {:>6}  "
    "{:>7}\n";

class BenchCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Strategies, on the same cache in the same run:\n"
        "  (a) reference  one memset per layer for K and one for V, per block\n"
        "  (b) batched    PagedKvCache::zero_blocks: one backend call per batch\n"
        "  (c) limit      one contiguous memset of the same bytes\n"
        "Examples:\n"
        "  kvport bench --quick\n"
        "  kvport bench --backend host --json\n"
        "  kvport bench --model llama-3-8b --batches 1,16 --repetitions 1\n"
        "Exit status: 0, 1 when a strategy made an unexpected number of backend calls, 2 on bad "
        "input.");
    backend_option_ =
        app.add_option(
               "--backend", backend_,
               "Backend (host, cuda, hip; default $KVPORT_BACKEND, else the first GPU with a "
               "device, else host)")
            ->type_name("NAME")
            ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    app.add_flag("--quick", quick_,
                 "A few seconds on the host: llama-3-8b and llama-3-70b, batches 1 and 32, "
                 "2 repetitions");
    app.add_flag("--json", json_, "Print a JSON list of cases instead of the table");
    model_option_ = add_text(app, "--model", model_, "NAME",
                             "Only this model shape (llama-3-8b, llama-3-70b, llama-3-8b-mixed)");
    layout_option_ =
        add_text(app, "--layout", layout_, "LAYOUT", "Only this layout (layer_major, block_major)");
    batches_option_ = add_text(app, "--batches", batches_, "N[,N...]",
                               "Batch sizes in blocks (default 1,16,256; --quick 1,32)");
    repetitions_option_ = add_text(app, "--repetitions", repetitions_, "N",
                                   fmt::format("Repetitions of each case (default {}; --quick {})",
                                               kFullRepetitions, kQuickRepetitions));
  }

  int execute(std::ostream& out, std::ostream& err) override {
    const BenchPlan plan = make_plan();  // bad flags are reported before a backend starts
    std::unique_ptr<Backend> backend =
        backend_option_->count() > 0 ? kvport::make_backend(backend_) : default_backend();
    check_memory(*backend, plan);  // before the header: an error leaves stdout empty

    if (!json_) print_header(out, *backend, plan);
    const auto start = std::chrono::steady_clock::now();
    std::vector<ZeroingResult> results;
    results.reserve(plan.num_cases());
    for (const ZeroingShape& shape : plan.shapes) {
      for (KvCacheLayout layout : plan.layouts) {
        // One bench alive at a time, just big enough for the largest batch:
        // llama-3-70b with 256 blocks holds 3.75 GiB.
        ZeroingBench zb(*backend, shape, layout, plan.batches.back());
        // One discarded batch first: the first measurement after the
        // construction runs on cold caches and a sleeping stream worker.
        (void)zb.measure(plan.batches.front(), plan.patterns.front(), 1);
        for (std::size_t batch : plan.batches) {
          for (IdPattern pattern : plan.patterns) {
            results.push_back(zb.measure(batch, pattern, plan.repetitions));
            if (!json_) print_row(out, results.back());
          }
        }
      }
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    const std::vector<std::string> problems = check_calls(*backend, plan, results);
    if (json_) {
      print_json(out, backend->name(), plan, results);
    } else {
      print_footer(out, *backend, results, problems, elapsed);
    }
    for (const std::string& problem : problems)
      err << "kvport bench: " << problem << '\n';
    return problems.empty() ? kExitOk : kExitCheckFailed;
  }

 private:
  static CLI::Option* add_text(CLI::App& app, const char* name, std::string& value,
                               const char* type, const std::string& help) {
    return app.add_option(name, value, help)
        ->type_name(type)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
        ->group("Selection");
  }

  // The largest case holds 2 x batch cache blocks and a limit buffer of batch
  // blocks at once; a request for more than the backend has free fails here,
  // not after the header and a few cases have been printed.
  static void check_memory(const Backend& backend, const BenchPlan& plan) {
    const std::size_t free = backend.mem_info().free_bytes;
    const std::size_t batch = plan.batches.back();
    for (const ZeroingShape& shape : plan.shapes) {
      const std::size_t per_block = shape.config.bytes_per_block();
      const long double needed =
          3.0L * static_cast<long double>(batch) * static_cast<long double>(per_block);
      if (needed > static_cast<long double>(free)) {
        throw InvalidArgument(fmt::format(
            "--batches: {} blocks of {} need {} (2 x {} cache blocks and a limit buffer of {} "
            "blocks of {}), more than the {} free on the {} backend",
            batch, shape.name,
            format_bytes(static_cast<std::size_t>(std::min(
                needed, static_cast<long double>(std::numeric_limits<std::size_t>::max())))),
            batch, batch, format_bytes(per_block), format_bytes(free), backend.name()));
      }
    }
  }

  // A selection flag given with an empty value is an error, not a request for
  // the default.
  static void require_value(const CLI::Option* option, const std::string& value, const char* flag) {
    if (option != nullptr && option->count() > 0 && text::trim(value).empty()) {
      throw InvalidArgument(fmt::format("{}: empty value", flag));
    }
  }

  BenchPlan make_plan() const {
    require_value(model_option_, model_, "--model");
    require_value(layout_option_, layout_, "--layout");
    require_value(batches_option_, batches_, "--batches");
    require_value(repetitions_option_, repetitions_, "--repetitions");
    BenchPlan plan;
    if (!model_.empty()) {
      plan.shapes.push_back(find_shape(model_));
    } else if (quick_) {
      plan.shapes.push_back(find_shape("llama-3-8b"));
      plan.shapes.push_back(find_shape("llama-3-70b"));
    } else {
      plan.shapes = sim::zeroing_shapes();
    }
    if (!layout_.empty()) {
      plan.layouts = {parse_layout_value(layout_, "--layout")};
    } else {
      plan.layouts = {KvCacheLayout::layer_major, KvCacheLayout::block_major};
    }
    if (!batches_.empty()) {
      plan.batches = parse_batches(batches_);
    } else if (quick_) {
      // The largest batch sets the memory to touch: 3 x batch blocks (the
      // cache holds 2 x batch, the limit buffer 1 x). On the host each GiB
      // first touched costs about 3 s of page faults on a small VM, so --quick
      // stops at 32 blocks (480 MiB for llama-3-70b), already far larger than
      // the CPU caches; the 256-block target case is in the full run.
      plan.batches = {1, kQuickMaxBatch};
    } else {
      plan.batches = {1, 16, 256};
    }
    const std::size_t repetitions =
        repetitions_.empty()
            ? static_cast<std::size_t>(quick_ ? kQuickRepetitions : kFullRepetitions)
            : parse_positive_count(repetitions_, "--repetitions");
    if (repetitions > 1000) {
      throw InvalidArgument(
          fmt::format("--repetitions: at most 1000, got '{}'", text::trim(repetitions_)));
    }
    plan.repetitions = static_cast<int>(repetitions);
    return plan;
  }

  // (b) and (c) make one backend call per batch; (a) one per layer for K and
  // one for V, per block. Anything else means batching is broken.
  static std::vector<std::string> check_calls(const Backend& backend, const BenchPlan& plan,
                                              const std::vector<ZeroingResult>& results) {
    std::vector<std::string> problems;
    std::size_t i = 0;
    for (const ZeroingShape& shape : plan.shapes) {
      for (std::size_t l = 0; l < plan.layouts.size(); ++l) {
        for (std::size_t b = 0; b < plan.batches.size() * plan.patterns.size(); ++b, ++i) {
          const ZeroingResult& r = results[i];
          const double reference =
              2.0 * static_cast<double>(shape.config.num_layers) * static_cast<double>(r.batch);
          auto expect = [&](const char* strategy, double got, double want) {
            if (got != want) {
              problems.push_back(fmt::format(
                  "{}: {} {} {} batch {}: {} backend calls per batch, expected {}", backend.name(),
                  r.model, to_string(r.layout), to_string(r.ids), r.batch, strategy, got, want));
            }
          };
          expect("(a) reference", r.reference.calls, reference);
          expect("(b) batched", r.batched.calls, 1);
          expect("(c) limit", r.limit.calls, 1);
        }
      }
    }
    return problems;
  }

  void print_header(std::ostream& out, const Backend& backend, const BenchPlan& plan) const {
    const std::string mode =
        quick_ ? "quick"
               : (model_.empty() && layout_.empty() && batches_.empty() ? "full" : "subset");
    out << fmt::format(
        "kvport bench: block zeroing on the {} backend ({}: {} cases, {} repetition{} each)\n\n",
        backend.name(), mode, plan.num_cases(), plan.repetitions, plan.repetitions == 1 ? "" : "s");
    out << "(a) reference  one memset per layer for K and one for V, per block\n"
           "(b) batched    PagedKvCache::zero_blocks: one backend call per batch\n"
           "(c) limit      one contiguous memset of the same bytes\n\n";
    out << fmt::format(kRowFormat, "Model", "Layout", "Ids", "Batch", "Bytes", "(a) GB/s",
                       "(b) GB/s", "(c) GB/s", "(a) cal", "(b) cal", "(c) cal", "b/c", "b/a");
    out << fmt::format(kRowFormat, std::string(16, '-'), std::string(11, '-'), std::string(10, '-'),
                       std::string(5, '-'), std::string(10, '-'), std::string(8, '-'),
                       std::string(8, '-'), std::string(8, '-'), std::string(7, '-'),
                       std::string(7, '-'), std::string(7, '-'), std::string(6, '-'),
                       std::string(7, '-'));
    out << std::flush;
  }

  static void print_row(std::ostream& out, const ZeroingResult& r) {
    out << fmt::format(kRowFormat, r.model, to_string(r.layout), to_string(r.ids), r.batch,
                       format_bytes(r.bytes),
                       fmt::format("{:.2f}", gb_per_s(r.reference.bytes_per_s)),
                       fmt::format("{:.2f}", gb_per_s(r.batched.bytes_per_s)),
                       fmt::format("{:.2f}", gb_per_s(r.limit.bytes_per_s)),
                       format_calls(r.reference.calls), format_calls(r.batched.calls),
                       format_calls(r.limit.calls), fmt::format("{:.2f}x", r.batched_over_limit()),
                       fmt::format("{:.1f}x", r.batched_over_reference()));
    out << std::flush;
  }

  static void print_footer(std::ostream& out, const Backend& backend,
                           const std::vector<ZeroingResult>& results,
                           const std::vector<std::string>& problems, double elapsed) {
    out << "(cal: backend calls per batch; b/c: batched over limit; b/a: batched over reference; "
           "GB = 1e9 bytes)\n\n";
    if (problems.empty()) {
      out << "Calls    ok: (b) and (c) 1 backend call per batch, (a) 2 x layers x blocks\n";
    } else {
      out << fmt::format("Calls    FAILED: {} case(s) with unexpected backend call counts\n",
                         problems.size());
    }
    std::vector<std::string> target;
    for (const ZeroingResult& r : results) {
      if (r.model == kTargetModel && r.batch == kTargetBatch && r.ids == IdPattern::scattered) {
        target.push_back(fmt::format("{} {:.2f}x ({})", to_string(r.layout), r.batched_over_limit(),
                                     r.batched_over_limit() >= kTargetRatio ? "met" : "missed"));
      }
    }
    if (target.empty()) {
      out << fmt::format(
          "Target   not measured: the target case is {} scattered {} blocks (kvport bench "
          "--model {} --layout layer_major --batches {})\n",
          kTargetBatch, kTargetModel, kTargetModel, kTargetBatch);
    } else {
      out << fmt::format(
          "Target   (b) over (c) for {} scattered {} blocks: {} (host target >= {}x{})\n",
          kTargetBatch, kTargetModel, fmt::join(target, ", "), kTargetRatio,
          backend.name() == "host" ? "" : "; this run is not on host");
    }
    out << fmt::format("Time     {} cases in {:.1f} s\n", results.size(), elapsed);
  }

  static void print_json(std::ostream& out, const std::string& backend, const BenchPlan& plan,
                         const std::vector<ZeroingResult>& results) {
    nlohmann::ordered_json cases = nlohmann::ordered_json::array();
    for (const ZeroingResult& r : results) {
      cases.push_back({{"backend", backend},
                       {"model", r.model},
                       {"layout", std::string(to_string(r.layout))},
                       {"batch", r.batch},
                       {"ids", to_string(r.ids)},
                       {"bytes", r.bytes},
                       {"num_blocks", r.num_blocks},
                       {"repetitions", plan.repetitions},
                       {"reference", strategy_json(r.reference)},
                       {"batched", strategy_json(r.batched)},
                       {"limit", strategy_json(r.limit)},
                       {"batched_over_limit", r.batched_over_limit()},
                       {"batched_over_reference", r.batched_over_reference()},
                       {"block_ids", r.block_ids}});
    }
    out << cases.dump(2) << '\n';
  }

  std::string backend_;
  CLI::Option* backend_option_ = nullptr;
  bool quick_ = false;
  bool json_ = false;
  std::string model_, layout_, batches_, repetitions_;
  CLI::Option* model_option_ = nullptr;
  CLI::Option* layout_option_ = nullptr;
  CLI::Option* batches_option_ = nullptr;
  CLI::Option* repetitions_option_ = nullptr;
};

}  // namespace

std::unique_ptr<Command> make_bench_command() {
  return std::make_unique<BenchCommand>();
}

}  // namespace kvport::cli
