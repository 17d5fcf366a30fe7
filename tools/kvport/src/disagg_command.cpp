// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`: replays a Mooncake trace through prefill and decode worker
// processes on this machine that move KV blocks over UCX (kvport::transfer),
// and reports what moved, how fast (against one contiguous UCX transfer of
// the same bytes, measured in the same run), what was verified, what leaked,
// and how the survivors handled a process killed on purpose (--kill).
//
// This file is the command: its flags and their validation, and the trace.
// The coordinator (disagg_coordinator.hpp) runs the workers; the report
// (disagg_report.hpp) turns its Stats into JSON or text.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "cache_options.hpp"
#include "command.hpp"
#include "disagg.hpp"
#include "disagg_coordinator.hpp"
#include "disagg_report.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_memory.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/trace_tokens.hpp"
#include "kvport/transfer/hybrid_disagg.hpp"
#include "process_group.hpp"

namespace kvport::cli {
namespace {

using disagg::Role;
using nlohmann::json;

// Mooncake traces hash prompts in blocks of 512 tokens.
constexpr std::size_t kTraceBlockTokens = 512;

// Hybrid models: the slots of each state group per worker (a slot holds one
// request's whole state, often hundreds of times a block).
constexpr std::size_t kStateSlots = 8;

// The bounds of the time flags: far beyond any use, small enough that no
// deadline or sum of them overflows.
constexpr std::uint64_t kMaxTimeoutS = 7 * 24 * 3600;          // a week
constexpr std::uint64_t kMaxPeerTimeoutMs = 3600 * 1000;       // an hour
constexpr std::uint64_t kMaxLeaseTtlMs = 24 * 3600 * 1000ULL;  // a day

// True when `address` (IPv4, network order) is one of this machine's
// interface addresses, or when the interfaces cannot be listed (not
// checked then; the workers' listen reports it).
bool is_local_ipv4(const in_addr& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return true;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    found = in->sin_addr.s_addr == address.s_addr;
  }
  ::freeifaddrs(list);
  return found;
}

class DisaggCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    shape_.add_to(app, "llama-3-8b");
    add_text_flag(app, "--trace", trace_, "FILE", "Mooncake trace (JSON lines) to replay");
    add_text_flag(app, "--prefill", prefill_, "N", "Prefill instances, 1..16 (default 1)");
    add_text_flag(app, "--decode", decode_, "M", "Decode instances, 1..16 (default 1)");
    add_text_flag(app, "--tp-prefill", tp_prefill_, "P",
                  "Tensor-parallel ranks per prefill instance, 1..8 (default 1)");
    add_text_flag(app, "--tp-decode", tp_decode_, "D",
                  "Tensor-parallel ranks per decode instance, 1..8 (default 1)");
    add_text_flag(app, "--capacity-blocks", capacity_, "B", "KV blocks of each worker's cache");
    add_text_flag(app, "--requests", requests_, "N",
                  "Replay at most this many requests of the trace");
    add_text_flag(app, "--kill", kill_, "ROLE",
                  "Kill one process of this role with SIGKILL: prefill or decode");
    add_text_flag(app, "--kill-signal", kill_signal_, "SIG",
                  "kill (SIGKILL, a crash; default) or stop (SIGSTOP, a hang: its peers report "
                  "it lost, then the coordinator kills it)");
    add_text_flag(app, "--after", after_, "N",
                  "... after this many completed transfers (with --kill; default 1)");
    add_text_flag(app, "--peer-timeout-ms", peer_timeout_ms_, "MS",
                  "A peer silent this long is lost (default 1500; the loss bound)");
    add_text_flag(app, "--lease-ttl-ms", lease_ttl_ms_, "MS",
                  "Prefill leases expire after this (default 10000)");
    add_text_flag(app, "--timeout-s", timeout_s_, "S",
                  "Give up (and stop every process) after this (default 3600)");
    add_text_flag(app, "--bind", bind_, "HOST",
                  "Local IPv4 address the workers listen on (default 127.0.0.1)");
    app.add_flag("--json", json_, "Print the report as JSON");
    add_text_flag(app, "--worker", worker_spec_, "SPEC", "Internal: run as a worker with this spec")
        ->group("");
  }

  int execute(std::ostream& out, std::ostream& err) override {
    if (worker_spec_.given()) {
      json spec;
      try {
        spec = json::parse(worker_spec_.value);
      } catch (const json::exception& e) {
        throw InvalidArgument(std::string("--worker: not JSON: ") + e.what());
      }
      return disagg::run_worker(disagg::WorkerSpec::from_json(spec), out);
    }
    const disagg::RunOptions options = validate();
    std::size_t skipped = 0;
    std::vector<disagg::Request> requests = load_trace(options, skipped);
    TerminationSignals signals;
    ProcessGroup group;
    disagg::Coordinator coordinator(options, std::move(requests), skipped);
    // How the phases ended is in the stats (failure) and decides the checks:
    // a run that stopped early fails them, with its report.
    try {
      (void)coordinator.run(group, signals, err);
    } catch (...) {
      group.shutdown(std::chrono::milliseconds(0));  // bad input found by the workers
      throw;
    }
    coordinator.record_exits(group.shutdown(coordinator.shutdown_grace()));
    if (json_) {
      out << disagg::report_json(options, coordinator.stats()).dump(2) << '\n';
    } else {
      disagg::print_report(out, options, coordinator.stats());
    }
    // Written out while the handlers are still ours: a SIGINT from here on is
    // only flagged, so the report is never cut short by one.
    out << std::flush;
    return disagg::checks_pass(options, coordinator.stats()) ? kExitOk : kExitCheckFailed;
  }

 private:
  static std::uint32_t count_in(const TextFlag& flag, const char* name, std::uint32_t fallback,
                                std::uint32_t max) {
    if (!flag.given()) return fallback;
    return static_cast<std::uint32_t>(parse_count_in(flag.value, name, 1, max));
  }

  disagg::RunOptions validate() const {
    disagg::RunOptions o;
    if (!trace_.given() || trace_.value.empty()) {
      throw InvalidArgument("--trace: a Mooncake trace file is required");
    }
    o.trace = trace_.value;
    if (!capacity_.given()) throw InvalidArgument("--capacity-blocks: required, > 0");
    o.capacity_blocks = parse_positive_count(capacity_.value, "--capacity-blocks");
    o.prefill = count_in(prefill_, "--prefill", 1, 16);
    o.decode = count_in(decode_, "--decode", 1, 16);
    o.tp_prefill = count_in(tp_prefill_, "--tp-prefill", 1, 8);
    o.tp_decode = count_in(tp_decode_, "--tp-decode", 1, 8);
    if (o.prefill * o.tp_prefill + o.decode * o.tp_decode > 32) {
      throw InvalidArgument("at most 32 worker processes (instances x tensor-parallel ranks)");
    }
    if (requests_.given()) max_requests_ = parse_positive_count(requests_.value, "--requests");
    if (kill_.given()) {
      o.kill = disagg::parse_role(kill_.value);
      if (!o.kill) {
        throw InvalidArgument(
            fmt::format("--kill: expected prefill or decode, got '{}'", kill_.value));
      }
    }
    if (kill_signal_.given()) {
      if (!o.kill) throw InvalidArgument("--kill-signal needs --kill");
      if (kill_signal_.value == "stop") {
        o.kill_stops = true;
      } else if (kill_signal_.value != "kill") {
        throw InvalidArgument(
            fmt::format("--kill-signal: expected kill or stop, got '{}'", kill_signal_.value));
      }
    }
    if (after_.given()) {
      if (!o.kill) throw InvalidArgument("--after needs --kill");
      o.kill_after = parse_count(after_.value, "--after");
    }
    if (peer_timeout_ms_.given()) {
      o.peer_timeout = std::chrono::milliseconds(
          parse_count_in(peer_timeout_ms_.value, "--peer-timeout-ms", 1, kMaxPeerTimeoutMs));
    }
    if (lease_ttl_ms_.given()) {
      o.lease_ttl = std::chrono::milliseconds(
          parse_count_in(lease_ttl_ms_.value, "--lease-ttl-ms", 1, kMaxLeaseTtlMs));
    }
    if (timeout_s_.given()) {
      o.timeout =
          std::chrono::seconds(parse_count_in(timeout_s_.value, "--timeout-s", 1, kMaxTimeoutS));
    }
    if (bind_.given()) o.bind = std::string(bind_.value);
    validate_bind(o.bind);

    const CacheShapeOptions::Layered layered = shape_.resolve_layers();
    if (layered.full_attention) {
      o.config = layered.full_attention->config;
      o.model = layered.full_attention->model.name;
      o.block_bytes = o.config.bytes_per_block();
      for (std::uint32_t tp : {o.tp_prefill, o.tp_decode}) {
        if (o.config.num_kv_heads % tp != 0) {
          throw InvalidArgument(fmt::format("{} KV heads do not split over tensor-parallel size {}",
                                            o.config.num_kv_heads, tp));
        }
      }
    } else {
      // A hybrid or MLA model: one HybridKvCache per worker, one agent per
      // KV cache group (docs/transfer.md).
      o.layers = layered.layers;
      o.model = layered.model.name;
      o.config.block_size = layered.block_size;
      o.config.layout = layered.layout;
      o.state_slots = std::min<std::size_t>(o.capacity_blocks, kStateSlots);
      for (std::uint32_t tp : {o.tp_prefill, o.tp_decode}) {
        try {
          (void)transfer::rank_layer_specs(o.layers, tp);
        } catch (const InvalidArgument& e) {
          throw InvalidArgument(fmt::format("tensor-parallel size {}: {}", tp, e.what()));
        }
      }
      for (const KvCacheGroup& g : group_layers(o.layers, o.config.block_size)) {
        if (!g.spec.has_state())
          o.block_bytes += group_pool_config(g, o.config.block_size).bytes_per_block();
      }
    }
    if (o.tp_prefill != o.tp_decode && o.config.layout != KvCacheLayout::layer_major) {
      throw InvalidArgument(
          "different --tp-prefill and --tp-decode need --layout layer-major (head slicing)");
    }
    validate_memory(o);
    return o;
  }

  // An IPv4 address of this machine. IPv6 is refused: UCX 1.13's sockaddr
  // connection manager corrupted a decode worker's heap ("double free or
  // corruption" in its accept path) on every --bind ::1 run tried.
  static void validate_bind(const std::string& bind) {
    in_addr v4{};
    in6_addr v6{};
    if (::inet_pton(AF_INET6, bind.c_str(), &v6) == 1) {
      throw InvalidArgument(fmt::format(
          "--bind {}: IPv6 is not supported (UCX 1.13's sockaddr path is not reliable with it); "
          "use an IPv4 address of this machine, e.g. 127.0.0.1",
          bind));
    }
    if (::inet_pton(AF_INET, bind.c_str(), &v4) != 1) {
      throw InvalidArgument(fmt::format("--bind: '{}' is not an IPv4 address", bind));
    }
    if (!is_local_ipv4(v4)) {
      throw InvalidArgument(fmt::format(
          "--bind {}: not an address of this machine's interfaces (the workers listen on it)",
          bind));
    }
  }

  // Every worker allocates and touches its whole cache at start: the total
  // must fit this machine, or the kernel kills one of them half-way.
  // The bytes of one worker's cache of `tp` ranks: every group's pool
  // (hybrid models: capacity_blocks blocks per block group, state_slots
  // slots per state group).
  static double process_bytes(const disagg::RunOptions& o, std::uint32_t tp) {
    if (o.layers.empty()) {
      return static_cast<double>(o.config.bytes_per_block() / tp) *
             static_cast<double>(o.capacity_blocks);
    }
    double total = 0;
    const auto rank_layers = transfer::rank_layer_specs(o.layers, tp);
    for (const KvCacheGroup& g : group_layers(rank_layers, o.config.block_size)) {
      const double count =
          static_cast<double>(g.spec.has_state() ? o.state_slots : o.capacity_blocks);
      total +=
          static_cast<double>(group_pool_config(g, o.config.block_size).bytes_per_block()) * count;
    }
    return total;
  }

  static void validate_memory(const disagg::RunOptions& o) {
    const std::uint64_t block_bytes = o.block_bytes;
    const double per_process = process_bytes(o, 1);
    if (per_process > 64.0 * (1u << 30)) {
      throw InvalidArgument(
          fmt::format("--capacity-blocks: {} blocks of {} bytes is over 64 GiB per process",
                      o.capacity_blocks, block_bytes));
    }
    // A rank holds its slice of the heads; the two baseline ranks hold a
    // scratch buffer of at most 512 MiB besides.
    double total = 0;
    for (const Role role : {Role::prefill, Role::decode}) {
      // Replicated groups (MLA, state) are whole on every rank.
      total += static_cast<double>(o.instances(role)) * static_cast<double>(o.tp(role)) *
               process_bytes(o, o.tp(role));
    }
    total += 2.0 * static_cast<double>(std::uint64_t{512} << 20);
    const std::size_t memory = host_physical_memory();  // 0: unknown, not checked
    if (memory != 0 && total > static_cast<double>(memory)) {
      const auto processes = o.prefill * o.tp_prefill + o.decode * o.tp_decode;
      throw InvalidArgument(fmt::format(
          "--capacity-blocks {}: {} worker processes hold {} of KV cache in all ({} blocks of {} "
          "per instance), more than this machine has ({})",
          o.capacity_blocks, processes, format_bytes(static_cast<std::size_t>(total)),
          o.capacity_blocks, format_bytes(block_bytes), format_bytes(memory)));
    }
  }

  std::vector<disagg::Request> load_trace(const disagg::RunOptions& o, std::size_t& skipped) const {
    const auto trace = sim::read_mooncake_trace(o.trace);
    const std::size_t count =
        max_requests_ ? std::min<std::size_t>(*max_requests_, trace.size()) : trace.size();
    std::vector<disagg::Request> requests;
    for (std::size_t i = 0; i < count; ++i) {
      disagg::Request r;
      sim::sequence_tokens(trace[i], i, kTraceBlockTokens, trace[i].input_length, r.tokens);
      r.blocks = div_ceil(r.tokens.size(), o.config.block_size);
      if (r.blocks > o.capacity_blocks) {
        ++skipped;
        continue;
      }
      r.index = requests.size();
      requests.push_back(std::move(r));
    }
    if (requests.empty()) {
      throw InvalidArgument(
          fmt::format("--trace: no request fits --capacity-blocks {} ({} skipped)",
                      o.capacity_blocks, skipped));
    }
    return requests;
  }

  CacheShapeOptions shape_;
  TextFlag trace_, prefill_, decode_, tp_prefill_, tp_decode_, capacity_, requests_, kill_, after_,
      kill_signal_, peer_timeout_ms_, lease_ttl_ms_, timeout_s_, bind_, worker_spec_;
  bool json_ = false;
  mutable std::optional<std::size_t> max_requests_;
};

}  // namespace

std::unique_ptr<Command> make_disagg_command() {
  return std::make_unique<DisaggCommand>();
}

}  // namespace kvport::cli
