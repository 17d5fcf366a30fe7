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
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "kvport/core/kv_cache_config.hpp"

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
  std::size_t capacity_blocks = 0;
  std::chrono::milliseconds peer_timeout{1500};
  std::chrono::milliseconds lease_ttl{10000};
  std::size_t scratch_bytes = 0;
  std::string bind = "127.0.0.1";  ///< the IPv4 address to listen on

  nlohmann::json to_json() const;
  /// Throws InvalidArgument naming a missing or bad field.
  static WorkerSpec from_json(const nlohmann::json& j);
};

/// Runs one worker until "finish" or its stdin closes. Writes events to
/// `out` (one JSON per line, flushed). Returns the process exit code.
int run_worker(const WorkerSpec& spec, std::ostream& out);

}  // namespace kvport::cli::disagg
