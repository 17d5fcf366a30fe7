#include "kvport/cli/replay.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <istream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;

constexpr std::size_t kChunkBytes = 64 * 1024;
// A request is a flat object; extra fields may nest, but not without bound.
constexpr int kMaxJsonDepth = 16;

// SplitMix64's finalizer: a bijection of 64-bit words that mixes every input
// bit into every output bit; the same on every platform.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58'476D'1CE4'E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D0'49BB'1331'11EBull;
  return z ^ (z >> 31);
}

// Seeds of the two token families, so that a hash id and a request index of
// the same value do not give the same tokens.
constexpr std::uint64_t kTraceSeed = 0x9E37'79B9'7F4A'7C15ull;
constexpr std::uint64_t kUniqueSeed = 0xD1B5'4A32'D192'ED03ull;

constexpr TokenId token_of(std::uint64_t base, std::size_t offset) noexcept {
  return static_cast<TokenId>(mix64(base + offset) >> 33);  // [0, 2^31)
}

// A JSON value quoted in a message, cut short: a line may be 1 MiB.
std::string quote_value(const json& value) {
  std::string text = value.dump();
  constexpr std::size_t kMax = 40;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

// nlohmann's messages start with "[json.exception.parse_error.101] parse
// error at line 1, " - the id and the line (always 1 here) say nothing.
std::string json_error_text(const json::exception& e) {
  std::string text = e.what();
  if (const auto close = text.find("] ");
      text.starts_with("[json.exception.") && close != std::string::npos) {
    text.erase(0, close + 2);
  }
  constexpr std::string_view kLineOne = "parse error at line 1, ";
  if (text.starts_with(kLineOne)) text.erase(0, kLineOne.size());
  // "last read: '...'" quotes the token, which may be most of a 1 MiB line.
  constexpr std::size_t kMax = 200;
  if (text.size() > kMax) {
    std::size_t cut = kMax;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80)
      --cut;  // not inside a UTF-8 sequence
    text = text.substr(0, cut) + "...";
  }
  return text;
}

class LineError {
 public:
  LineError(const std::string& name, std::size_t line) : name_(name), line_(line) {}
  InvalidArgument operator()(std::string_view what) const {
    return InvalidArgument(fmt::format("{}:{}: {}", name_, line_, what));
  }

 private:
  const std::string& name_;
  std::size_t line_;
};

const json& field(const json& object, const char* key, const LineError& error) {
  const auto it = object.find(key);
  if (it == object.end()) throw error(fmt::format("missing field '{}'", key));
  return *it;
}

std::size_t length_field(const json& object, const char* key, const LineError& error) {
  const json& value = field(object, key, error);
  if (!value.is_number_unsigned()) {
    throw error(
        fmt::format("'{}' must be a non-negative integer, got {}", key, quote_value(value)));
  }
  const auto n = value.get<std::uint64_t>();
  if (n > kMaxRequestTokens) {
    throw error(fmt::format("'{}' {} exceeds the limit of {} tokens per request", key, n,
                            kMaxRequestTokens));
  }
  return static_cast<std::size_t>(n);
}

TraceRequest parse_line(std::string_view text, const std::string& name, std::size_t line) {
  const LineError error(name, line);
  // Keep only the four fields (extra ones may be large), and refuse absurd
  // nesting: the parser is iterative, but the DOM costs memory per level.
  const json::parser_callback_t keep_fields = [&](int depth, json::parse_event_t event,
                                                  json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) {
          throw error(fmt::format("JSON nested deeper than {} levels", kMaxJsonDepth));
        }
        return true;
      case json::parse_event_t::key:
        if (depth == 1) {
          const auto& key = parsed.get_ref<const std::string&>();
          return key == "timestamp" || key == "input_length" || key == "output_length" ||
                 key == "hash_ids";
        }
        return true;
      default:
        return true;
    }
  };
  json j;
  try {
    j = json::parse(text, keep_fields);
  } catch (const json::exception& e) {
    throw error("malformed JSON: " + json_error_text(e));
  }
  if (!j.is_object()) {
    throw error(fmt::format("expected a JSON object, got {}", quote_value(j)));
  }
  TraceRequest request;
  request.line = line;

  const json& timestamp = field(j, "timestamp", error);
  if (!timestamp.is_number()) {
    throw error(fmt::format("'timestamp' must be a number of milliseconds, got {}",
                            quote_value(timestamp)));
  }
  request.timestamp_ms = timestamp.get<double>();
  if (!(request.timestamp_ms >= 0.0) || !std::isfinite(request.timestamp_ms)) {
    throw error(fmt::format("'timestamp' must be >= 0, got {}", quote_value(timestamp)));
  }

  request.input_length = length_field(j, "input_length", error);
  if (request.input_length == 0) throw error("'input_length' must be at least 1, got 0");
  request.output_length = length_field(j, "output_length", error);
  if (request.input_length + request.output_length > kMaxRequestTokens) {
    throw error(
        fmt::format("input_length + output_length = {} exceeds the limit of {} tokens per request",
                    request.input_length + request.output_length, kMaxRequestTokens));
  }

  const json& ids = field(j, "hash_ids", error);
  if (!ids.is_array()) {
    throw error(fmt::format("'hash_ids' must be an array of non-negative integers, got {}",
                            quote_value(ids)));
  }
  request.hash_ids.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (!ids[i].is_number_unsigned()) {
      throw error(fmt::format("'hash_ids'[{}] must be a non-negative integer, got {}", i,
                              quote_value(ids[i])));
    }
    request.hash_ids.push_back(ids[i].get<std::uint64_t>());
  }
  return request;
}

}  // namespace

// ---- reading ---------------------------------------------------------------------------

namespace {

// Where the reader's bytes come from.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to `size` bytes into `data`; 0 at the end.
  virtual std::size_t read(char* data, std::size_t size) = 0;
};

class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path) : path_(path) {
    // O_NONBLOCK: opening a FIFO without a writer must not wait forever; it is
    // cleared below so that a pipe is read to its end.
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) throw cannot_read(text::errno_text(errno));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int error = errno;
      ::close(fd_);
      throw cannot_read(text::errno_text(error));
    }
    if (S_ISDIR(info.st_mode)) {
      ::close(fd_);
      throw cannot_read("is a directory (pass a .jsonl trace file)");
    }
    if (const int flags = ::fcntl(fd_, F_GETFL); flags >= 0) {
      (void)::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
    }
  }
  ~FileSource() override { ::close(fd_); }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  std::size_t read(char* data, std::size_t size) override {
    for (;;) {
      const ::ssize_t n = ::read(fd_, data, size);
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno != EINTR) throw cannot_read(text::errno_text(errno));
    }
  }

 private:
  InvalidArgument cannot_read(const std::string& why) const {
    return InvalidArgument(fmt::format("cannot read trace '{}': {}", path_, why));
  }

  std::string path_;
  int fd_ = -1;
};

class StreamSource final : public ByteSource {
 public:
  StreamSource(std::istream& in, const std::string& name) : in_(in), name_(name) {}

  std::size_t read(char* data, std::size_t size) override {
    if (!in_.good()) return 0;
    in_.read(data, static_cast<std::streamsize>(size));
    if (in_.bad()) throw InvalidArgument(fmt::format("cannot read trace '{}'", name_));
    return static_cast<std::size_t>(in_.gcount());
  }

 private:
  std::istream& in_;
  std::string name_;
};

}  // namespace

struct MooncakeTraceReader::Source {
  explicit Source(std::unique_ptr<ByteSource> source) : bytes(std::move(source)) {}

  std::unique_ptr<ByteSource> bytes;
  std::vector<char> buffer = std::vector<char>(kChunkBytes);
  std::size_t begin = 0;  // unread bytes of buffer: [begin, end)
  std::size_t end = 0;
  bool at_end = false;
  std::string line;  // the line being assembled; its capacity is reused
};

MooncakeTraceReader::MooncakeTraceReader(const std::string& path)
    : source_(std::make_unique<Source>(std::make_unique<FileSource>(path))), name_(path) {}

MooncakeTraceReader::MooncakeTraceReader(std::istream& in, std::string name)
    : source_(std::make_unique<Source>(std::make_unique<StreamSource>(in, name))),
      name_(std::move(name)) {}

MooncakeTraceReader::~MooncakeTraceReader() = default;

const std::string& MooncakeTraceReader::name() const noexcept {
  return name_;
}

bool MooncakeTraceReader::next_line(std::string& line) {
  Source& s = *source_;
  line.clear();
  bool any = false;  // a last line without a newline still counts
  for (;;) {
    if (s.begin == s.end) {
      if (s.at_end) break;
      const std::size_t n = s.bytes->read(s.buffer.data(), s.buffer.size());
      if (n == 0) {
        s.at_end = true;
        break;
      }
      s.begin = 0;
      s.end = n;
    }
    any = true;
    const char* start = s.buffer.data() + s.begin;
    const std::size_t available = s.end - s.begin;
    const auto* newline = static_cast<const char*>(std::memchr(start, '\n', available));
    const std::size_t take =
        newline != nullptr ? static_cast<std::size_t>(newline - start) : available;
    if (line.size() + take > kMaxTraceLineBytes) {
      throw InvalidArgument(fmt::format("{}:{}: line longer than {} bytes (1 MiB)", name_,
                                        line_number_ + 1, kMaxTraceLineBytes));
    }
    line.append(start, take);
    s.begin += take;
    if (newline != nullptr) {
      ++s.begin;
      break;
    }
  }
  if (!any) return false;
  ++line_number_;
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return true;
}

std::optional<TraceRequest> MooncakeTraceReader::next() {
  std::string& line = source_->line;
  while (next_line(line)) {
    if (text::trim(line).empty()) continue;
    return parse_line(line, name_, line_number_);
  }
  return std::nullopt;
}

namespace {

std::vector<TraceRequest> read_all(MooncakeTraceReader& reader) {
  std::vector<TraceRequest> requests;
  while (std::optional<TraceRequest> request = reader.next())
    requests.push_back(std::move(*request));
  if (requests.empty()) {
    throw InvalidArgument(fmt::format("trace '{}': no requests", reader.name()));
  }
  return requests;
}

}  // namespace

std::vector<TraceRequest> read_mooncake_trace(const std::string& path) {
  MooncakeTraceReader reader(path);
  return read_all(reader);
}

std::vector<TraceRequest> read_mooncake_trace(std::istream& in, const std::string& name) {
  MooncakeTraceReader reader(in, name);
  return read_all(reader);
}

// ---- tokens ------------------------------------------------------------------------------

TokenId trace_token(std::uint64_t hash_id, std::size_t offset) noexcept {
  return token_of(mix64(hash_id ^ kTraceSeed), offset);
}

TokenId unique_token(std::size_t request_index, std::size_t position) noexcept {
  return token_of(mix64(static_cast<std::uint64_t>(request_index) ^ kUniqueSeed), position);
}

void sequence_tokens(const TraceRequest& request, std::size_t request_index,
                     std::size_t trace_block_tokens, std::size_t count, std::vector<TokenId>& out) {
  out.resize(count);
  const std::size_t prompt = std::min(count, request.input_length);
  std::size_t pos = 0;
  // Whole trace blocks first: one mixed base per hash id.
  for (std::size_t b = 0; b < request.hash_ids.size() && pos < prompt; ++b) {
    const std::uint64_t base = mix64(request.hash_ids[b] ^ kTraceSeed);
    const std::size_t end = std::min(prompt, pos + trace_block_tokens);
    for (std::size_t offset = 0; pos < end; ++pos, ++offset)
      out[pos] = token_of(base, offset);
  }
  const std::uint64_t base = mix64(static_cast<std::uint64_t>(request_index) ^ kUniqueSeed);
  for (; pos < count; ++pos)
    out[pos] = token_of(base, pos);
}

// ---- options -----------------------------------------------------------------------------

void ReplayOptions::validate() const {
  if (capacity_blocks == 0 || capacity_blocks > kMaxCapacityBlocks) {
    throw InvalidArgument(fmt::format("--capacity-blocks: must be in [1, {}], got {}",
                                      kMaxCapacityBlocks, capacity_blocks));
  }
  if (block_size == 0 || block_size > kMaxBlockSize) {
    throw InvalidArgument(
        fmt::format("--block-size: must be in [1, {}], got {}", kMaxBlockSize, block_size));
  }
  if (capacity_blocks > kMaxCapacityTokens / block_size) {
    throw InvalidArgument(
        fmt::format("--capacity-blocks {} x --block-size {} is more than {} tokens of cache",
                    capacity_blocks, block_size, kMaxCapacityTokens));
  }
  if (trace_block_tokens == 0) throw InvalidArgument("--trace-block-tokens: must be positive");
  if (concurrency == 0) throw InvalidArgument("--concurrency: must be positive");
  if (step_ms == 0) throw InvalidArgument("--step-ms: must be positive");
}

// ---- simulation --------------------------------------------------------------------------

namespace {

std::size_t div_ceil(std::size_t a, std::size_t b) noexcept {
  return a / b + (a % b != 0);
}

class Replay {
 public:
  Replay(std::span<const TraceRequest> requests, const ReplayOptions& options, PrefixCache& prefix,
         StreamView stream)
      : requests_(requests),
        options_(options),
        prefix_(prefix),
        stream_(stream),
        bs_(options.block_size),
        state_(requests.size()) {}

  ReplayResult run() {
    const auto start = std::chrono::steady_clock::now();
    result_.requests = requests_.size();
    std::vector<std::size_t> order(requests_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return requests_[a].timestamp_ms < requests_[b].timestamp_ms;
    });
    const double first_arrival = requests_[order.front()].timestamp_ms;
    now_ = first_arrival;
    last_finish_ = first_arrival;

    std::size_t next = 0;
    while (finished_ < requests_.size()) {
      for (; next < order.size() && requests_[order[next]].timestamp_ms <= now_; ++next)
        arrive(order[next]);
      if (running_.empty() && waiting_.empty()) {
        if (next == order.size()) throw std::logic_error("kvport replay: requests lost (a bug)");
        now_ = requests_[order[next]].timestamp_ms;  // idle: jump to the next arrival
        continue;
      }
      const bool preempted = decode();
      complete();
      if (!preempted) admit();  // as vLLM: nothing is admitted in a step that preempted
      if (running_.empty() && !waiting_.empty()) {
        throw std::logic_error(fmt::format(
            "kvport replay: request on line {} cannot be admitted into an empty cache (a bug)",
            requests_[waiting_.front()].line));
      }
      ++result_.steps;
      now_ += static_cast<double>(options_.step_ms);
      if (options_.check_every != 0 && result_.steps % options_.check_every == 0) {
        InvariantReport report = prefix_.check_invariants();
        if (!report.ok) {
          result_.invariants = std::move(report);
          result_.stopped_at_step = result_.steps;
          break;
        }
      }
    }
    running_.clear();  // only left after a failed periodic check
    prefix_.kv_cache().backend().synchronize(stream_);
    result_.wall_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    const PrefixCacheCounters& counters = prefix_.counters();
    result_.lookups = counters.lookups;
    result_.evictions = counters.evictions;
    result_.cache_inserts = counters.inserts;
    result_.allocations = prefix_.kv_cache().counters().allocs;
    result_.cached_blocks_at_end = prefix_.num_cached_blocks();
    result_.simulated_ms = last_finish_ - first_arrival;
    if (admitted_ != 0) result_.mean_queue_ms = queue_ms_sum_ / static_cast<double>(admitted_);
    if (result_.stopped_at_step == 0) {
      result_.invariants = prefix_.check_invariants();
      if (result_.invariants.blocks_in_use != 0) {
        result_.invariants.add_violation(
            fmt::format("{} blocks are still in use after the last request finished",
                        result_.invariants.blocks_in_use));
      }
    }
    return std::move(result_);
  }

 private:
  struct RequestState {
    std::size_t generated = 0;
    bool admitted = false;  // admitted at least once
  };

  struct Running {
    std::size_t index;
    BlockTable table;
  };

  void finished(double at) {
    ++finished_;
    last_finish_ = std::max(last_finish_, at);
    if (options_.progress) options_.progress(finished_, requests_.size());
  }

  void arrive(std::size_t index) {
    const TraceRequest& r = requests_[index];
    // Alone in an empty cache it would still run out of blocks, and preempting
    // itself would only start it over.
    if (div_ceil(r.input_length + r.output_length, bs_) > options_.capacity_blocks) {
      ++result_.rejected;
      finished(r.timestamp_ms);
      return;
    }
    waiting_.push_back(index);
  }

  void track_peak() {
    const std::size_t in_use = options_.capacity_blocks - prefix_.num_available_blocks();
    result_.peak_blocks_in_use = std::max(result_.peak_blocks_in_use, in_use);
  }

  void release(Running& r) {
    result_.releases += r.table.num_blocks();
    r.table.release();  // last block first: the prefix stays cached longest
    blocked_ = false;
  }

  // The most recently admitted request gives its blocks back (its full blocks
  // stay cached) and goes to the front of the queue, to prefill again.
  void preempt_newest() {
    Running& victim = running_.back();
    release(victim);
    waiting_.push_front(victim.index);
    running_.pop_back();
    ++result_.preemptions;
  }

  // Every running request generates one token, oldest first. A token that
  // starts a new block needs one; when none is free or evictable, the newest
  // running request is preempted until one is (possibly the request itself).
  // Returns whether anything was preempted.
  bool decode() {
    bool preempted = false;
    for (std::size_t i = 0; i < running_.size(); ++i) {
      Running& r = running_[i];
      while (i < running_.size() && r.table.blocks_needed(1) > prefix_.num_available_blocks()) {
        preempt_newest();
        preempted = true;
      }
      if (i == running_.size()) break;  // it preempted itself
      const TokenId token = unique_token(r.index, r.table.num_tokens());
      r.table.append_tokens({&token, 1}, stream_);       // a full block is registered in the cache
      if (r.table.last_block_fill() == 1) track_peak();  // took a new block
      ++state_[r.index].generated;
      ++result_.generated_tokens;
    }
    return preempted;
  }

  void complete() {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < running_.size(); ++i) {
      Running& r = running_[i];
      if (state_[r.index].generated == requests_[r.index].output_length) {
        release(r);
        ++result_.completed;
        finished(now_ + static_cast<double>(options_.step_ms));
      } else {
        if (kept != i) running_[kept] = std::move(r);
        ++kept;
      }
    }
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(kept), running_.end());
  }

  // FIFO: the head of the queue reuses its cached prefix and prefills the
  // rest, or, when the blocks for it are not available, gives the prefix back
  // and waits. It is tried again only after some blocks were released.
  void admit() {
    while (!waiting_.empty() && !blocked_ && running_.size() < options_.concurrency) {
      const std::size_t index = waiting_.front();
      const TraceRequest& request = requests_[index];
      RequestState& state = state_[index];
      const std::size_t context = request.input_length + state.generated;
      sequence_tokens(request, index, options_.trace_block_tokens, context, scratch_);
      BlockTable table(prefix_);
      const std::size_t hit = table.reuse_cached_prefix(scratch_);
      const std::span<const TokenId> rest = std::span<const TokenId>(scratch_).subspan(hit);
      if (table.blocks_needed(rest.size()) > prefix_.num_available_blocks()) {
        result_.releases += table.num_blocks();
        table.release();
        blocked_ = true;
        return;
      }
      table.append_tokens(rest, stream_);
      waiting_.pop_front();
      track_peak();
      if (!state.admitted) {
        state.admitted = true;
        ++admitted_;
        result_.prompt_blocks += request.input_length / bs_;
        result_.hit_blocks += hit / bs_;
        result_.prompt_tokens += request.input_length;
        result_.hit_tokens += hit;
        const double queued = now_ - request.timestamp_ms;
        queue_ms_sum_ += queued;
        result_.max_queue_ms = std::max(result_.max_queue_ms, queued);
      } else {
        result_.recomputed_tokens += rest.size();
      }
      result_.prefill_tokens += rest.size();
      running_.push_back(Running{index, std::move(table)});
      if (state.generated == request.output_length) {  // nothing to generate
        release(running_.back());
        running_.pop_back();
        ++result_.completed;
        finished(now_ + static_cast<double>(options_.step_ms));
      }
    }
  }

  std::span<const TraceRequest> requests_;
  const ReplayOptions& options_;
  PrefixCache& prefix_;
  StreamView stream_;
  std::size_t bs_;
  std::vector<RequestState> state_;
  std::deque<std::size_t> waiting_;
  std::vector<Running> running_;  // in admission order: newest last
  bool blocked_ = false;          // the head of the queue waits for blocks
  double now_ = 0.0;
  double last_finish_ = 0.0;
  double queue_ms_sum_ = 0.0;
  std::size_t finished_ = 0;
  std::size_t admitted_ = 0;  // requests admitted at least once
  std::vector<TokenId> scratch_;
  ReplayResult result_;
};

}  // namespace

ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options,
                        Backend& backend) {
  options.validate();
  if (requests.empty()) throw InvalidArgument("kvport replay: no requests");
  for (const TraceRequest& r : requests) {
    if (r.input_length == 0 || r.input_length > kMaxRequestTokens ||
        r.output_length > kMaxRequestTokens - r.input_length) {
      throw InvalidArgument(fmt::format(
          "request of line {}: input_length {} and output_length {} must be >= 1 and together "
          "at most {}",
          r.line, r.input_length, r.output_length, kMaxRequestTokens));
    }
  }
  // The smallest cache: only the block bookkeeping matters, not the data.
  KvCacheConfig config;
  config.num_layers = 1;
  config.num_kv_heads = 1;
  config.head_dim_k = config.head_dim_v = 1;
  config.dtype = KvCacheDtype::f16;
  config.block_size = options.block_size;
  PagedKvCacheOptions cache_options;
  cache_options.trace = false;  // 16 history entries per block would dwarf the simulation
  PagedKvCache cache(config, options.capacity_blocks, backend, cache_options);
  PrefixCache prefix(cache);
  const Stream stream = backend.create_stream();
  Replay replay(requests, options, prefix, stream);
  return replay.run();
}

ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options) {
  options.validate();
  const std::unique_ptr<Backend> backend = make_host_backend();
  return run_replay(requests, options, *backend);
}

}  // namespace kvport::cli
