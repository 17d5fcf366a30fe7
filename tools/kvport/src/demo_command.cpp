// SPDX-License-Identifier: Apache-2.0
// `kvport demo`: builds a PagedKvCache on a backend, runs the simulated
// serving workload of kvport/sim/serving_sim.hpp on it and checks the cache's invariants.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cache_options.hpp"
#include "command.hpp"
#include "kvport/cli/capacity_plan.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/serving_sim.hpp"
#include "shape_json.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using sim::ServingSimOptions;
using sim::ServingSimResult;

// A demo of 100 requests takes about a second on the host backend, mostly
// zeroing blocks; past this many it would run for hours.
constexpr std::size_t kMaxRequests = 100'000;

// Everything the report needs, gathered once for the text and JSON forms.
struct DemoReport {
  CacheShapeOptions::Resolved shape;
  std::string backend;
  std::size_t memory_bytes = 0;
  std::size_t num_blocks = 0;
  std::size_t bytes_per_block = 0;
  ServingSimOptions options;
  ServingSimResult result;
  KvCacheCounters counters;
  std::uint64_t fill_calls = 0;
  InvariantReport invariants;

  bool ok() const { return invariants.ok && result.discrepancies.empty(); }
};

class DemoCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Examples:\n"
        "  kvport demo\n"
        "  kvport demo --model qwen2.5-7b --memory 1GiB --requests 500 --seed 7 --json\n"
        "Exit status: 0 when the invariant check passes, 1 when it fails, 2 on bad input.");
    shape_.add_to(app, "llama-3-8b");
    budget_.add_to(app, "512MiB");
    requests_.value = "100";
    add(app, "--requests", requests_, "N", "Requests to serve (default 100, at most 100000)");
    max_running_.value = "32";
    add(app, "--max-running", max_running_, "N", "Most requests running at once (default 32)");
    shared_prompts_.value = "4";
    add(app, "--shared-prompts", shared_prompts_, "N",
        "System prompts whose blocks requests share through inc_ref (default 4)");
    seed_.value = "1";
    add(app, "--seed", seed_, "N",
        "Seed of the workload (default 1); the same seed replays the same run");
    app.add_flag("--json", json_, "Print one JSON object instead of the report");
  }

  int execute(std::ostream& out, std::ostream& /*err*/) override {
    DemoReport report;
    report.shape = shape_.resolve();
    report.options.requests = parse_positive_count(requests_.value, "--requests");
    if (report.options.requests > kMaxRequests) {
      throw InvalidArgument(fmt::format("--requests: at most {}, got '{}'", kMaxRequests,
                                        text::trim(requests_.value)));
    }
    report.options.max_running = parse_positive_count(max_running_.value, "--max-running");
    report.options.shared_prompts = parse_count(shared_prompts_.value, "--shared-prompts");
    report.options.seed = parse_count(seed_.value, "--seed");
    (void)budget_.memory_spec();  // a malformed --memory is reported before a backend starts

    const std::unique_ptr<Backend> backend = budget_.make_backend();
    report.backend = backend->name();
    const MemoryBudget budget = budget_.resolve(backend.get());
    const CapacityPlan plan = make_capacity_plan(report.shape.config, budget.bytes);
    report.memory_bytes = budget.bytes;
    report.num_blocks = plan.num_blocks;
    report.bytes_per_block = plan.bytes_per_block;

    {
      PagedKvCache cache(report.shape.config, plan.num_blocks, *backend);
      const Stream stream = backend->create_stream();
      backend->reset_call_counts();
      report.result = sim::run_serving_simulation(cache, stream, report.options);
      report.fill_calls = backend->call_counts().fill;
      report.counters = cache.counters();
      report.invariants = cache.check_invariants();
    }
    // ONE backend fill per zero_blocks batch is the point of batching.
    if (report.fill_calls != report.result.zero_batches) {
      report.result.discrepancies.push_back(
          fmt::format("{} backend fill calls for {} zero_blocks batches", report.fill_calls,
                      report.result.zero_batches));
    }

    if (json_) {
      print_json(out, report);
    } else {
      print_text(out, report);
    }
    return report.ok() ? kExitOk : kExitCheckFailed;
  }

 private:
  static void add(CLI::App& app, const char* name, TextFlag& flag, const char* type,
                  const char* help) {
    add_text_flag(app, name, flag, type, help)->group("Workload");
  }

  static void print_text(std::ostream& out, const DemoReport& r) {
    const ModelSpec& model = r.shape.model;
    const KvCacheConfig& config = r.shape.config;
    const ServingSimResult& s = r.result;
    out << fmt::format("kvport demo: {} ({}) on the {} backend\n\n", model.name, model.source,
                       r.backend);
    out << fmt::format(
        "Cache           {} blocks x {} tokens = {} tokens; {} per block, {} in all ({}, {})\n",
        r.num_blocks, config.block_size, r.num_blocks * config.block_size,
        format_bytes(r.bytes_per_block), format_bytes(r.num_blocks * r.bytes_per_block),
        to_string(config.dtype), to_string(config.layout));
    out << fmt::format(
        "Workload        {} requests, up to {} running, {} shared system prompts ({} blocks), "
        "seed {}\n",
        s.requests, r.options.max_running, s.shared_prompts, s.shared_prompt_blocks,
        r.options.seed);
    out << fmt::format(
        "Served          {} of {} requests in {} steps, {} preemptions; {} prompt tokens "
        "(with recomputation), {} generated\n",
        s.completed, s.requests, s.steps, s.preemptions, s.prompt_tokens, s.generated_tokens);
    out << fmt::format(
        "Block ops       {} in {:.3f} s of scheduling = {:.0f} ops/s (alloc {}, inc_ref {}, "
        "dec_ref {}); {} allocations found the cache exhausted\n",
        s.block_ops(), s.loop_s, s.ops_per_s(), s.allocs, s.inc_refs, s.dec_refs, s.alloc_failures);
    out << fmt::format(
        "Zeroing         {} zero_blocks batches ({} backend fill calls), {} blocks = {}; the "
        "backend finished {:.3f} s after the start\n",
        s.zero_batches, r.fill_calls, s.zeroed_blocks,
        format_bytes(static_cast<std::size_t>(s.zeroed_blocks) * r.bytes_per_block), s.elapsed_s);
    out << fmt::format(
        "Peak usage      {} of {} blocks ({:.1f}%)\n", s.peak_blocks_in_use, r.num_blocks,
        100.0 * static_cast<double>(s.peak_blocks_in_use) / static_cast<double>(r.num_blocks));
    out << fmt::format(
        "Counters        allocs {}, frees {}, exhaustion_events {}, ignored_double_frees {}, "
        "peak_blocks_in_use {}\n",
        r.counters.allocs, r.counters.frees, r.counters.exhaustion_events,
        r.counters.ignored_double_frees, r.counters.peak_blocks_in_use);
    out << "Invariants      " << r.invariants.to_string() << '\n';
    for (const std::string& d : s.discrepancies)
      out << "Discrepancy     " << d << '\n';
    out << "Result          " << (r.ok() ? "OK" : "FAILED") << '\n';
  }

  static void print_json(std::ostream& out, const DemoReport& r) {
    const ServingSimResult& s = r.result;
    nlohmann::ordered_json j;
    add_shape_fields(j, r.shape);
    j["backend"] = r.backend;
    j["memory_bytes"] = r.memory_bytes;
    j["bytes_per_block"] = r.bytes_per_block;
    j["num_blocks"] = r.num_blocks;
    j["seed"] = r.options.seed;
    j["requests"] = s.requests;
    j["max_running"] = r.options.max_running;
    j["completed"] = s.completed;
    j["preemptions"] = s.preemptions;
    j["steps"] = s.steps;
    j["shared_prompts"] = s.shared_prompts;
    j["shared_prompt_blocks"] = s.shared_prompt_blocks;
    j["prompt_tokens"] = s.prompt_tokens;
    j["generated_tokens"] = s.generated_tokens;
    j["block_ops"] = s.block_ops();
    j["allocs"] = s.allocs;
    j["alloc_failures"] = s.alloc_failures;
    j["inc_refs"] = s.inc_refs;
    j["dec_refs"] = s.dec_refs;
    j["zero_batches"] = s.zero_batches;
    j["zeroed_blocks"] = s.zeroed_blocks;
    j["zeroed_bytes"] = s.zeroed_blocks * r.bytes_per_block;
    j["backend_fill_calls"] = r.fill_calls;
    j["loop_s"] = s.loop_s;
    j["elapsed_s"] = s.elapsed_s;
    j["ops_per_s"] = s.ops_per_s();
    j["peak_blocks_in_use"] = s.peak_blocks_in_use;
    j["counters"] = {{"allocs", r.counters.allocs},
                     {"frees", r.counters.frees},
                     {"ignored_double_frees", r.counters.ignored_double_frees},
                     {"exhaustion_events", r.counters.exhaustion_events},
                     {"peak_blocks_in_use", r.counters.peak_blocks_in_use}};
    j["invariants_ok"] = r.invariants.ok;
    j["invariants"] = r.invariants.to_string();
    j["discrepancies"] = s.discrepancies;
    j["ok"] = r.ok();
    out << j.dump(2) << '\n';
  }

  CacheShapeOptions shape_;
  BudgetOptions budget_;
  TextFlag requests_, max_running_, shared_prompts_, seed_;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_demo_command() {
  return std::make_unique<DemoCommand>();
}

}  // namespace kvport::cli
