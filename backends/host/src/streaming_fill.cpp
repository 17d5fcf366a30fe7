// SPDX-License-Identifier: Apache-2.0
#include "streaming_fill.hpp"

#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <cstdlib>
#include <cstring>
#include <string>

#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::host {

// A batch of block regions is many separate regions (40 960 of 32 KiB for
// 256 llama-3-70b blocks in layer_major). Set with memset, they ran at a
// third of one contiguous memset of the same bytes on this project's VM.
// glibc 2.36's memset, the limit's, has no non-temporal path (above 2 KiB it
// is `rep stosb`, the same for both), so the gap is the access pattern: the
// ordinary stores read each line before writing it, as streaming
// (non-temporal) stores never do.
//
// The rule (streaming_threshold): stream every batch at least as large as
// the core's private L2 cache, the only cache the lines could be expected to
// stay in. The last-level cache is no guide: it is shared with the other
// cores and with the limit's buffer, and VMs misreport it (sysconf says
// 256 MiB on this project's 2-core AMD EPYC VM, the kernel's cache topology
// 32 MiB), which kept batches up to 192 MiB on memset, at 0.2-0.6x of one
// contiguous memset. Measured there (docs/performance.md, kvport bench,
// both llama-3 models, 16/32 blocks): streaming is 1.5x-4x faster than
// memset for the same batch, and a standalone loop of the layer_major
// pattern found it faster from 1 block (2 MiB) up.
// One contiguous memset_async stays a plain memset.

#if defined(__x86_64__) && defined(__GNUC__)
namespace {

// The aligned middle of [p, p + n) for vectors of `width` bytes; the head and
// tail around it are set with memset.
struct Middle {
  std::size_t head;
  std::size_t vectors;
};
inline Middle split(unsigned char* p, std::uint8_t value, std::size_t n, std::size_t width) {
  const std::size_t misalign = reinterpret_cast<std::uintptr_t>(p) % width;
  std::size_t head = misalign == 0 ? 0 : width - misalign;
  if (head > n) head = n;
  const std::size_t vectors = (n - head) / width;
  std::memset(p, value, head);
  std::memset(p + head + vectors * width, value, n - head - vectors * width);
  return Middle{head, vectors};
}

// (The loops are written out in each function: a target attribute does not
// reach into a lambda.)
__attribute__((target("avx512f"))) void streaming_fill_avx512(unsigned char* p, std::uint8_t value,
                                                              std::size_t n) {
  const Middle m = split(p, value, n, 64);
  const __m512i pattern = _mm512_set1_epi32(static_cast<int>(0x01010101u * value));
  auto* q = reinterpret_cast<__m512i*>(p + m.head);
  for (std::size_t i = 0; i < m.vectors; ++i)
    _mm512_stream_si512(q + i, pattern);
}

__attribute__((target("avx2"))) void streaming_fill_avx2(unsigned char* p, std::uint8_t value,
                                                         std::size_t n) {
  const Middle m = split(p, value, n, 32);
  const __m256i pattern = _mm256_set1_epi8(static_cast<char>(value));
  auto* q = reinterpret_cast<__m256i*>(p + m.head);
  for (std::size_t i = 0; i < m.vectors; ++i)
    _mm256_stream_si256(q + i, pattern);
}

}  // namespace

StreamingFill streaming_fill() noexcept {
  static const StreamingFill fill = []() -> StreamingFill {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &streaming_fill_avx512;
    if (__builtin_cpu_supports("avx2")) return &streaming_fill_avx2;
    return nullptr;
  }();
  return fill;
}

// Streaming stores are weakly ordered: fence before the stream moves on.
void streaming_fence() noexcept {
  _mm_sfence();
}
#else
StreamingFill streaming_fill() noexcept {
  return nullptr;
}
void streaming_fence() noexcept {}
#endif

// KVPORT_HOST_STREAMING_THRESHOLD (a byte size), else the L2 cache size,
// else 1 MiB.
std::size_t streaming_threshold() {
  if (const char* env = std::getenv("KVPORT_HOST_STREAMING_THRESHOLD"); env != nullptr && *env) {
    try {
      return parse_byte_size(env);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("KVPORT_HOST_STREAMING_THRESHOLD: ") + e.what());
    }
  }
  const long l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? static_cast<std::size_t>(l2) : std::size_t{1} << 20;
}

}  // namespace kvport::host
