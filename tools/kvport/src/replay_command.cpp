// SPDX-License-Identifier: Apache-2.0
// `kvport replay`: replays a Mooncake request trace over a PrefixCache
// (kvport/sim/replay.hpp, on a host backend) and reports prefix-cache hits, evictions and
// preemptions.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>

#include "cache_options.hpp"
#include "command.hpp"
#include "event_form.hpp"
#include "group_replay.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/cli/model_spec.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/disk/disk_tier.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/replay.hpp"
#include "text_table.hpp"

namespace kvport::cli {
namespace {

using sim::ReplayOptions;
using sim::ReplayResult;
using sim::TraceRequest;

// Parses a positive finite decimal number (e.g. "50", "31.5"); InvalidArgument
// naming the flag otherwise.
double parse_positive_number(const std::string& text, std::string_view flag) {
  double result = 0.0;
  std::size_t used = 0;
  bool parsed = false;
  try {
    result = std::stod(text, &used);
    parsed = used == text.size() && used != 0 && text.front() != ' ';
  } catch (const std::exception&) {
    parsed = false;
  }
  if (!parsed || !std::isfinite(result) || result <= 0.0) {
    throw InvalidArgument(
        fmt::format("{}: expected a positive number, e.g. 50, got '{}'", flag, text));
  }
  return result;
}

// Below this many requests a replay takes well under a second: no bar unless
// --progress asks for one.
constexpr std::size_t kProgressMinRequests = 1000;
// `kvport replay --events` exits within this: the events still buffered are
// published and ZeroMQ given the rest of it to send them (Publisher::close).
constexpr std::chrono::milliseconds kEventsExitTimeout{10'000};

// A one-line bar on stderr, redrawn with '\r' when the percentage changes.
class ProgressBar {
 public:
  explicit ProgressBar(std::ostream& err) : err_(err) {}
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void update(std::size_t done, std::size_t total) {
    const std::size_t percent = total == 0 ? 100 : done * 100 / total;
    if (percent == last_percent_ && done != total) return;
    last_percent_ = percent;
    constexpr std::size_t kWidth = 30;
    const std::size_t filled = percent * kWidth / 100;
    err_ << fmt::format("\rkvport replay [{}{}] {:3}% {}/{} requests", std::string(filled, '#'),
                        std::string(kWidth - filled, ' '), percent, done, total)
         << std::flush;
    drawn_ = true;
  }

  /// Ends the line, so that what follows starts on a line of its own.
  void finish() {
    if (drawn_) err_ << '\n' << std::flush;
    drawn_ = false;
  }

 private:
  std::ostream& err_;
  std::size_t last_percent_ = static_cast<std::size_t>(-1);
  bool drawn_ = false;
};

class ReplayCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Examples:\n"
        "  kvport replay --trace mooncake_trace.jsonl --capacity-blocks 8192\n"
        "  kvport replay --trace trace.jsonl --capacity-blocks 512 --concurrency 1 --json\n"
        "  kvport replay --trace trace.jsonl --capacity-blocks 65536 --host-tier-blocks 196608\n"
        "  kvport replay --trace trace.jsonl --capacity-blocks 65536 --host-tier-blocks 65536 \\\n"
        "      --disk-tier-blocks 131072 --disk-dir /var/tmp/kvport-disk\n"
        "  kvport replay --trace trace.jsonl --memory 40GiB --model gpt-oss-120b\n"
        "Exit status: 0 when the invariant checks pass, 1 when one fails, 2 on bad input.");
    add(app, "--trace", trace_, "FILE",
        "Mooncake trace, JSON Lines: timestamp (ms), input_length, output_length, hash_ids "
        "(required)");
    add(app, "--capacity-blocks", capacity_, "N", "KV-cache blocks (required)");
    block_size_.value = "16";
    add(app, "--block-size", block_size_, "TOKENS", "Tokens per KV-cache block (default 16)");
    trace_block_tokens_.value = "512";
    add(app, "--trace-block-tokens", trace_block_tokens_, "TOKENS",
        "Tokens per hash id of the trace (default 512, Mooncake's)");
    concurrency_.value = "64";
    add(app, "--concurrency", concurrency_, "N", "Most requests running at once (default 64)");
    step_ms_.value = "10";
    add(app, "--step-ms", step_ms_, "MS", "Simulated time of one decode step (default 10)");
    check_every_.value = "0";
    add(app, "--check-every", check_every_, "STEPS",
        "Also check the prefix cache's invariants every STEPS steps (default 0: at the end only)");
    app.add_flag("--full-prefix-hits", full_prefix_hits_,
                 "Hit every cached block of a fully cached prompt (default: leave its last token "
                 "to compute, the last block a private copy, as an engine needs)");
    app.add_flag("--separate-pools", separate_pools_,
                 "Models of several KV cache groups: a pool per group, split by the ratio of "
                 "their peak needs (default: the attention groups whose pages match share one "
                 "pool, and memory moves between them)");
    add(app, "--host-tier-blocks", host_tier_blocks_, "N",
        "Host-memory tier under the cache (HostTier), N blocks: evicted blocks are written back "
        "and onloaded on a hit (default: no host tier)");
    add(app, "--tier-policy", tier_policy_, "POLICY",
        "write-back (copy a block to the host when the device evicts it; the default) or "
        "write-through (copy every block once it is filled)");
    add(app, "--tier-inclusion", tier_inclusion_, "MODE",
        "exclusive (an onloaded block leaves the host; the default) or inclusive (the host keeps "
        "its copy)");
    add(app, "--disk-tier-blocks", disk_tier_blocks_, "N",
        "Disk tier under the host tier (needs --host-tier-blocks and --disk-dir), N blocks: "
        "blocks the host drops are written to disk, lookups continue there (real I/O of the "
        "replay's small blocks; the directory persists: a rerun finds them)");
    add(app, "--disk-dir", disk_dir_, "DIR",
        "Directory of the disk tier (created when missing; refused when made for another "
        "layout or size, or in use by another process)");
    add(app, "--disk-min-hits", disk_min_hits_, "K",
        "Write a block to disk only once lookups hit it K times (SSD wear; default 0: every "
        "block the host drops)");
    add(app, "--host-free-watermark", host_free_watermark_, "N",
        "With a disk tier: keep N host slots free by writing the host's least recently used "
        "blocks to disk in each step (up to 2N at once), so that a lookup reads the disk "
        "without writing first (default 0: write only when a call needs the room)");
    add(app, "--disk-io", disk_io_, "ENGINE",
        "automatic (io_uring where the kernel allows, else pread/pwrite; the default), "
        "io_uring, or sync (pread/pwrite)");
    add(app, "--host-link-gbps", host_link_gbps_, "GB/S",
        "Host link bandwidth per direction for the modeled transfer time, 10^9 bytes/s (default "
        "50: PCIe Gen5 x16 effective; 64 raw)");
    add(app, "--model", model_, "NAME",
        "Model preset whose block bytes (bf16, --block-size tokens) model the transfer bytes "
        "(default llama-3-8b)");
    add(app, "--memory", memory_, "SIZE",
        "Replay over the model's KV cache groups with SIZE of the real model's KV memory (e.g. "
        "40GiB), beside the same model as all full attention; replaces --capacity-blocks");
    add(app, "--hf-config", hf_config_, "FILE",
        "With --memory: the model from a Hugging Face config.json (instead of --model)");
    add(app, "--context", context_, "TOKENS",
        "With --memory: the context the memory is planned for (default: the longest request)");
    prefill_chunk_.value = "512";
    add(app, "--prefill-chunk", prefill_chunk_, "TOKENS",
        "With --memory: tokens prefilled per chunk (default 512)");
    checkpoint_interval_.value = "1";
    add(app, "--checkpoint-interval", checkpoint_interval_, "BLOCKS",
        "With --memory: cache a state checkpoint every BLOCKS blocks (default 1; 0: none)");
    static const std::string progress_help =
        "Progress bar on stderr (default: when stderr is a terminal and the trace has at least "
        "1000 requests)";
    static const std::string no_progress_help = "No progress bar";
    add(app, "--events", events_, "ENDPOINT",
        "Publish the cache's KV events in vLLM's wire format on a ZeroMQ PUB socket bound to "
        "ENDPOINT (e.g. tcp://127.0.0.1:5557; port 0: any free port, reported); docs/events.md");
    add(app, "--events-replay", events_replay_, "ENDPOINT",
        "With --events: also a ROUTER socket for replay and snapshot requests at ENDPOINT");
    add(app, "--events-topic", events_topic_, "TOPIC",
        "With --events: the first frame of every message (default empty, as vLLM's; llm-d "
        "subscribes to kv@<pod>@<model>)");
    add(app, "--events-form", events_form_, "FORM",
        "With --events: map (vLLM since mid-2026, the default) or positional (older vLLM, "
        "array-like events)");
    progress_on_ = app.add_flag("--progress", progress_help);
    progress_off_ = app.add_flag("--no-progress", no_progress_help);
    app_ = &app;
    app.add_flag("--json", json_, "Print one JSON object instead of the report");
  }

  int execute(std::ostream& out, std::ostream& err) override {
    if (!trace_.given()) throw InvalidArgument("--trace: missing (a Mooncake trace, JSON Lines)");
    if (trace_.value.empty()) throw InvalidArgument("--trace: empty path");
    if (memory_.given()) return execute_groups(out);
    for (const auto& [flag, name] :
         {std::pair{&hf_config_, "--hf-config"}, std::pair{&context_, "--context"},
          std::pair{&prefill_chunk_, "--prefill-chunk"},
          std::pair{&checkpoint_interval_, "--checkpoint-interval"}}) {
      if (flag->given()) {
        throw InvalidArgument(
            fmt::format("{}: needs --memory (the replay over KV cache groups)", name));
      }
    }
    if (!capacity_.given()) {
      throw InvalidArgument("--capacity-blocks: missing (the size of the KV cache in blocks)");
    }
    ReplayOptions options;
    options.capacity_blocks = parse_positive_count(capacity_.value, "--capacity-blocks");
    options.block_size = parse_positive_count(block_size_.value, "--block-size");
    options.trace_block_tokens =
        parse_positive_count(trace_block_tokens_.value, "--trace-block-tokens");
    options.concurrency = parse_positive_count(concurrency_.value, "--concurrency");
    options.step_ms = parse_positive_count(step_ms_.value, "--step-ms");
    options.check_every = parse_count(check_every_.value, "--check-every");
    if (full_prefix_hits_) options.prefix_hit_mode = PrefixHitMode::full;
    if (host_tier_blocks_.given()) {
      options.host_tier_blocks =
          parse_positive_count(host_tier_blocks_.value, "--host-tier-blocks");
    } else {
      refuse_tier_flags_without_tier(/*with_model=*/true);
    }
    parse_tier_modes(options.tier_policy, options.tier_inclusion);
    if (host_link_gbps_.given()) {
      options.host_link_gbps = parse_positive_number(host_link_gbps_.value, "--host-link-gbps");
    }
    if (model_.given()) options.model = model_.value;
    std::unique_ptr<disk::DiskTier> disk_tier;
    parse_disk_tier(options, disk_tier);
    options.validate();  // before reading a trace that may be large
    // Bound before the trace is read, so that a bad endpoint is one line.
    std::optional<events::Publisher> publisher;
    bind_events(publisher);
    if (publisher) {
      options.event_sink = &*publisher;
      // Events were dropped: snapshots wait until the caches re-announce
      // their sets, here between two steps, on the replay's thread.
      options.on_step = [&publisher, this](const sim::ReplayProgress& p) {
        if (!publisher->needs_resync() || p.prefix == nullptr) return;
        const PrefixCache& prefix = *p.prefix;
        const HostTier* tier = p.tier;
        const bool done = publisher->resync([&](CacheEventSink& sink) {
          prefix.snapshot(sink);
          if (tier != nullptr) tier->snapshot(sink);
        });
        if (!done) ++events_resync_failures_;
      };
    }

    const std::vector<TraceRequest> requests = sim::read_mooncake_trace(trace_.value);

    // The last of --progress / --no-progress wins, so that scripts can append.
    std::optional<bool> progress;
    for (const CLI::Option* option : app_->parse_order()) {
      if (option == progress_on_) progress = true;
      if (option == progress_off_) progress = false;
    }
    const bool show_progress =
        progress.value_or(::isatty(STDERR_FILENO) == 1 && requests.size() >= kProgressMinRequests);
    ProgressBar bar(err);
    if (show_progress) {
      options.progress = [&bar](std::size_t done, std::size_t total) { bar.update(done, total); };
    }
    ReplayResult result;
    try {
      const std::unique_ptr<Backend> backend = make_host_backend();
      result = sim::run_replay(requests, options, *backend);
      if (disk_tier) {
        disk_tier->store().flush();
        disk_counters_ = disk_tier->store().counters();
        disk_blocks_at_end_ = disk_tier->store().size();
      }
    } catch (...) {
      bar.finish();
      throw;
    }
    bar.finish();
    if (publisher) {
      // The bounded exit flush: what a slow subscriber may not have had is
      // reported, not lost silently.
      events_close_ = publisher->close(kEventsExitTimeout);
      events_stats_ = publisher->stats();
      events_endpoint_ = publisher->endpoint();
    }

    if (json_) {
      print_json(out, options, result);
    } else {
      print_text(out, options, result);
    }
    return result.ok() ? kExitOk : kExitCheckFailed;
  }

 private:
  // --disk-tier-blocks, --disk-dir, --disk-min-hits, --disk-io: the store's
  // options, and the callback that opens it for the replay's cache (into
  // `disk_tier`, which outlives the replay). Without --disk-tier-blocks the
  // others are errors; without a host tier ReplayOptions::validate refuses
  // the callback.
  void parse_disk_tier(ReplayOptions& options, std::unique_ptr<disk::DiskTier>& disk_tier) {
    if (!disk_tier_blocks_.given()) {
      for (const auto& [flag, name] :
           {std::pair{&disk_dir_, "--disk-dir"}, std::pair{&disk_min_hits_, "--disk-min-hits"},
            std::pair{&disk_io_, "--disk-io"},
            std::pair{&host_free_watermark_, "--host-free-watermark"}}) {
        if (flag->given()) {
          throw InvalidArgument(fmt::format("{}: needs --disk-tier-blocks (a disk tier)", name));
        }
      }
      return;
    }
    disk_options_.num_slots = parse_positive_count(disk_tier_blocks_.value, "--disk-tier-blocks");
    if (disk_options_.num_slots > disk::DiskStoreOptions::kMaxSlots) {
      throw InvalidArgument(fmt::format("--disk-tier-blocks: at most {}, got {}",
                                        disk::DiskStoreOptions::kMaxSlots,
                                        disk_options_.num_slots));
    }
    if (!disk_dir_.given() || disk_dir_.value.empty()) {
      throw InvalidArgument("--disk-dir: required with --disk-tier-blocks (where the blocks go)");
    }
    disk_options_.dir = disk_dir_.value;
    if (disk_min_hits_.given()) {
      disk_options_.min_hits = static_cast<std::uint32_t>(
          parse_count_in(disk_min_hits_.value, "--disk-min-hits", 0, UINT32_MAX));
    }
    if (host_free_watermark_.given()) {
      options.host_free_watermark =
          parse_count_in(host_free_watermark_.value, "--host-free-watermark", 0, UINT32_MAX);
    }
    host_free_watermark_n_ = options.host_free_watermark;
    if (disk_io_.given()) {
      const std::optional<disk::IoEngine> engine = disk::parse_io_engine(disk_io_.value);
      if (!engine) {
        throw InvalidArgument(
            fmt::format("--disk-io: unknown engine '{}' (expected automatic, io_uring or sync)",
                        disk_io_.value));
      }
      disk_options_.engine = *engine;
    }
    options.lower_tier = [this, &disk_tier](const KvCacheConfig& config,
                                            std::size_t block_bytes) -> LowerTierStore* {
      disk_options_.block_bytes = block_bytes;
      disk_options_.layout = disk::layout_fields(config);
      try {
        disk_tier = disk::DiskTier::open(disk_options_);
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(fmt::format("--disk-dir {}: {}", disk_dir_.value, e.what()));
      }
      disk_description_ = disk_tier->store().io_description();
      return disk_tier.get();
    };
  }

  // --memory: the replay over the model's KV cache groups (group_replay.hpp).
  // --events (and --events-replay): the publisher, bound; none without.
  void bind_events(std::optional<events::Publisher>& publisher) const {
    for (const auto& [flag, name] :
         {std::pair{&events_replay_, "--events-replay"},
          std::pair{&events_topic_, "--events-topic"}, std::pair{&events_form_, "--events-form"}}) {
      if (flag->given() && !events_.given())
        throw InvalidArgument(fmt::format("{}: needs --events", name));
    }
    if (!events_.given()) return;
    events::PublisherOptions po;
    po.endpoint = events_.value;
    if (events_replay_.given()) po.replay_endpoint = events_replay_.value;
    if (events_topic_.given()) po.topic = events_topic_.value;
    if (events_form_.given()) po.form = event_form(events_form_.value);
    // The replay's caches and tiers emit on its one thread: no lock needed.
    po.single_producer = true;
    try {
      publisher.emplace(po);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("--events: {}", e.what()));
    }
  }

  int execute_groups(std::ostream& out) const {
    for (const auto& [flag, name] : {std::pair{&capacity_, "--capacity-blocks"},
                                     std::pair{&host_link_gbps_, "--host-link-gbps"},
                                     std::pair{&check_every_, "--check-every"}}) {
      if (flag->given()) {
        throw InvalidArgument(fmt::format(
            "{}: not with --memory (the group replay sizes its groups from the memory and checks "
            "the invariants at the end)",
            name));
      }
    }
    for (const auto& [flag, name] :
         {std::pair{&disk_tier_blocks_, "--disk-tier-blocks"}, std::pair{&disk_dir_, "--disk-dir"},
          std::pair{&disk_min_hits_, "--disk-min-hits"}, std::pair{&disk_io_, "--disk-io"}}) {
      if (flag->given()) {
        throw InvalidArgument(fmt::format(
            "{}: not with --memory yet (the group replay has no disk tier; HybridHostTier takes "
            "one per group: set_lower_tier)",
            name));
      }
    }
    GroupReplayRun run;
    run.trace = trace_.value;
    sim::ModelReplayOptions& o = run.options;
    try {
      o.budget_bytes = parse_byte_size(memory_.value);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("--memory: {}", e.what()));
    }
    if (o.budget_bytes == 0) throw InvalidArgument("--memory: must be more than 0 bytes");
    o.block_size = parse_positive_count(block_size_.value, "--block-size");
    o.trace_block_tokens = parse_positive_count(trace_block_tokens_.value, "--trace-block-tokens");
    o.concurrency = parse_positive_count(concurrency_.value, "--concurrency");
    o.step_ms = parse_positive_count(step_ms_.value, "--step-ms");
    o.prefill_chunk_tokens = parse_positive_count(prefill_chunk_.value, "--prefill-chunk");
    o.state_checkpoint_interval = parse_count(checkpoint_interval_.value, "--checkpoint-interval");
    if (context_.given()) o.max_context_tokens = parse_positive_count(context_.value, "--context");
    if (full_prefix_hits_) o.prefix_hit_mode = PrefixHitMode::full;
    o.shared_pool = !separate_pools_;
    if (host_tier_blocks_.given()) {
      o.host_tier_blocks = parse_positive_count(host_tier_blocks_.value, "--host-tier-blocks");
    } else {
      refuse_tier_flags_without_tier(/*with_model=*/false);
    }
    parse_tier_modes(o.tier_policy, o.tier_inclusion);
    ModelOverrides model;
    if (model_.given()) model.preset = model_.value;
    if (hf_config_.given()) model.hf_config = hf_config_.value;
    const ModelSpec spec = resolve_model_spec(model, "llama-3-8b");
    run.model = spec.name;
    run.model_source = spec.source;
    o.layers = spec.layers;
    if (o.layers.empty()) {
      o.layers.assign(spec.num_layers, LayerSpec::full_attention(spec.num_kv_heads, spec.head_dim_k,
                                                                 spec.head_dim_v));
    }
    o.validate();
    std::optional<events::Publisher> publisher;
    bind_events(publisher);
    if (publisher) o.event_sink = &*publisher;
    run_group_replay(run);
    if (publisher) {
      const events::CloseReport closed = publisher->close(kEventsExitTimeout);  // bounded
      run.events = GroupReplayRun::Events{publisher->endpoint(), publisher->stats(), closed};
    }
    if (json_) {
      print_group_replay_json(out, run);
    } else {
      print_group_replay_text(out, run);
    }
    return run.groups.invariants.ok && run.all_full.invariants.ok ? kExitOk : kExitCheckFailed;
  }

  // The tier's flags without --host-tier-blocks are errors (--model names
  // the modeled block's size only for the replay without groups).
  void refuse_tier_flags_without_tier(bool with_model) const {
    for (const auto& [flag, name] :
         {std::pair{&tier_policy_, "--tier-policy"},
          std::pair{&tier_inclusion_, "--tier-inclusion"},
          std::pair{&host_link_gbps_, "--host-link-gbps"}, std::pair{&model_, "--model"}}) {
      if (flag == &model_ && !with_model) continue;
      if (flag->given()) {
        throw InvalidArgument(fmt::format("{}: needs --host-tier-blocks (a host tier)", name));
      }
    }
  }

  // --tier-policy and --tier-inclusion, when given.
  void parse_tier_modes(TierPolicy& policy, TierInclusion& inclusion) const {
    if (tier_policy_.given()) {
      const std::optional<TierPolicy> parsed = parse_tier_policy(tier_policy_.value);
      if (!parsed) {
        throw InvalidArgument(
            fmt::format("--tier-policy: unknown policy '{}' (expected write-back or write-through)",
                        tier_policy_.value));
      }
      policy = *parsed;
    }
    if (tier_inclusion_.given()) {
      if (tier_inclusion_.value == "exclusive") {
        inclusion = TierInclusion::exclusive;
      } else if (tier_inclusion_.value == "inclusive") {
        inclusion = TierInclusion::inclusive;
      } else {
        throw InvalidArgument(
            fmt::format("--tier-inclusion: unknown mode '{}' (expected exclusive or inclusive)",
                        tier_inclusion_.value));
      }
    }
  }

  static void add(CLI::App& app, const char* name, TextFlag& flag, const char* type,
                  const char* help) {
    add_text_flag(app, name, flag, type, help);
  }

  static std::string hit_mode_text(PrefixHitMode mode) {
    return mode == PrefixHitMode::full
               ? "full (every cached block, --full-prefix-hits)"
               : "compute_last_token (a fully cached prompt leaves its last token to compute)";
  }

  static std::string percent(double ratio) { return fmt::format("{:.1f}%", 100.0 * ratio); }
  // Modeled bytes in GB (10^9, as the link's GB/s).
  static std::string gb(double bytes) { return fmt::format("{:.1f} GB", bytes / 1e9); }

  void print_text(std::ostream& out, const ReplayOptions& o, const ReplayResult& r) const {
    out << fmt::format(
        "kvport replay: {} requests from {}\n"
        "cache {} blocks x {} tokens, {} tokens per hash id, up to {} running, {} ms per "
        "step\n"
        "prefix hits: {}\n",
        r.requests, trace_.value, o.capacity_blocks, o.block_size, o.trace_block_tokens,
        o.concurrency, o.step_ms, hit_mode_text(o.prefix_hit_mode));
    const bool tier = o.host_tier_blocks != 0;
    if (tier) {
      out << fmt::format(
          "host tier: {} blocks, {}, {}; transfers modeled for {} ({} a block, {} of host "
          "memory) over {:g} GB/s{}\n",
          o.host_tier_blocks, to_string(o.tier_policy), to_string(o.tier_inclusion), o.model,
          format_bytes(r.model_block_bytes), gb(r.modeled_host_bytes()), o.host_link_gbps,
          o.host_link_gbps == ReplayOptions::kPcieGen5x16Gbps
              ? " (PCIe Gen5 x16 effective; 64 GB/s raw per direction)"
              : "");
    }
    if (disk_tier_blocks_.given()) {
      out << fmt::format("disk tier: {} blocks in {}, {}{}\n", disk_options_.num_slots,
                         disk_options_.dir.string(), disk_description_,
                         disk_options_.min_hits == 0
                             ? ""
                             : fmt::format("; written once hit {} times", disk_options_.min_hits));
    }
    out << '\n';
    TextTable table({"", "value", "detail"},
                    {TextTable::Align::left, TextTable::Align::right, TextTable::Align::left});
    table.add_row({"requests", std::to_string(r.requests),
                   fmt::format("{} completed, {} rejected", r.completed, r.rejected)});
    table.add_row({tier ? "block hit rate (combined)" : "block hit rate", percent(r.hit_rate()),
                   fmt::format("{} of {} full prompt blocks", r.hit_blocks, r.prompt_blocks)});
    if (tier) {
      table.add_row({"  device hits", percent(r.device_hit_rate()),
                     fmt::format("{} blocks", r.device_hit_blocks)});
      table.add_row({"  host hits", percent(r.host_hit_rate()),
                     fmt::format("{} blocks (onloaded at admission)", r.host_hit_blocks)});
      if (disk_tier_blocks_.given()) {
        table.add_row(
            {"  disk hits", percent(r.lower_hit_rate()),
             fmt::format("{} blocks (read into host slots, onloaded)", r.lower_hit_blocks)});
      }
    }
    table.add_row({"token hit rate", percent(r.token_hit_rate()),
                   fmt::format("{} of {} prompt tokens", r.hit_tokens, r.prompt_tokens)});
    table.add_row({"last-block copies", std::to_string(r.last_block_copies),
                   "fully cached prompts, last token left to compute"});
    if (tier) {
      table.add_row({"offloaded", fmt::format("{} blocks", r.offloaded_blocks()),
                     fmt::format("{} modeled, {:.3f} s", gb(r.modeled_offload_bytes()),
                                 r.modeled_offload_s())});
      table.add_row({"onloaded", fmt::format("{} blocks", r.onloaded_blocks()),
                     fmt::format("{} modeled, {:.3f} s", gb(r.modeled_onload_bytes()),
                                 r.modeled_onload_s())});
      table.add_row(
          {"transfer time", fmt::format("{:.3f} s", r.modeled_transfer_s()),
           fmt::format("modeled: offload + onload bytes at {:g} GB/s", o.host_link_gbps)});
      const HostTierCounters& c = r.tier;
      table.add_row(
          {"host tier", fmt::format("{} blocks", r.host_blocks_at_end),
           fmt::format("on the host at the end; {} host evictions, {} already on host, "
                       "{} dropped, {} waits, {} onload shortfalls, {} aborted, {} "
                       "past the copy deadline",
                       c.host_evictions, c.already_on_host, c.dropped_offloads, c.offload_waits,
                       c.onload_shortfalls, c.aborted_transfers, c.stalled_transfers)});
    }
    if (disk_tier_blocks_.given()) add_disk_rows(table, r);
    table.add_row({"evictions", std::to_string(r.evictions),
                   fmt::format("{} blocks cached at the end", r.cached_blocks_at_end)});
    table.add_row({"preemptions", std::to_string(r.preemptions),
                   fmt::format("{} tokens recomputed", r.recomputed_tokens)});
    table.add_row({"running requests", std::to_string(r.peak_running),
                   fmt::format("peak; mean {:.1f} over the steps", r.mean_running)});
    table.add_row({"peak blocks in use", std::to_string(r.peak_blocks_in_use),
                   fmt::format("of {}", o.capacity_blocks)});
    table.add_row({"queueing", fmt::format("{:.1f} ms", r.mean_queue_ms),
                   fmt::format("mean; max {:.1f} ms", r.max_queue_ms)});
    table.add_row(
        {"simulated", fmt::format("{:.0f} ms", r.simulated_ms), fmt::format("{} steps", r.steps)});
    table.add_row({"operations", std::to_string(r.operations()),
                   fmt::format("{} lookups, {} allocations, {} releases", r.lookups, r.allocations,
                               r.releases)});
    table.add_row({"throughput", fmt::format("{:.0f} req/s", r.requests_per_s()),
                   fmt::format("{:.0f} ops/s in {:.3f} s", r.operations_per_s(), r.wall_s)});
    table.print(out);
    if (events_.given()) {
      out << fmt::format(
          "\nEvents      {} published on {} in {} batches, {} dropped (buffer full), {} sends "
          "refused\n            {} not delivered at most ({} in refused sends{}), {} sequence gaps "
          "for drops, {} resyncs ({} failed)\n",
          events_stats_.events_accepted, events_endpoint_, events_stats_.batches_sent,
          events_stats_.events_dropped, events_stats_.send_failures, events_close_.not_delivered(),
          events_close_.events_unsent,
          events_close_.drained ? ""
                                : fmt::format(", up to {} discarded at exit by a slow subscriber",
                                              events_close_.events_maybe_discarded),
          events_stats_.loss_gaps, events_stats_.resyncs, events_resync_failures_);
    }
    out << "\nInvariants  " << r.invariants.to_string() << '\n';
    if (r.stopped_at_step != 0) out << "Stopped     at step " << r.stopped_at_step << '\n';
    out << "Result      " << (r.ok() ? "OK" : "FAILED") << '\n';
  }

  // Real bytes over measured seconds, in MB/s (10^6); 0 without time.
  static double mb_per_s(std::uint64_t bytes, std::uint64_t ns) {
    return ns == 0 ? 0.0 : static_cast<double>(bytes) / 1e6 / (static_cast<double>(ns) / 1e9);
  }

  void add_disk_rows(TextTable& table, const ReplayResult& r) const {
    const disk::DiskStoreCounters& d = disk_counters_;
    const HostTierCounters& c = r.tier;
    table.add_row(
        {"disk written", fmt::format("{} blocks", d.writes),
         fmt::format(
             "{} of {} offered by the host ({} inside lookups, {} ahead by poll); {:.1f} MB in "
             "{:.3f} s ({:.1f} MB/s) + index {:.3f} s; {} modeled",
             c.lower_tier_writes, c.lower_tier_offers, c.lookup_spills, c.poll_spills,
             static_cast<double>(d.write_bytes) / 1e6, static_cast<double>(d.write_ns) / 1e9,
             mb_per_s(d.write_bytes, d.write_ns), static_cast<double>(d.index_ns) / 1e9,
             gb(static_cast<double>(d.writes) * static_cast<double>(r.model_block_bytes)))});
    table.add_row(
        {"disk read", fmt::format("{} blocks", d.reads),
         fmt::format("{:.1f} MB in {:.3f} s ({:.1f} MB/s); {} modeled",
                     static_cast<double>(d.read_bytes) / 1e6, static_cast<double>(d.read_ns) / 1e9,
                     mb_per_s(d.read_bytes, d.read_ns),
                     gb(static_cast<double>(d.reads) * static_cast<double>(r.model_block_bytes)))});
    table.add_row(
        {"disk tier", fmt::format("{} blocks", disk_blocks_at_end_),
         fmt::format("on disk at the end ({} found at open); {} evictions, {} not admitted, {} "
                     "already there, {} write failures, {} index failures, {} read failures, {} "
                     "checksum failures, {} past the deadline, {} shortfalls",
                     d.recovered, d.evictions, d.not_admitted, d.already_stored, d.write_failures,
                     d.index_failures, d.read_failures, d.checksum_failures, d.timeouts,
                     c.lower_tier_shortfalls)});
  }

  nlohmann::ordered_json disk_json(const ReplayResult& r) const {
    const disk::DiskStoreCounters& d = disk_counters_;
    nlohmann::ordered_json j;
    j["blocks"] = disk_options_.num_slots;
    j["dir"] = disk_options_.dir.string();
    j["io"] = disk_description_;
    j["min_hits"] = disk_options_.min_hits;
    j["host_free_watermark"] = host_free_watermark_n_;
    j["hit_blocks"] = r.lower_hit_blocks;
    j["hit_rate"] = r.lower_hit_rate();
    j["blocks_at_end"] = disk_blocks_at_end_;
    j["recovered_at_open"] = d.recovered;
    j["dropped_at_open"] = d.dropped_at_open;
    j["writes"] = d.writes;
    j["write_bytes"] = d.write_bytes;
    j["write_s"] = static_cast<double>(d.write_ns) / 1e9;
    j["write_mb_per_s"] = mb_per_s(d.write_bytes, d.write_ns);
    j["index_s"] = static_cast<double>(d.index_ns) / 1e9;
    j["reads"] = d.reads;
    j["read_bytes"] = d.read_bytes;
    j["read_s"] = static_cast<double>(d.read_ns) / 1e9;
    j["read_mb_per_s"] = mb_per_s(d.read_bytes, d.read_ns);
    j["modeled_write_bytes"] =
        static_cast<double>(d.writes) * static_cast<double>(r.model_block_bytes);
    j["modeled_read_bytes"] =
        static_cast<double>(d.reads) * static_cast<double>(r.model_block_bytes);
    j["evictions"] = d.evictions;
    j["not_admitted"] = d.not_admitted;
    j["already_stored"] = d.already_stored;
    j["dropped_puts"] = d.dropped_puts;
    j["write_failures"] = d.write_failures;
    j["index_failures"] = d.index_failures;
    j["read_failures"] = d.read_failures;
    j["checksum_failures"] = d.checksum_failures;
    j["timeouts"] = d.timeouts;
    return j;
  }

  void print_json(std::ostream& out, const ReplayOptions& o, const ReplayResult& r) const {
    nlohmann::ordered_json j;
    j["trace"] = trace_.value;
    j["capacity_blocks"] = o.capacity_blocks;
    j["block_size"] = o.block_size;
    j["trace_block_tokens"] = o.trace_block_tokens;
    j["concurrency"] = o.concurrency;
    j["step_ms"] = o.step_ms;
    j["prefix_hit_mode"] = to_string(o.prefix_hit_mode);
    j["requests"] = r.requests;
    j["completed"] = r.completed;
    j["rejected"] = r.rejected;
    j["prompt_blocks"] = r.prompt_blocks;
    j["hit_blocks"] = r.hit_blocks;
    j["hit_rate"] = r.hit_rate();
    j["prompt_tokens"] = r.prompt_tokens;
    j["hit_tokens"] = r.hit_tokens;
    j["token_hit_rate"] = r.token_hit_rate();
    j["last_block_copies"] = r.last_block_copies;
    j["evictions"] = r.evictions;
    j["preemptions"] = r.preemptions;
    j["peak_running"] = r.peak_running;
    j["mean_running"] = r.mean_running;
    j["prefill_tokens"] = r.prefill_tokens;
    j["recomputed_tokens"] = r.recomputed_tokens;
    j["generated_tokens"] = r.generated_tokens;
    j["peak_blocks_in_use"] = r.peak_blocks_in_use;
    j["cached_blocks_at_end"] = r.cached_blocks_at_end;
    j["cache_inserts"] = r.cache_inserts;
    j["lookups"] = r.lookups;
    j["allocations"] = r.allocations;
    j["releases"] = r.releases;
    j["operations"] = r.operations();
    j["steps"] = r.steps;
    j["simulated_ms"] = r.simulated_ms;
    j["mean_queue_ms"] = r.mean_queue_ms;
    j["max_queue_ms"] = r.max_queue_ms;
    j["wall_s"] = r.wall_s;
    j["requests_per_s"] = r.requests_per_s();
    j["operations_per_s"] = r.operations_per_s();
    if (o.host_tier_blocks != 0) {
      j["host_tier_blocks"] = o.host_tier_blocks;
      j["tier_policy"] = to_string(o.tier_policy);
      j["tier_inclusion"] = to_string(o.tier_inclusion);
      j["model"] = o.model;
      j["model_block_bytes"] = r.model_block_bytes;
      j["host_link_gbps"] = o.host_link_gbps;
      j["device_hit_blocks"] = r.device_hit_blocks;
      j["host_hit_blocks"] = r.host_hit_blocks;
      j["device_hit_rate"] = r.device_hit_rate();
      j["host_hit_rate"] = r.host_hit_rate();
      j["lower_hit_blocks"] = r.lower_hit_blocks;
      j["combined_hit_rate"] = r.hit_rate();
      j["offloaded_blocks"] = r.offloaded_blocks();
      j["onloaded_blocks"] = r.onloaded_blocks();
      j["modeled_offload_bytes"] = r.modeled_offload_bytes();
      j["modeled_onload_bytes"] = r.modeled_onload_bytes();
      j["modeled_offload_s"] = r.modeled_offload_s();
      j["modeled_onload_s"] = r.modeled_onload_s();
      j["modeled_transfer_s"] = r.modeled_transfer_s();
      j["modeled_host_bytes"] = r.modeled_host_bytes();
      j["host_blocks_at_end"] = r.host_blocks_at_end;
      const HostTierCounters& c = r.tier;
      j["tier_counters"] = tier_counters_json(c);
    }
    if (disk_tier_blocks_.given()) j["disk_tier"] = disk_json(r);
    if (events_.given()) {
      j["events"] = {{"endpoint", events_endpoint_},
                     {"accepted", events_stats_.events_accepted},
                     {"dropped", events_stats_.events_dropped},
                     {"batches_sent", events_stats_.batches_sent},
                     {"send_failures", events_stats_.send_failures},
                     {"loss_gaps", events_stats_.loss_gaps},
                     {"resyncs", events_stats_.resyncs},
                     {"resync_failures", events_resync_failures_},
                     {"exit_flushed", events_close_.flushed},
                     {"exit_drained", events_close_.drained},
                     {"unsent", events_close_.events_unsent},
                     {"maybe_discarded_at_exit", events_close_.events_maybe_discarded},
                     {"not_delivered", events_close_.not_delivered()}};
    }
    j["invariants_ok"] = r.invariants.ok;
    j["invariants"] = r.invariants.to_string();
    j["stopped_at_step"] = r.stopped_at_step;
    j["ok"] = r.ok();
    out << j.dump(2) << '\n';
  }

  TextFlag trace_, capacity_, block_size_, trace_block_tokens_, concurrency_, step_ms_,
      check_every_, host_tier_blocks_, tier_policy_, tier_inclusion_, host_link_gbps_, model_,
      memory_, hf_config_, context_, prefill_chunk_, checkpoint_interval_, events_, events_replay_,
      events_topic_, events_form_, disk_tier_blocks_, disk_dir_, disk_min_hits_, disk_io_,
      host_free_watermark_;
  disk::DiskStoreOptions disk_options_;
  std::size_t host_free_watermark_n_ = 0;
  std::string disk_description_;  // the store's I/O path and fallback, once opened
  disk::DiskStoreCounters disk_counters_;
  std::size_t disk_blocks_at_end_ = 0;
  events::PublisherStats events_stats_;
  events::CloseReport events_close_;
  std::uint64_t events_resync_failures_ = 0;  // resync() calls that could not rebuild the set
  std::string events_endpoint_;
  bool full_prefix_hits_ = false;
  bool separate_pools_ = false;
  CLI::App* app_ = nullptr;
  CLI::Option* progress_on_ = nullptr;
  CLI::Option* progress_off_ = nullptr;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_replay_command() {
  return std::make_unique<ReplayCommand>();
}

}  // namespace kvport::cli
