// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/mooncake_trace.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <istream>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/sim/file_error.hpp"
#include "kvport/sim/json_input.hpp"

namespace kvport::sim {

namespace {

using nlohmann::json;

// Only whitespace: a blank line, skipped.
bool is_blank(std::string_view line) noexcept {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
}

constexpr std::size_t kChunkBytes = 64 * 1024;
// The deepest nesting of a trace line.
constexpr std::size_t kMaxJsonDepth = 16;

// A JSON value quoted in a message, cut short: a line may be 1 MiB.
std::string quote_value(const json& value) {
  std::string text = value.dump();
  constexpr std::size_t kMax = 40;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
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
  // Keep only the four fields (extra ones may be large); a request is a flat
  // object, and extra fields may nest, but not without bound.
  JsonInputOptions input;
  const std::string prefix = fmt::format("{}:{}: ", name, line);
  input.prefix = prefix;
  input.malformed = "malformed JSON";
  input.max_depth = kMaxJsonDepth;
  input.keep_key = [](int depth, const std::string& key) {
    return depth != 1 || key == "timestamp" || key == "input_length" || key == "output_length" ||
           key == "hash_ids";
  };
  const json j = parse_json_input(text, input);
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
    if (fd_ < 0) throw cannot_read(errno_text(errno));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int error = errno;
      ::close(fd_);
      throw cannot_read(errno_text(error));
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
      if (errno != EINTR) throw cannot_read(errno_text(errno));
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
    if (is_blank(line)) continue;
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

}  // namespace kvport::sim
