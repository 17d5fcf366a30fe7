// `kvport disagg`: the coordinator (disagg_command.cpp) starts prefill and
// decode worker processes of this same program (disagg_worker.cpp) and talks
// to each over one JSON object per line on its stdin/stdout. This header is
// what both sides share: the worker's spec and the message names.
//
// Coordinator -> worker (stdin):
//   {"op":"connect","decode":[["addr",...],...]}   prefill: connect to every
//                                                 decode rank, by instance
//   {"op":"baseline","bytes":N,"repeat":R}         decode: raw contiguous reads
//   {"op":"prefill","req":i,"decode":j,"tokens":[...]}   prefill rank
//   {"op":"recompute","req":i,"tokens":[...]}      any worker: compute locally
//   {"op":"finish"}                                 drain, report, exit
// Worker -> coordinator (stdout):
//   {"event":"ready","address":"127.0.0.1:p","transport":...,"memory_path":...}
//   {"event":"connected"}
//   {"event":"baseline","bytes":N,"seconds":[...]}
//   {"event":"lease_end","req":i,"end":"pulled|refused|expired|peer_lost|aborted"}
//   {"event":"prefill_failed","req":i,"why":...}   prefill could not lease it
//   {"event":"done","req":i,"ok":bool,"recomputed":bool,"blocks":n,"bytes":b,
//    "transfer_s":x,"latency_s":y,"wrong_bytes":w,"why":...}
//   {"event":"peer_lost","count":n}
//   {"event":"stats","leaked_blocks":n,"in_use":n,"invariants_ok":bool,...}
//   {"event":"fatal","why":...}
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

#include "kvport/core/kv_cache_config.hpp"

namespace kvport::cli::disagg {

/// Everything a worker process needs, passed as one JSON argument.
struct WorkerSpec {
  std::string role;  ///< "prefill" or "decode"
  std::uint32_t instance = 0;
  std::uint32_t rank = 0;
  std::uint32_t tp = 1;
  KvCacheConfig config;  ///< the model's: num_kv_heads is the total, sliced by tp
  std::size_t capacity_blocks = 0;
  std::chrono::milliseconds peer_timeout{1500};
  std::chrono::milliseconds lease_ttl{10000};
  std::size_t scratch_bytes = 0;
  std::string bind = "127.0.0.1";  ///< the address to listen on

  nlohmann::json to_json() const;
  /// Throws InvalidArgument naming a missing or bad field.
  static WorkerSpec from_json(const nlohmann::json& j);
};

/// Runs one worker until "finish" or its stdin closes. Writes events to
/// `out` (one JSON per line, flushed). Returns the process exit code.
int run_worker(const WorkerSpec& spec, std::ostream& out);

}  // namespace kvport::cli::disagg
