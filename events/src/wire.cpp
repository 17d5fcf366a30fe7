// SPDX-License-Identifier: Apache-2.0
#include "kvport/events/wire.hpp"

#include <bit>
#include <cstring>
#include <limits>
#include <type_traits>

#define MSGPACK_NO_BOOST 1
#include <msgpack/pack.hpp>

namespace kvport::events {
namespace {

// msgpack-cxx's packer writes through any buffer with write(const char*, n).
struct StringBuffer {
  std::string& out;
  void write(const char* data, std::size_t size) { out.append(data, size); }
};
using Packer = msgpack::packer<StringBuffer>;

void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}
template <class T>
void pack_opt_uint(Packer& pk, const std::optional<T>& v) {
  if (v) {
    pk.pack_uint64(*v);
  } else {
    pk.pack_nil();
  }
}
void pack_opt_str(Packer& pk, const std::optional<std::string>& v) {
  if (v) {
    pack_str(pk, *v);
  } else {
    pk.pack_nil();
  }
}
void pack_hashes(Packer& pk, const std::vector<std::uint64_t>& hashes) {
  pk.pack_array(static_cast<std::uint32_t>(hashes.size()));
  for (std::uint64_t h : hashes)
    pk.pack_uint64(h);
}

void pack_event(Packer& pk, const BlockStored& e, EventForm form) {
  const bool map = form == EventForm::map;
  if (map) {
    pk.pack_map(12);
    pack_str(pk, "type");
  } else {
    pk.pack_array(12);
  }
  pack_str(pk, "BlockStored");
  if (map) pack_str(pk, "block_hashes");
  pack_hashes(pk, e.block_hashes);
  if (map) pack_str(pk, "parent_block_hash");
  pack_opt_uint(pk, e.parent_block_hash);
  if (map) pack_str(pk, "token_ids");
  pk.pack_array(static_cast<std::uint32_t>(e.token_ids.size()));
  for (TokenId t : e.token_ids)
    pk.pack_uint32(t);
  if (map) pack_str(pk, "block_size");
  pk.pack_uint32(e.block_size);
  if (map) pack_str(pk, "lora_id");
  pk.pack_nil();
  if (map) pack_str(pk, "medium");
  pack_str(pk, e.medium);
  if (map) pack_str(pk, "lora_name");
  pack_opt_str(pk, e.lora_name);
  if (map) pack_str(pk, "extra_keys");
  pk.pack_nil();
  if (map) pack_str(pk, "group_idx");
  pack_opt_uint(pk, e.group_idx);
  if (map) pack_str(pk, "kv_cache_spec_kind");
  pack_opt_str(pk, e.kv_cache_spec_kind);
  if (map) pack_str(pk, "kv_cache_spec_sliding_window");
  pack_opt_uint(pk, e.kv_cache_spec_sliding_window);
}

void pack_event(Packer& pk, const BlockRemoved& e, EventForm form) {
  if (form == EventForm::map) {
    pk.pack_map(4);
    pack_str(pk, "type");
    pack_str(pk, "BlockRemoved");
    pack_str(pk, "block_hashes");
    pack_hashes(pk, e.block_hashes);
    pack_str(pk, "medium");
    pack_str(pk, e.medium);
    pack_str(pk, "group_idx");
    pack_opt_uint(pk, e.group_idx);
  } else {
    pk.pack_array(4);
    pack_str(pk, "BlockRemoved");
    pack_hashes(pk, e.block_hashes);
    pack_str(pk, e.medium);
    pack_opt_uint(pk, e.group_idx);
  }
}

void pack_event(Packer& pk, const AllBlocksCleared& e, EventForm form) {
  const bool scoped = e.medium || e.group_idx;
  if (form == EventForm::map) {
    pk.pack_map(1 + (e.medium ? 1 : 0) + (e.group_idx ? 1 : 0));
    pack_str(pk, "type");
    pack_str(pk, "AllBlocksCleared");
    if (e.medium) {
      pack_str(pk, "medium");
      pack_str(pk, *e.medium);
    }
    if (e.group_idx) {
      pack_str(pk, "group_idx");
      pk.pack_uint32(*e.group_idx);
    }
  } else {
    pk.pack_array(scoped ? 3 : 1);
    pack_str(pk, "AllBlocksCleared");
    if (scoped) {
      pack_opt_str(pk, e.medium);
      pack_opt_uint(pk, e.group_idx);
    }
  }
}

// ---- decoding -----------------------------------------------------------------

constexpr int max_depth = 32;

enum class Kind { nil, boolean, uint, sint, f64, str, bin, array, map, ext, invalid };

struct Value {
  Kind kind = Kind::invalid;
  std::uint64_t u = 0;  // uint value, sint bits, length of str/bin/array/map/ext
  std::int64_t i = 0;
  double d = 0;
  std::string_view bytes;  // str and bin bodies
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::nil:
      return "nil";
    case Kind::boolean:
      return "a bool";
    case Kind::uint:
    case Kind::sint:
      return "an integer";
    case Kind::f64:
      return "a float";
    case Kind::str:
      return "a string";
    case Kind::bin:
      return "bytes";
    case Kind::array:
      return "an array";
    case Kind::map:
      return "a map";
    case Kind::ext:
      return "an ext";
    case Kind::invalid:
      break;
  }
  return "an invalid byte";
}

// A cursor over the payload; every read checks the remaining length first.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}

  bool at_end() const noexcept { return pos_ == in_.size(); }
  std::size_t remaining() const noexcept { return in_.size() - pos_; }
  const std::string& error() const noexcept { return error_; }
  bool failed() const noexcept { return !error_.empty(); }
  void fail(std::string what) {
    if (error_.empty()) error_ = context_ + what;
  }
  void set_context(std::string c) { context_ = std::move(c); }

  // Reads one header (and the body of scalars); containers' elements follow.
  bool next(Value& v) {
    if (failed()) return false;
    if (pos_ >= in_.size()) return truncated();
    const auto b = static_cast<std::uint8_t>(in_[pos_++]);
    v = Value{};
    if (b <= 0x7f) return set_uint(v, b);
    if (b >= 0xe0) return set_sint(v, static_cast<std::int8_t>(b));
    if ((b & 0xf0) == 0x80) return container(v, Kind::map, b & 0x0f);
    if ((b & 0xf0) == 0x90) return container(v, Kind::array, b & 0x0f);
    if ((b & 0xe0) == 0xa0) return body(v, Kind::str, b & 0x1f);
    std::uint64_t n = 0;
    switch (b) {
      case 0xc0:
        v.kind = Kind::nil;
        return true;
      case 0xc2:
      case 0xc3:
        v.kind = Kind::boolean;
        v.u = b & 1;
        return true;
      case 0xc4:
        return be(1, n) && body(v, Kind::bin, n);
      case 0xc5:
        return be(2, n) && body(v, Kind::bin, n);
      case 0xc6:
        return be(4, n) && body(v, Kind::bin, n);
      case 0xc7:
        return be(1, n) && ext(v, n);
      case 0xc8:
        return be(2, n) && ext(v, n);
      case 0xc9:
        return be(4, n) && ext(v, n);
      case 0xca: {
        if (!be(4, n)) return false;
        v.kind = Kind::f64;
        v.d = std::bit_cast<float>(static_cast<std::uint32_t>(n));
        return true;
      }
      case 0xcb: {
        if (!be(8, n)) return false;
        v.kind = Kind::f64;
        v.d = std::bit_cast<double>(n);
        return true;
      }
      case 0xcc:
        return be(1, n) && set_uint(v, n);
      case 0xcd:
        return be(2, n) && set_uint(v, n);
      case 0xce:
        return be(4, n) && set_uint(v, n);
      case 0xcf:
        return be(8, n) && set_uint(v, n);
      case 0xd0:
        return be(1, n) && set_sint(v, static_cast<std::int8_t>(n));
      case 0xd1:
        return be(2, n) && set_sint(v, static_cast<std::int16_t>(n));
      case 0xd2:
        return be(4, n) && set_sint(v, static_cast<std::int32_t>(n));
      case 0xd3:
        return be(8, n) && set_sint(v, static_cast<std::int64_t>(n));
      case 0xd4:
        return ext(v, 1);
      case 0xd5:
        return ext(v, 2);
      case 0xd6:
        return ext(v, 4);
      case 0xd7:
        return ext(v, 8);
      case 0xd8:
        return ext(v, 16);
      case 0xd9:
        return be(1, n) && body(v, Kind::str, n);
      case 0xda:
        return be(2, n) && body(v, Kind::str, n);
      case 0xdb:
        return be(4, n) && body(v, Kind::str, n);
      case 0xdc:
        return be(2, n) && container(v, Kind::array, n);
      case 0xdd:
        return be(4, n) && container(v, Kind::array, n);
      case 0xde:
        return be(2, n) && container(v, Kind::map, n);
      case 0xdf:
        return be(4, n) && container(v, Kind::map, n);
      default:
        fail("invalid msgpack byte 0xc1");
        return false;
    }
  }

  // Skips one whole value (with its elements), bounded in depth.
  bool skip(int depth = 0) {
    Value v;
    if (!next(v)) return false;
    return skip_body(v, depth);
  }
  bool skip_body(const Value& v, int depth) {
    if (v.kind != Kind::array && v.kind != Kind::map) return true;
    if (depth >= max_depth) {
      fail("nested deeper than 32");
      return false;
    }
    const std::uint64_t n = v.kind == Kind::map ? v.u * 2 : v.u;
    for (std::uint64_t k = 0; k < n; ++k) {
      if (!skip(depth + 1)) return false;
    }
    return true;
  }

 private:
  bool truncated() {
    fail("truncated input");
    return false;
  }
  bool be(int bytes, std::uint64_t& n) {
    if (remaining() < static_cast<std::size_t>(bytes)) return truncated();
    n = 0;
    for (int k = 0; k < bytes; ++k)
      n = (n << 8) | static_cast<std::uint8_t>(in_[pos_++]);
    return true;
  }
  static bool set_uint(Value& v, std::uint64_t n) {
    v.kind = Kind::uint;
    v.u = n;
    return true;
  }
  static bool set_sint(Value& v, std::int64_t n) {
    v.kind = Kind::sint;
    v.i = n;
    v.u = static_cast<std::uint64_t>(n);
    return true;
  }
  bool body(Value& v, Kind kind, std::uint64_t n) {
    if (n > remaining()) return truncated();
    v.kind = kind;
    v.u = n;
    v.bytes = in_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool ext(Value& v, std::uint64_t n) {
    if (n + 1 > remaining()) return truncated();
    v.kind = Kind::ext;
    v.u = n;
    pos_ += n + 1;
    return true;
  }
  bool container(Value& v, Kind kind, std::uint64_t n) {
    // Every element takes at least one byte (two per map entry): a length
    // beyond what is left is a lie, refused before anything is reserved.
    const std::uint64_t min_bytes = kind == Kind::map ? n * 2 : n;
    if (min_bytes > remaining()) {
      fail("length " + std::to_string(n) + " exceeds the " + std::to_string(remaining()) +
           " bytes left");
      return false;
    }
    v.kind = kind;
    v.u = n;
    return true;
  }

  std::string_view in_;
  std::size_t pos_ = 0;
  std::string error_;
  std::string context_;
};

bool expect(Reader& r, const Value& v, Kind kind, std::string_view field) {
  if (v.kind == kind) return true;
  r.fail(std::string(field) + ": expected " + kind_name(kind) + ", got " + kind_name(v.kind));
  return false;
}

bool read_u64(Reader& r, std::string_view field, std::uint64_t& out) {
  Value v;
  if (!r.next(v)) return false;
  // Python ints above 2^63 arrive as uint64; a negative int64 is taken as
  // its two's complement bits (a hash published signed).
  if (v.kind == Kind::uint || v.kind == Kind::sint) {
    out = v.u;
    return true;
  }
  r.fail(std::string(field) + ": expected an integer, got " + kind_name(v.kind));
  r.skip_body(v, 0);
  return false;
}

bool read_u32(Reader& r, std::string_view field, std::uint32_t& out) {
  Value v;
  if (!r.next(v)) return false;
  if (v.kind == Kind::uint && v.u <= std::numeric_limits<std::uint32_t>::max()) {
    out = static_cast<std::uint32_t>(v.u);
    return true;
  }
  r.fail(std::string(field) +
         (v.kind == Kind::uint || v.kind == Kind::sint
              ? ": integer out of range"
              : std::string(": expected an integer, got ") + kind_name(v.kind)));
  return false;
}

template <class T>
bool read_opt_uint(Reader& r, std::string_view field, std::optional<T>& out) {
  Value v;
  if (!r.next(v)) return false;
  if (v.kind == Kind::nil) {
    out.reset();
    return true;
  }
  if (v.kind == Kind::uint && v.u <= std::numeric_limits<T>::max()) {
    out = static_cast<T>(v.u);
    return true;
  }
  if (std::is_same_v<T, std::uint64_t> && v.kind == Kind::sint) {
    out = static_cast<T>(v.u);
    return true;
  }
  r.fail(std::string(field) + ": expected an integer or nil, got " + kind_name(v.kind));
  return false;
}

bool read_opt_str(Reader& r, std::string_view field, std::optional<std::string>& out) {
  Value v;
  if (!r.next(v)) return false;
  if (v.kind == Kind::nil) {
    out.reset();
    return true;
  }
  if (!expect(r, v, Kind::str, field)) return false;
  out.emplace(v.bytes);
  return true;
}

// medium: a string, or nil (older vLLM) read as "GPU".
bool read_medium(Reader& r, std::string& out) {
  std::optional<std::string> m;
  if (!read_opt_str(r, "medium", m)) return false;
  out = m ? std::move(*m) : std::string("GPU");
  return true;
}

template <class T, class ReadOne>
bool read_array(Reader& r, std::string_view field, std::vector<T>& out, ReadOne read_one) {
  Value v;
  if (!r.next(v) || !expect(r, v, Kind::array, field)) return false;
  out.clear();
  out.reserve(v.u);  // bounded by the bytes left (Reader::container)
  for (std::uint64_t k = 0; k < v.u; ++k) {
    T x{};
    if (!read_one(x)) return false;
    out.push_back(x);
  }
  return true;
}

bool read_hashes(Reader& r, std::vector<std::uint64_t>& out) {
  return read_array(r, "block_hashes", out,
                    [&](std::uint64_t& h) { return read_u64(r, "block_hashes", h); });
}
bool read_tokens(Reader& r, std::vector<TokenId>& out) {
  return read_array(r, "token_ids", out, [&](TokenId& t) { return read_u32(r, "token_ids", t); });
}

enum class Type { stored, removed, cleared, unknown };
Type type_of(std::string_view tag) {
  if (tag == "BlockStored") return Type::stored;
  if (tag == "BlockRemoved") return Type::removed;
  if (tag == "AllBlocksCleared") return Type::cleared;
  return Type::unknown;
}

// One field of an event, by name (map form) or position (array form).
bool read_field(Reader& r, CacheEvent& ev, std::string_view name) {
  if (auto* s = std::get_if<BlockStored>(&ev)) {
    if (name == "block_hashes") return read_hashes(r, s->block_hashes);
    if (name == "parent_block_hash") return read_opt_uint(r, name, s->parent_block_hash);
    if (name == "token_ids") return read_tokens(r, s->token_ids);
    if (name == "block_size") return read_u32(r, name, s->block_size);
    if (name == "medium") return read_medium(r, s->medium);
    if (name == "lora_name") return read_opt_str(r, name, s->lora_name);
    if (name == "group_idx") return read_opt_uint(r, name, s->group_idx);
    if (name == "kv_cache_spec_kind") return read_opt_str(r, name, s->kv_cache_spec_kind);
    if (name == "kv_cache_spec_sliding_window")
      return read_opt_uint(r, name, s->kv_cache_spec_sliding_window);
  } else if (auto* rm = std::get_if<BlockRemoved>(&ev)) {
    if (name == "block_hashes") return read_hashes(r, rm->block_hashes);
    if (name == "medium") return read_medium(r, rm->medium);
    if (name == "group_idx") return read_opt_uint(r, name, rm->group_idx);
  } else if (auto* c = std::get_if<AllBlocksCleared>(&ev)) {
    if (name == "medium") return read_opt_str(r, name, c->medium);
    if (name == "group_idx") return read_opt_uint(r, name, c->group_idx);
  }
  return r.skip();  // lora_id, extra_keys, fields of later versions
}

// vLLM's field order (the order of the msgspec struct), tag excluded.
constexpr std::string_view stored_order[] = {"block_hashes",
                                             "parent_block_hash",
                                             "token_ids",
                                             "block_size",
                                             "lora_id",
                                             "medium",
                                             "lora_name",
                                             "extra_keys",
                                             "group_idx",
                                             "kv_cache_spec_kind",
                                             "kv_cache_spec_sliding_window"};
constexpr std::string_view removed_order[] = {"block_hashes", "medium", "group_idx"};
constexpr std::string_view cleared_order[] = {"medium", "group_idx"};

CacheEvent make_event(Type t) {
  switch (t) {
    case Type::removed:
      return BlockRemoved{};
    case Type::cleared:
      return AllBlocksCleared{};
    default:
      return BlockStored{};
  }
}

// Reads one event; `known` false for an unknown tag (skipped whole).
bool read_event(Reader& r, CacheEvent& ev, bool& known) {
  Value head;
  if (!r.next(head)) return false;
  known = false;
  if (head.kind == Kind::array) {
    if (head.u == 0) {
      r.fail("empty positional event");
      return false;
    }
    Value tag;
    if (!r.next(tag) || !expect(r, tag, Kind::str, "type tag")) return false;
    const Type t = type_of(tag.bytes);
    std::uint64_t left = head.u - 1;
    if (t == Type::unknown) {
      for (; left > 0; --left)
        if (!r.skip(1)) return false;
      return true;
    }
    known = true;
    ev = make_event(t);
    std::span<const std::string_view> order =
        t == Type::stored    ? std::span<const std::string_view>(stored_order)
        : t == Type::removed ? std::span<const std::string_view>(removed_order)
                             : std::span<const std::string_view>(cleared_order);
    // BlockStored's first four fields have no default in vLLM: required.
    const std::size_t required = t == Type::stored ? 4 : t == Type::removed ? 1 : 0;
    if (left < required) {
      r.fail("positional event with " + std::to_string(left) + " fields, needs " +
             std::to_string(required));
      return false;
    }
    for (std::size_t k = 0; left > 0; ++k, --left) {
      if (k < order.size()) {
        if (!read_field(r, ev, order[k])) return false;
      } else if (!r.skip(1)) {
        return false;
      }
    }
    return true;
  }
  if (head.kind != Kind::map) {
    r.fail(std::string("expected a map or an array, got ") + kind_name(head.kind));
    return false;
  }
  // The tag may come anywhere among the keys: fields before it are read
  // into a BlockStored placeholder only once the type is known, so a first
  // pass finds the tag. Maps are small; read keys twice over a copy.
  Reader probe = r;
  std::optional<Type> t;
  for (std::uint64_t k = 0; k < head.u; ++k) {
    Value key;
    if (!probe.next(key)) break;
    if (key.kind == Kind::str && key.bytes == "type") {
      Value tag;
      if (probe.next(tag) && tag.kind == Kind::str) t = type_of(tag.bytes);
      break;
    }
    if (!probe.skip_body(key, 1) || !probe.skip(1)) break;
  }
  if (!t) {
    // Either malformed or no tag: report from the real reader's position.
    for (std::uint64_t k = 0; k < head.u; ++k)
      if (!r.skip(1) || !r.skip(1)) return false;
    r.fail("event map without a string \"type\"");
    return false;
  }
  known = *t != Type::unknown;
  ev = make_event(*t);
  bool have_hashes = false, have_tokens = false, have_size = false;
  for (std::uint64_t k = 0; k < head.u; ++k) {
    Value key;
    if (!r.next(key)) return false;
    if (key.kind != Kind::str || !known) {
      if (!r.skip_body(key, 1) || !r.skip(1)) return false;
      continue;
    }
    if (key.bytes == "type") {
      if (!r.skip(1)) return false;
      continue;
    }
    have_hashes |= key.bytes == "block_hashes";
    have_tokens |= key.bytes == "token_ids";
    have_size |= key.bytes == "block_size";
    if (!read_field(r, ev, key.bytes)) return false;
  }
  if (*t == Type::stored && !(have_hashes && have_tokens && have_size)) {
    r.fail("BlockStored without block_hashes, token_ids or block_size");
    return false;
  }
  if (*t == Type::removed && !have_hashes) {
    r.fail("BlockRemoved without block_hashes");
    return false;
  }
  return true;
}

bool read_events(Reader& r, std::vector<CacheEvent>& out, std::size_t& unknown) {
  Value v;
  if (!r.next(v) || !expect(r, v, Kind::array, "events")) return false;
  out.reserve(v.u);
  for (std::uint64_t k = 0; k < v.u; ++k) {
    r.set_context("event " + std::to_string(k) + ": ");
    CacheEvent ev;
    bool known = false;
    if (!read_event(r, ev, known)) return false;
    if (known) {
      out.push_back(std::move(ev));
    } else {
      ++unknown;
    }
  }
  r.set_context("");
  return true;
}

bool read_ts(Reader& r, double& ts) {
  Value v;
  if (!r.next(v)) return false;
  if (v.kind == Kind::f64) {
    ts = v.d;
  } else if (v.kind == Kind::uint) {
    ts = static_cast<double>(v.u);
  } else if (v.kind == Kind::sint) {
    ts = static_cast<double>(v.i);
  } else {
    r.fail(std::string("ts: expected a number, got ") + kind_name(v.kind));
    return false;
  }
  return true;
}

bool read_rank(Reader& r, std::optional<std::int64_t>& rank) {
  Value v;
  if (!r.next(v)) return false;
  if (v.kind == Kind::nil) {
    rank.reset();
  } else if (v.kind == Kind::sint || (v.kind == Kind::uint && v.u <= INT64_MAX)) {
    rank = static_cast<std::int64_t>(v.u);
  } else {
    r.fail(std::string("data_parallel_rank: expected an integer or nil, got ") + kind_name(v.kind));
    return false;
  }
  return true;
}

// ---- the direct writer (BatchWriter) -------------------------------------------
// Writes through a raw pointer into space reserved once per event (an upper
// bound, trimmed after), in the smallest encodings msgpack-cxx's packer
// chooses, so that its bytes equal pack_event's.

class Raw {
 public:
  // Writes at `end` (out's bytes before it are the batch so far, those after
  // it scratch), growing `out` geometrically, so that an event neither
  // resizes nor zeroes anything once the string has grown.
  Raw(std::string& out, std::size_t& end, std::size_t bound) : out_(out), end_(end) {
    if (out_.size() < end_ + bound) out_.resize(std::max(end_ + bound, 2 * out_.size()));
    p_ = out_.data() + end_;
  }
  ~Raw() { end_ = static_cast<std::size_t>(p_ - out_.data()); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  void byte(unsigned b) { *p_++ = static_cast<char>(b); }
  void be16(std::uint16_t v) {
    byte(v >> 8);
    byte(v & 0xff);
  }
  void be32(std::uint32_t v) {
    v = __builtin_bswap32(v);
    std::memcpy(p_, &v, 4);
    p_ += 4;
  }
  void be64(std::uint64_t v) {
    v = __builtin_bswap64(v);
    std::memcpy(p_, &v, 8);
    p_ += 8;
  }
  void uint(std::uint64_t d) {
    if (d < (1u << 8)) {
      if (d < (1u << 7)) {
        byte(static_cast<unsigned>(d));
      } else {
        byte(0xcc);
        byte(static_cast<unsigned>(d));
      }
    } else if (d < (1u << 16)) {
      byte(0xcd);
      be16(static_cast<std::uint16_t>(d));
    } else if (d < (std::uint64_t{1} << 32)) {
      byte(0xce);
      be32(static_cast<std::uint32_t>(d));
    } else {
      byte(0xcf);
      be64(d);
    }
  }
  // msgpack-cxx's pack_int64: the smallest of the signed and unsigned forms.
  void sint(std::int64_t d) {
    if (d < -(std::int64_t{1} << 5)) {
      if (d < -(std::int64_t{1} << 15)) {
        if (d < -(std::int64_t{1} << 31)) {
          byte(0xd3);
          be64(static_cast<std::uint64_t>(d));
        } else {
          byte(0xd2);
          be32(static_cast<std::uint32_t>(d));
        }
      } else if (d < -(1 << 7)) {
        byte(0xd1);
        be16(static_cast<std::uint16_t>(d));
      } else {
        byte(0xd0);
        byte(static_cast<unsigned>(d) & 0xff);
      }
    } else if (d < (1 << 7)) {
      byte(static_cast<unsigned>(d) & 0xff);  // positive or negative fixint
    } else {
      uint(static_cast<std::uint64_t>(d));
    }
  }
  void nil() { byte(0xc0); }
  void bytes(const char* p, std::size_t n) {
    std::memcpy(p_, p, n);
    p_ += n;
  }
  template <class T>
  void opt_uint(const std::optional<T>& v) {
    if (v) {
      uint(*v);
    } else {
      nil();
    }
  }
  void str(std::string_view s) {
    const std::size_t l = s.size();
    if (l < 32) {
      byte(0xa0u | static_cast<unsigned>(l));
    } else if (l < 256) {
      byte(0xd9);
      byte(static_cast<unsigned>(l));
    } else if (l < 65536) {
      byte(0xda);
      be16(static_cast<std::uint16_t>(l));
    } else {
      byte(0xdb);
      be32(static_cast<std::uint32_t>(l));
    }
    std::memcpy(p_, s.data(), l);
    p_ += l;
  }
  void opt_str(const std::optional<std::string_view>& s) {
    if (s) {
      str(*s);
    } else {
      nil();
    }
  }
  void array(std::size_t n) { header(n, 0x90, 0xdc, 0xdd); }
  void map(std::size_t n) { header(n, 0x80, 0xde, 0xdf); }

  // Bytes an element may take at most.
  static constexpr std::size_t max_uint = 9;
  static constexpr std::size_t max_header = 5;
  static std::size_t max_str(std::string_view s) { return 5 + s.size(); }
  static std::size_t max_str(const std::optional<std::string_view>& s) {
    return s ? max_str(*s) : 1;
  }

 private:
  void header(std::size_t n, unsigned fix, unsigned b16, unsigned b32) {
    if (n < 16) {
      byte(fix | static_cast<unsigned>(n));
    } else if (n < 65536) {
      byte(b16);
      be16(static_cast<std::uint16_t>(n));
    } else {
      byte(b32);
      be32(static_cast<std::uint32_t>(n));
    }
  }

  std::string& out_;
  std::size_t& end_;
  char* p_;
};

// The map form's keys and the event names, with every key's length.
constexpr std::size_t stored_keys_bytes = 256;

}  // namespace

BatchWriter::BatchWriter(std::string& out, EventForm form, double ts, std::size_t events)
    : BatchWriter(out, out.size(), form, ts, events) {}

BatchWriter::BatchWriter(std::string& out, std::size_t at, EventForm form, double ts,
                         std::size_t events)
    : out_(out), form_(form), at_(at), end_(at) {
  if (at_ > out_.size()) out_.resize(at_);
  // The timestamp as msgpack-cxx packs a double (an integral one as an integer).
  struct Fixed {
    char data[16];
    std::size_t size = 0;
    void write(const char* p, std::size_t n) {
      std::memcpy(data + size, p, n);
      size += n;
    }
  } ts_bytes;
  msgpack::packer<Fixed> pk(ts_bytes);
  pk.pack_double(ts);
  Raw w(out_, end_, 16);
  w.array(3);
  w.bytes(ts_bytes.data, ts_bytes.size);
  w.array(events);
}

void BatchWriter::stored(const StoredEventView& e) {
  const bool map = form_ == EventForm::map;
  const std::size_t bound = stored_keys_bytes + Raw::max_header * 3 +
                            Raw::max_uint * (e.block_hashes.size() + 5) + 5 * e.token_ids.size() +
                            Raw::max_str(e.medium) + Raw::max_str(e.lora_name) +
                            Raw::max_str(e.kv_cache_spec_kind);
  Raw w(out_, end_, bound);
  if (map) {
    w.map(12);
    w.str("type");
  } else {
    w.array(12);
  }
  w.str("BlockStored");
  if (map) w.str("block_hashes");
  w.array(e.block_hashes.size());
  for (std::uint64_t h : e.block_hashes)
    w.uint(h);
  if (map) w.str("parent_block_hash");
  w.opt_uint(e.parent_block_hash);
  if (map) w.str("token_ids");
  w.array(e.token_ids.size());
  for (TokenId t : e.token_ids)
    w.uint(t);
  if (map) w.str("block_size");
  w.uint(e.block_size);
  if (map) w.str("lora_id");
  w.nil();
  if (map) w.str("medium");
  w.str(e.medium);
  if (map) w.str("lora_name");
  w.opt_str(e.lora_name);
  if (map) w.str("extra_keys");
  w.nil();
  if (map) w.str("group_idx");
  w.opt_uint(e.group_idx);
  if (map) w.str("kv_cache_spec_kind");
  w.opt_str(e.kv_cache_spec_kind);
  if (map) w.str("kv_cache_spec_sliding_window");
  w.opt_uint(e.kv_cache_spec_sliding_window);
}

void BatchWriter::removed(std::span<const std::uint64_t> block_hashes, std::string_view medium,
                          std::optional<std::uint32_t> group_idx,
                          std::optional<std::string_view> kv_cache_spec_kind) {
  const bool map = form_ == EventForm::map;
  Raw w(out_, end_,
        128 + Raw::max_header + Raw::max_uint * (block_hashes.size() + 1) + Raw::max_str(medium) +
            Raw::max_str(kv_cache_spec_kind));
  const std::size_t n = kv_cache_spec_kind ? 5 : 4;
  if (map) {
    w.map(n);
    w.str("type");
  } else {
    w.array(n);
  }
  w.str("BlockRemoved");
  if (map) w.str("block_hashes");
  w.array(block_hashes.size());
  for (std::uint64_t h : block_hashes)
    w.uint(h);
  if (map) w.str("medium");
  w.str(medium);
  if (map) w.str("group_idx");
  w.opt_uint(group_idx);
  if (kv_cache_spec_kind) {
    if (map) w.str("kv_cache_spec_kind");
    w.str(*kv_cache_spec_kind);
  }
}

void BatchWriter::cleared(std::optional<std::string_view> medium,
                          std::optional<std::uint32_t> group_idx,
                          std::optional<std::string_view> kv_cache_spec_kind) {
  Raw w(out_, end_, 128 + Raw::max_str(medium) + Raw::max_uint + Raw::max_str(kv_cache_spec_kind));
  const bool scoped = medium || group_idx || kv_cache_spec_kind;
  if (form_ == EventForm::map) {
    w.map(1 + (medium ? 1 : 0) + (group_idx ? 1 : 0) + (kv_cache_spec_kind ? 1 : 0));
    w.str("type");
    w.str("AllBlocksCleared");
    if (medium) {
      w.str("medium");
      w.str(*medium);
    }
    if (group_idx) {
      w.str("group_idx");
      w.uint(*group_idx);
    }
    if (kv_cache_spec_kind) {
      w.str("kv_cache_spec_kind");
      w.str(*kv_cache_spec_kind);
    }
  } else {
    w.array(scoped ? (kv_cache_spec_kind ? 4 : 3) : 1);
    w.str("AllBlocksCleared");
    if (scoped) {
      w.opt_str(medium);
      w.opt_uint(group_idx);
      if (kv_cache_spec_kind) w.str(*kv_cache_spec_kind);
    }
  }
}

void BatchWriter::finish(std::optional<std::int64_t> data_parallel_rank) {
  (void)finish_view(data_parallel_rank);
  out_.resize(end_);
}

std::string_view BatchWriter::finish_view(std::optional<std::int64_t> data_parallel_rank) {
  {
    Raw w(out_, end_, Raw::max_uint);
    if (data_parallel_rank) {
      w.sint(*data_parallel_rank);
    } else {
      w.nil();
    }
  }
  return std::string_view(out_.data() + at_, end_ - at_);
}

void encode_event(const CacheEvent& event, EventForm form, std::string& out) {
  StringBuffer buf{out};
  Packer pk(buf);
  std::visit([&](const auto& e) { pack_event(pk, e, form); }, event);
}

void encode_batch(const EventBatch& batch, EventForm form, std::string& out) {
  StringBuffer buf{out};
  Packer pk(buf);
  pk.pack_array(3);
  pk.pack_double(batch.ts);
  pk.pack_array(static_cast<std::uint32_t>(batch.events.size()));
  for (const CacheEvent& e : batch.events) {
    std::visit([&](const auto& x) { pack_event(pk, x, form); }, e);
  }
  if (batch.data_parallel_rank) {
    pk.pack_int64(*batch.data_parallel_rank);
  } else {
    pk.pack_nil();
  }
}

std::string encode_batch(const EventBatch& batch, EventForm form) {
  std::string out;
  encode_batch(batch, form, out);
  return out;
}

DecodeResult decode_batch(std::string_view payload, std::uint64_t seq) {
  DecodeResult result;
  Reader r(payload);
  EventBatch batch;
  batch.seq = seq;
  Value head;
  bool ok = r.next(head);
  if (ok && head.kind == Kind::array) {
    if (head.u < 2) {
      r.fail("batch array with " + std::to_string(head.u) + " elements, needs ts and events");
      ok = false;
    } else {
      ok = read_ts(r, batch.ts) && read_events(r, batch.events, result.unknown_events) &&
           (head.u < 3 || read_rank(r, batch.data_parallel_rank));
      for (std::uint64_t k = 3; ok && k < head.u; ++k)
        ok = r.skip(1);
    }
  } else if (ok && head.kind == Kind::map) {
    bool have_events = false;
    for (std::uint64_t k = 0; ok && k < head.u; ++k) {
      Value key;
      ok = r.next(key);
      if (!ok) break;
      if (key.kind != Kind::str) {
        ok = r.skip_body(key, 1) && r.skip(1);
      } else if (key.bytes == "ts") {
        ok = read_ts(r, batch.ts);
      } else if (key.bytes == "events") {
        batch.events.clear();
        ok = read_events(r, batch.events, result.unknown_events);
        have_events = true;
      } else if (key.bytes == "data_parallel_rank") {
        ok = read_rank(r, batch.data_parallel_rank);
      } else {
        ok = r.skip(1);
      }
    }
    if (ok && !have_events) {
      r.fail("batch map without \"events\"");
      ok = false;
    }
  } else if (ok) {
    r.fail(std::string("batch: expected an array or a map, got ") + kind_name(head.kind));
    ok = false;
  }
  if (ok && !r.at_end()) {
    r.fail(std::to_string(r.remaining()) + " trailing bytes after the batch");
    ok = false;
  }
  if (!ok || r.failed()) {
    result.error = r.error().empty() ? std::string("malformed batch") : r.error();
    result.unknown_events = 0;
    return result;
  }
  result.batch = std::move(batch);
  return result;
}

DecodeResult decode_batch(std::span<const std::byte> payload, std::uint64_t seq) {
  return decode_batch(
      std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()), seq);
}

std::array<std::byte, 8> encode_seq(std::uint64_t seq) noexcept {
  std::array<std::byte, 8> out{};
  for (int k = 7; k >= 0; --k) {
    out[static_cast<std::size_t>(k)] = static_cast<std::byte>(seq & 0xff);
    seq >>= 8;
  }
  return out;
}

std::optional<std::uint64_t> decode_seq(std::span<const std::byte> frame) noexcept {
  if (frame.size() != 8) return std::nullopt;
  std::uint64_t v = 0;
  for (std::byte b : frame)
    v = (v << 8) | static_cast<std::uint8_t>(b);
  return v;
}

}  // namespace kvport::events
