// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s checks and report (disagg_report.hpp).
#include "disagg_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ostream>

#include "text_table.hpp"

namespace kvport::cli::disagg {
namespace {

using nlohmann::json;

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const auto hi = static_cast<std::size_t>(std::ceil(pos));
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

std::uint64_t leaked_blocks(const Stats& s) {
  std::uint64_t leaked = 0;
  for (const WorkerRecord& w : s.workers) {
    if (w.stats) leaked += w.stats->value("leaked_blocks", std::uint64_t{0});
  }
  return leaked;
}

}  // namespace

std::string_view to_string(WorkerEnd end) noexcept {
  switch (end) {
    case WorkerEnd::running:
      return "running";
    case WorkerEnd::finished:
      return "finished";
    case WorkerEnd::killed:
      return "killed";
    case WorkerEnd::lost:
      return "lost";
    case WorkerEnd::exited:
      return "exited";
    case WorkerEnd::stopped:
      return "stopped";
  }
  return "unknown";
}

bool checks_pass(const RunOptions& options, const Stats& s) {
  if (!s.failure.empty() || s.verification_failures > 0 || s.unexpected_exits > 0 ||
      s.workers_lost > 0) {
    return false;
  }
  if (s.completed != s.requests) return false;
  for (const WorkerRecord& w : s.workers) {
    if (w.end == WorkerEnd::killed || (s.kill && s.kill->victim == w.name())) continue;
    if (!w.stats || w.stats->value("leaked_blocks", 1) != 0 ||
        !w.stats->value("invariants_ok", false)) {
      return false;
    }
  }
  const double bound_ms = static_cast<double>(options.peer_timeout.count()) + 500;
  return !s.kill || (s.kill->loss_reports > 0 && s.kill->loss_detected_ms_max <= bound_ms);
}

json report_json(const RunOptions& o, const Stats& s) {
  const double idle_s = s.baseline_seconds.empty() ? 0 : percentile(s.baseline_seconds, 0.5);
  const double idle_gbps = idle_s > 0 ? static_cast<double>(s.baseline_bytes) / idle_s / 1e9 : 0;
  const double raw_gbps = gbps(s.raw_bytes, s.raw_seconds);
  const double paired_gbps = gbps(s.paired_bytes, s.paired_seconds);
  const double bulk_gbps = gbps(s.bulk_bytes, s.bulk_seconds);
  json workers = json::array();
  for (const WorkerRecord& w : s.workers) {
    json entry{{"role", std::string(to_string(w.role))},
               {"instance", w.instance},
               {"rank", w.rank},
               {"end", std::string(to_string(w.end))},
               {"killed", w.end == WorkerEnd::killed}};
    if (w.end == WorkerEnd::lost) entry["lost_reported_by"] = w.lost_reported_by;
    if (w.exit_code) {
      entry["exit"] = {{"code", *w.exit_code},
                       {"signal", w.exit_signal},
                       {"force_killed_at_shutdown", w.force_killed}};
    }
    if (w.stats) {
      entry["leaked_blocks"] = w.stats->value("leaked_blocks", -1);
      entry["invariants_ok"] = w.stats->value("invariants_ok", false);
      entry["stats"] = *w.stats;
    } else {
      entry["leaked_blocks"] = nullptr;
    }
    workers.push_back(entry);
  }
  json j{
      {"model", o.model},
      {"trace", o.trace},
      {"prefill_instances", o.prefill},
      {"decode_instances", o.decode},
      {"tp_prefill", o.tp_prefill},
      {"tp_decode", o.tp_decode},
      {"capacity_blocks", o.capacity_blocks},
      {"block_bytes", o.block_bytes},
      {"transport", s.transport},
      {"memory_path", s.memory_path},
      {"data_lanes", s.lanes},
      {"requests", s.requests},
      {"requests_completed", s.completed},
      {"requests_failed", s.failed_requests},
      {"requests_skipped_too_large", s.skipped},
      {"requests_recomputed", s.recomputed},
      {"rank_recomputes", s.rank_recomputes},
      {"transfers", s.transfers},
      {"blocks_transferred", s.blocks},
      {"bytes_transferred", s.bytes},
      {"transfer_gbps", gbps(s.bytes, s.transfer_seconds)},
      {"bulk_transfer_gbps", bulk_gbps},
      {"transfer_latency_ms",
       {{"p50", percentile(s.latencies, 0.5) * 1e3}, {"p99", percentile(s.latencies, 0.99) * 1e3}}},
      {"request_latency_ms",
       {{"p50", percentile(s.e2e_latencies, 0.5) * 1e3},
        {"p99", percentile(s.e2e_latencies, 0.99) * 1e3}}},
      {"raw_ucx",
       {{"gbps", raw_gbps},
        {"samples", s.raw_samples},
        {"bytes", s.raw_bytes},
        {"paired_transfer_gbps", paired_gbps},
        {"idle_gbps", idle_gbps},
        {"idle_bytes", s.baseline_bytes},
        {"why", s.baseline_why}}},
      {"ratio_vs_raw", raw_gbps > 0 ? paired_gbps / raw_gbps : 0},
      {"ratio_vs_idle_raw", idle_gbps > 0 ? bulk_gbps / idle_gbps : 0},
      {"verification_failures", s.verification_failures},
      {"leases", s.lease_ends},
      {"processes_started", s.processes_started},
      {"unexpected_exits", s.unexpected_exits},
      {"workers_lost", s.workers_lost},
      {"workers", workers},
      {"leaked_blocks", leaked_blocks(s)},
      {"wall_seconds", s.wall_seconds},
      {"ok", checks_pass(o, s)}};
  if (o.kill && !s.kill) {
    j["kill"] = {{"role", std::string(to_string(*o.kill))},
                 {"performed", false},
                 {"why", fmt::format("the run had {} transfers, --after asked for {}", s.transfers,
                                     o.kill_after)}};
  }
  if (s.kill) {
    j["kill"] = {{"role", std::string(to_string(*o.kill))},
                 {"performed", true},
                 {"victim", s.kill->victim},
                 {"signal", s.kill->stopped ? "SIGSTOP" : "SIGKILL"},
                 {"after_transfers", s.kill->after_transfers},
                 {"loss_reports", s.kill->loss_reports},
                 {"loss_detected_ms_max", s.kill->loss_detected_ms_max},
                 {"bound_ms", o.peer_timeout.count()}};
  }
  if (!o.layers.empty()) {
    json groups = json::array();
    for (const GroupTotals& g : s.groups) {
      groups.push_back({{"kind", g.kind},
                        {"bytes", g.bytes},
                        {"wrong_bytes", g.wrong_bytes},
                        {"checked_bytes", g.checked_bytes},
                        {"blocks", g.blocks}});
    }
    j["groups"] = groups;
  }
  if (!s.failure.empty()) j["failure"] = s.failure;
  if (!s.notes.empty()) j["notes"] = s.notes;
  return j;
}

void print_report(std::ostream& out, const RunOptions& o, const Stats& s) {
  const json j = report_json(o, s);
  out << fmt::format(
      "kvport disagg: {} prefill x TP{} -> {} decode x TP{}, {} ({} bytes/block), {}\n", o.prefill,
      o.tp_prefill, o.decode, o.tp_decode, o.model, o.block_bytes, s.transport);
  TextTable t({"", "value"});
  t.add_row({"requests (completed / replayed)", fmt::format("{} / {}", s.completed, s.requests)});
  t.add_row({"skipped (larger than capacity)", std::to_string(s.skipped)});
  t.add_row({"recomputed (no transfer)", std::to_string(s.recomputed)});
  t.add_row({"transfers / blocks", fmt::format("{} / {}", s.transfers, s.blocks)});
  t.add_row(
      {"bytes transferred", fmt::format("{:.1f} MiB", static_cast<double>(s.bytes) / (1 << 20))});
  t.add_row({"transfer GB/s (all / >= 16 blocks)",
             fmt::format("{:.2f} / {:.2f}", j["transfer_gbps"].get<double>(),
                         j["bulk_transfer_gbps"].get<double>())});
  t.add_row({"raw UCX GB/s, one contiguous read (n)",
             fmt::format("{:.2f} ({})", j["raw_ucx"]["gbps"].get<double>(), s.raw_samples)});
  t.add_row({"ratio (same pulls / raw, same moments)",
             fmt::format("{:.2f}", j["ratio_vs_raw"].get<double>())});
  t.add_row({"raw UCX GB/s before the replay (idle)",
             fmt::format("{:.2f} ({:.1f} MiB)", j["raw_ucx"]["idle_gbps"].get<double>(),
                         static_cast<double>(s.baseline_bytes) / (1 << 20))});
  t.add_row({"transfer latency p50 / p99",
             fmt::format("{:.2f} / {:.2f} ms", j["transfer_latency_ms"]["p50"].get<double>(),
                         j["transfer_latency_ms"]["p99"].get<double>())});
  t.add_row({"verification failures", std::to_string(s.verification_failures)});
  for (std::size_t g = 0; g < s.groups.size(); ++g) {
    t.add_row(
        {fmt::format("group {} ({}): bytes / wrong / blocks", g, s.groups[g].kind),
         fmt::format("{:.1f} MiB / {} / {}", static_cast<double>(s.groups[g].bytes) / (1 << 20),
                     s.groups[g].wrong_bytes, s.groups[g].blocks)});
  }
  t.add_row({"leaked blocks (all workers)", std::to_string(leaked_blocks(s))});
  if (o.kill && !s.kill) {
    t.add_row(
        {"killed", fmt::format("nobody: {} transfers, --after {}", s.transfers, o.kill_after)});
  }
  if (s.kill) {
    t.add_row({s.kill->stopped ? "stopped (SIGSTOP)" : "killed",
               fmt::format("{} after {} transfers", s.kill->victim, s.kill->after_transfers)});
    t.add_row({"loss detected (max over survivors)",
               fmt::format("{:.0f} ms (bound {} ms)", s.kill->loss_detected_ms_max,
                           o.peer_timeout.count())});
  }
  for (const WorkerRecord& w : s.workers) {
    if (w.end == WorkerEnd::lost) {
      t.add_row({"lost (reported by a peer, killed)",
                 fmt::format("{} (by {})", w.name(), w.lost_reported_by)});
    }
  }
  t.add_row({"wall time", fmt::format("{:.1f} s", s.wall_seconds)});
  t.print(out);
  for (const std::string& note : s.notes)
    out << "note: " << note << '\n';
  if (!s.failure.empty()) out << "FAILED: " << s.failure << '\n';
  out << (j["ok"].get<bool>() ? "Result OK\n" : "Result FAILED\n");
}

}  // namespace kvport::cli::disagg
