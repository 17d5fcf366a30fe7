// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s protocol: the coordinator (disagg_coordinator.cpp) starts
// prefill and decode worker processes of this same program
// (disagg_worker.cpp) and talks to each over one JSON object per line on its
// stdin/stdout. This header is what both sides share: the roles, the worker's
// spec, and every op and event name and field, so that a name is spelled once
// and the table below is the one description of the messages.
//
// Coordinator -> worker (stdin), "op":
//   connect    {"decode":[["addr",...],...]}     prefill: connect to every
//                                                decode rank, by instance
//   baseline   {"bytes":N,"repeat":R}            decode: raw contiguous reads
//   prefill    {"req":i,"decode":j,"tokens":[...]}   prefill rank
//   recompute  {"req":i,"tokens":[...]}          any worker: compute locally
//   finish     {}                                drain, report, exit
// Worker -> coordinator (stdout), "event":
//   ready           {"address":"127.0.0.1:p","transport":...,"memory_path":...}
//   connected       {"lanes":...}
//   baseline        {"bytes":N,"seconds":[...],"why":...}
//   lease_end       {"req":i,"end":"pulled|refused|expired|peer_lost|aborted"}
//   prefill_failed  {"req":i,"why":...}          prefill could not lease it
//   done            {"req":i,"ok":bool,"recomputed":bool,"blocks":n,"bytes":b,
//                    "transfer_s":x,"latency_s":y,"wrong_bytes":w,"raw_bytes":r,
//                    "raw_s":z,"why":...}
//   peer_lost       {"peer":"decode0.1"}         one per peer this worker lost,
//                                                named as the coordinator names it
//   stats           {"leaked_blocks":n,"in_use":n,"invariants_ok":bool,...}
//   fatal           {"why":...,"listen":bool}    listen: could not listen at all
// A hybrid model's worker (run_hybrid_worker) has one agent per KV cache
// group: its "ready" address is the groups' addresses, comma-separated in
// group order, which "connect" carries unchanged; "done" adds "groups":
// [{"kind","bytes","wrong_bytes","checked_bytes","blocks","first_block"}]
// and "stats" adds "groups": [{"kind","in_use","cached","leaked_blocks",
// "invariants_ok"}].
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::cli::disagg {

/// What a worker process does.
enum class Role { prefill, decode };

/// "prefill" / "decode".
std::string_view to_string(Role role) noexcept;
/// The role named `name`, or nullopt.
std::optional<Role> parse_role(std::string_view name) noexcept;

/// A worker's name in messages and reports: "prefill0.1" (instance 0, rank 1).
std::string worker_name(Role role, std::uint32_t instance, std::uint32_t rank);

/// The "op" of each coordinator -> worker line.
namespace op {
inline constexpr std::string_view connect = "connect";
inline constexpr std::string_view baseline = "baseline";
inline constexpr std::string_view prefill = "prefill";
inline constexpr std::string_view recompute = "recompute";
inline constexpr std::string_view finish = "finish";
}  // namespace op

/// The "event" of each worker -> coordinator line.
namespace event {
inline constexpr std::string_view ready = "ready";
inline constexpr std::string_view connected = "connected";
inline constexpr std::string_view baseline = "baseline";
inline constexpr std::string_view lease_end = "lease_end";
inline constexpr std::string_view prefill_failed = "prefill_failed";
inline constexpr std::string_view done = "done";
inline constexpr std::string_view peer_lost = "peer_lost";
inline constexpr std::string_view stats = "stats";
inline constexpr std::string_view fatal = "fatal";
}  // namespace event

/// Field names used by more than one message.
namespace field {
inline constexpr const char* op = "op";
inline constexpr const char* event = "event";
inline constexpr const char* req = "req";
inline constexpr const char* tokens = "tokens";
inline constexpr const char* decode = "decode";
inline constexpr const char* peer = "peer";
inline constexpr const char* why = "why";
}  // namespace field

/// {"op": name}, to which the caller adds the op's fields.
nlohmann::json op_message(std::string_view name);
/// {"event": name}, to which the caller adds the event's fields.
nlohmann::json event_message(std::string_view name);

/// Everything a worker process needs, passed as one JSON argument.
struct WorkerSpec {
  Role role = Role::prefill;
  std::uint32_t instance = 0;
  std::uint32_t rank = 0;
  std::uint32_t tp = 1;
  KvCacheConfig config;  ///< the model's: num_kv_heads is the total, sliced by tp
  /// A hybrid (or MLA) model's layers, the model's heads (sliced by tp):
  /// the worker then runs a HybridKvCache with one agent per KV cache group
  /// (`config` gives only the block size and layout). Empty: one
  /// PagedKvCache of `config`.
  std::vector<LayerSpec> model_layers;
  std::size_t capacity_blocks = 0;
  /// Hybrid models: the slots of each state group (a state slot is one
  /// request's whole state, far larger than a block).
  std::size_t state_slots = 0;
  std::chrono::milliseconds peer_timeout{1500};
  std::chrono::milliseconds lease_ttl{10000};
  std::size_t scratch_bytes = 0;
  std::string bind = "127.0.0.1";  ///< the IPv4 address to listen on

  nlohmann::json to_json() const;
  /// Throws InvalidArgument naming a missing or bad field.
  static WorkerSpec from_json(const nlohmann::json& j);
};

/// A layer spec as the worker spec's JSON carries it, and back (throws
/// InvalidArgument naming a bad field; the spec is validated at
/// `block_size`).
nlohmann::json layer_spec_json(const LayerSpec& spec);
LayerSpec layer_spec_from_json(const nlohmann::json& j, std::size_t block_size);

/// The hybrid worker (WorkerSpec::model_layers not empty): as run_worker.
/// Its "ready" address is its groups' agents' addresses, comma-separated in
/// group order (the coordinator passes it on unchanged in "connect"); its
/// "done" and "stats" events add a "groups" array (per group: bytes,
/// wrong_bytes, blocks; leaked_blocks, in_use, cached).
int run_hybrid_worker(const WorkerSpec& spec, std::ostream& out);

/// Runs one worker until "finish" or its stdin closes. Writes events to
/// `out` (one JSON per line, flushed). Returns the process exit code.
int run_worker(const WorkerSpec& spec, std::ostream& out);

}  // namespace kvport::cli::disagg
