// SPDX-License-Identifier: Apache-2.0
#include "group_replay.hpp"

#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "text_table.hpp"

namespace kvport::cli {
namespace {

std::string percent(double ratio) {
  return fmt::format("{:.1f}%", 100.0 * ratio);
}

nlohmann::ordered_json result_json(const sim::ReplayResult& r) {
  nlohmann::ordered_json j;
  j["requests"] = r.requests;
  j["completed"] = r.completed;
  j["rejected"] = r.rejected;
  j["preemptions"] = r.preemptions;
  j["steps"] = r.steps;
  j["peak_running"] = r.peak_running;
  j["mean_running"] = r.mean_running;
  j["prompt_tokens"] = r.prompt_tokens;
  j["hit_tokens"] = r.hit_tokens;
  j["hit_rate"] = r.token_hit_rate();
  j["prefill_tokens"] = r.prefill_tokens;
  j["recomputed_tokens"] = r.recomputed_tokens;
  j["generated_tokens"] = r.generated_tokens;
  j["state_checkpoints"] = r.state_checkpoints;
  if (r.host_tier_blocks != 0) {
    j["host_bytes"] = r.host_bytes;
    j["host_hit_tokens"] = r.host_hit_tokens;
    j["short_hits"] = r.short_hits;
    j["short_hit_tokens"] = r.short_hit_tokens;
  }
  j["budget_bytes"] = r.budget_bytes;
  j["pool_bytes"] = r.pool_bytes;
  j["peak_bytes_in_use"] = r.peak_bytes_in_use();
  nlohmann::ordered_json groups = nlohmann::ordered_json::array();
  for (const sim::GroupUsage& g : r.groups) {
    nlohmann::ordered_json u;
    u["kind"] = std::string(to_string(g.spec.kind));
    u["spec"] = g.spec.describe();
    u["num_layers"] = g.num_layers;
    u["num_blocks"] = g.num_blocks;
    u["bytes_per_block"] = g.bytes_per_block;
    u["peak_blocks_in_use"] = g.peak_blocks_in_use;
    u["peak_bytes_in_use"] = g.peak_bytes_in_use();
    u["mean_blocks_in_use"] =
        r.steps == 0 ? 0.0 : static_cast<double>(g.block_steps) / static_cast<double>(r.steps);
    u["hit_blocks"] = g.hit_blocks;
    if (r.host_tier_blocks != 0) {
      u["host_slots"] = g.host_slots;
      u["host_hit_blocks"] = g.host_hit_blocks;
      u["tier_counters"] = tier_counters_json(g.tier_counters);
    }
    groups.push_back(std::move(u));
  }
  j["group_usage"] = std::move(groups);
  j["invariants_ok"] = r.invariants.ok;
  j["invariants"] = r.invariants.to_string();
  j["wall_s"] = r.wall_s;
  return j;
}

void group_table(std::ostream& out, const sim::ReplayResult& r) {
  const bool tier = r.host_tier_blocks != 0;
  std::vector<std::string> header = {"group",       "kind",        "layers",     "blocks",
                                     "bytes/block", "peak blocks", "peak bytes", "hit blocks"};
  if (tier) {
    for (const char* h : {"host slots", "from host", "written back", "host evictions"})
      header.emplace_back(h);
  }
  TextTable table(header, {TextTable::Align::left, TextTable::Align::left});
  for (std::size_t g = 0; g < r.groups.size(); ++g) {
    const sim::GroupUsage& u = r.groups[g];
    std::vector<std::string> row = {std::to_string(g),
                                    u.spec.describe(),
                                    std::to_string(u.num_layers),
                                    std::to_string(u.num_blocks),
                                    std::to_string(u.bytes_per_block),
                                    std::to_string(u.peak_blocks_in_use),
                                    format_bytes(u.peak_bytes_in_use()),
                                    std::to_string(u.hit_blocks)};
    if (tier) {
      row.push_back(std::to_string(u.host_slots));
      row.push_back(std::to_string(u.host_hit_blocks));
      row.push_back(std::to_string(u.tier_counters.offloads));
      row.push_back(std::to_string(u.tier_counters.host_evictions));
    }
    table.add_row(row);
  }
  table.print(out, "  ");
}

}  // namespace

nlohmann::ordered_json tier_counters_json(const HostTierCounters& c) {
  return {{"offloads", c.offloads},
          {"offload_bytes", c.offload_bytes},
          {"onloads", c.onloads},
          {"onload_bytes", c.onload_bytes},
          {"host_hits", c.host_hits},
          {"host_evictions", c.host_evictions},
          {"aborted_transfers", c.aborted_transfers},
          {"aborted_blocks", c.aborted_blocks},
          {"stalled_transfers", c.stalled_transfers},
          {"stalled_blocks", c.stalled_blocks},
          {"already_on_host", c.already_on_host},
          {"dropped_offloads", c.dropped_offloads},
          {"offload_waits", c.offload_waits},
          {"onload_shortfalls", c.onload_shortfalls},
          {"lower_tier_offers", c.lower_tier_offers},
          {"lower_tier_writes", c.lower_tier_writes},
          {"lower_tier_hits", c.lower_tier_hits},
          {"lower_tier_shortfalls", c.lower_tier_shortfalls},
          {"lookup_spills", c.lookup_spills},
          {"poll_spills", c.poll_spills}};
}

void run_group_replay(GroupReplayRun& run) {
  run.requests = sim::read_mooncake_trace(run.trace);
  const std::vector<sim::TraceRequest>& requests = run.requests;
  const std::unique_ptr<Backend> backend = make_host_backend();
  run.groups = sim::replay_model(requests, run.options, *backend);
  sim::ModelReplayOptions all_full = run.options;
  all_full.layers = sim::as_all_full_attention(run.options.layers);
  all_full.event_sink = nullptr;  // the comparison is not the model's cache
  run.all_full = sim::replay_model(requests, all_full, *backend);
}

void print_group_replay_text(std::ostream& out, const GroupReplayRun& run) {
  const sim::ModelReplayOptions& o = run.options;
  const sim::ReplayResult& g = run.groups;
  const sim::ReplayResult& f = run.all_full;
  out << fmt::format(
      "kvport replay: {} requests from {}\n"
      "model {} ({}), {} layers; {} of KV memory, {} tokens per block, prefill chunks of {}, "
      "up to {} running, {} ms per step\n\n",
      g.requests, run.trace, run.model, run.model_source, o.layers.size(),
      format_bytes(o.budget_bytes), o.block_size, o.prefill_chunk_tokens, o.concurrency, o.step_ms);
  if (o.host_tier_blocks != 0) {
    out << fmt::format(
        "host tier: {} blocks of the model ({} of host memory), split so that every group holds "
        "the same tokens; {}, {}\n\n",
        o.host_tier_blocks, format_bytes(g.host_bytes), to_string(o.tier_policy),
        to_string(o.tier_inclusion));
  }
  out << fmt::format("planned for {} tokens of context; ", g.planned_context_tokens);
  out << (g.shared_pool_blocks != 0
              ? fmt::format("the attention groups share one pool of {} blocks\n",
                            g.shared_pool_blocks)
              : std::string("a pool per group\n"));
  out << "KV cache groups:\n";
  group_table(out, g);
  out << "Same model, every layer full attention:\n";
  group_table(out, f);
  out << '\n';
  TextTable table({"", "groups", "all full attention"},
                  {TextTable::Align::left, TextTable::Align::right, TextTable::Align::right});
  auto row = [&](const char* what, const std::string& a, const std::string& b) {
    table.add_row({what, a, b});
  };
  row("completed", std::to_string(g.completed), std::to_string(f.completed));
  row("rejected", std::to_string(g.rejected), std::to_string(f.rejected));
  row("peak running", std::to_string(g.peak_running), std::to_string(f.peak_running));
  row("mean running", fmt::format("{:.1f}", g.mean_running), fmt::format("{:.1f}", f.mean_running));
  row("token hit rate", percent(g.token_hit_rate()), percent(f.token_hit_rate()));
  const sim::CommonHitRates common = sim::common_hit_rates(run.requests, g, f);
  if (common.requests != g.completed || common.requests != f.completed) {
    row(fmt::format("  on the {} requests both admitted", common.requests).c_str(),
        percent(common.a), percent(common.b));
  }
  if (o.host_tier_blocks != 0) {
    auto of_prompts = [](const sim::ReplayResult& r) {
      return percent(r.prompt_tokens == 0 ? 0.0
                                          : static_cast<double>(r.host_hit_tokens) /
                                                static_cast<double>(r.prompt_tokens));
    };
    row("hits using the host", of_prompts(g), of_prompts(f));
    row("hits decided again", std::to_string(g.short_hits), std::to_string(f.short_hits));
  }
  row("preemptions", std::to_string(g.preemptions), std::to_string(f.preemptions));
  row("recomputed tokens", std::to_string(g.recomputed_tokens),
      std::to_string(f.recomputed_tokens));
  row("peak bytes in use", format_bytes(g.peak_bytes_in_use()),
      format_bytes(f.peak_bytes_in_use()));
  row("state checkpoints", std::to_string(g.state_checkpoints),
      std::to_string(f.state_checkpoints));
  row("steps", std::to_string(g.steps), std::to_string(f.steps));
  table.print(out);
  if (f.peak_running != 0) {
    out << fmt::format("\nConcurrency   {:.2f}x all-full's peak\n",
                       static_cast<double>(g.peak_running) / static_cast<double>(f.peak_running));
  }
  if (run.events) {
    const events::PublisherStats& e = run.events->stats;
    out << fmt::format(
        "Events        {} published on {} in {} batches, {} dropped (buffer full), {} sends "
        "refused\n              {} not delivered at most, {} sequence gaps for drops\n",
        e.events_accepted, run.events->endpoint, e.batches_sent, e.events_dropped, e.send_failures,
        run.events->close.not_delivered(), e.loss_gaps);
  }
  out << "Invariants    groups " << g.invariants.to_string() << "; all-full "
      << f.invariants.to_string() << '\n';
  out << "Result        " << (g.invariants.ok && f.invariants.ok ? "OK" : "FAILED") << '\n';
}

void print_group_replay_json(std::ostream& out, const GroupReplayRun& run) {
  const sim::ModelReplayOptions& o = run.options;
  nlohmann::ordered_json j;
  j["mode"] = "groups";
  j["trace"] = run.trace;
  j["model"] = run.model;
  j["model_source"] = run.model_source;
  j["num_layers"] = o.layers.size();
  j["budget_bytes"] = o.budget_bytes;
  j["block_size"] = o.block_size;
  j["max_context_tokens"] = o.max_context_tokens;
  j["planned_context_tokens"] = run.groups.planned_context_tokens;
  j["shared_pool"] = o.shared_pool;
  j["shared_pool_blocks"] = run.groups.shared_pool_blocks;
  j["prefill_chunk_tokens"] = o.prefill_chunk_tokens;
  j["trace_block_tokens"] = o.trace_block_tokens;
  j["concurrency"] = o.concurrency;
  j["step_ms"] = o.step_ms;
  j["state_checkpoint_interval"] = o.state_checkpoint_interval;
  j["prefix_hit_mode"] = to_string(o.prefix_hit_mode);
  if (o.host_tier_blocks != 0) {
    j["host_tier_blocks"] = o.host_tier_blocks;
    j["tier_policy"] = to_string(o.tier_policy);
    j["tier_inclusion"] = to_string(o.tier_inclusion);
  }
  j["groups"] = result_json(run.groups);
  j["all_full"] = result_json(run.all_full);
  const sim::CommonHitRates common = sim::common_hit_rates(run.requests, run.groups, run.all_full);
  j["common"] = {{"requests", common.requests},
                 {"prompt_tokens", common.prompt_tokens},
                 {"groups_hit_rate", common.a},
                 {"all_full_hit_rate", common.b}};
  j["concurrency_ratio"] = run.all_full.peak_running == 0
                               ? 0.0
                               : static_cast<double>(run.groups.peak_running) /
                                     static_cast<double>(run.all_full.peak_running);
  if (run.events) {
    const events::PublisherStats& e = run.events->stats;
    j["events"] = {{"endpoint", run.events->endpoint},
                   {"accepted", e.events_accepted},
                   {"dropped", e.events_dropped},
                   {"batches_sent", e.batches_sent},
                   {"send_failures", e.send_failures},
                   {"loss_gaps", e.loss_gaps},
                   {"exit_drained", run.events->close.drained},
                   {"not_delivered", run.events->close.not_delivered()}};
  }
  j["ok"] = run.groups.invariants.ok && run.all_full.invariants.ok;
  out << j.dump(2) << '\n';
}

}  // namespace kvport::cli
