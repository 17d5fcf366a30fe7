// SPDX-License-Identifier: Apache-2.0
// The backend conformance suite: the executable form of the Backend contract
// (platform/include/kvport/platform/backend.hpp). One test body per
// behaviour, instantiated for every compiled backend; a backend without a
// device reports each test as skipped, with the reason.
//
// The tests live in one file per topic:
//   conformance_test.cpp  allocation, memset, batched fills, copies, ordering,
//                         contract details, PagedKvCache end to end
//   contract_test.cpp     use after free at call time, destroyed streams,
//                         moved-from handles, DeviceBuffer frees, call counts
//   engine_seams_test.cpp an engine's own streams (wrap_stream) and memory
//                         (adopt_memory)
//   scale_test.cpp        offsets beyond 4 GiB, > 2^20 regions, 100 000 block
//                         ids, large misaligned batched copies, a 1 GiB fill
//   streams_test.cpp      staging under load, events across streams, never
//                         recorded events, calls from other threads
//   host_memory_test.cpp  pinned host memory and asynchronous copies with it
//   lifecycle_test.cpp    destruction with work pending, two backends, device
//                         ordinals, a real out-of-memory
#include "conformance.hpp"

#include <algorithm>
#include <cstring>
#include <random>
#include <sstream>

#include "gpusim_backend.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport::conformance {
namespace {

// Test-only backends the suite also runs, beside every compiled one: gpusim is
// the GPU backend's code over a CPU simulation of the vendor API; fault_host is
// the FaultInjectingBackend decorator over the host backend with no fault
// planned, which must be indistinguishable from the host backend. (Names are
// test-name suffixes, so "fault_host" rather than its name(), "fault(host)".)
struct TestBackend {
  const char* name;
  std::unique_ptr<Backend> (*make)();
  std::unique_ptr<Backend> (*make_on)(int device);
};

const TestBackend kTestBackends[] = {
    {"gpusim", [] { return testing::make_gpusim_backend(kGpusimCapacity); },
     [](int device) { return testing::make_gpusim_backend(kGpusimCapacity, device); }},
    {"fault_host",
     []() -> std::unique_ptr<Backend> {
       return std::make_unique<FaultInjectingBackend>(make_backend("host"));
     },
     [](int device) -> std::unique_ptr<Backend> {
       return std::make_unique<FaultInjectingBackend>(make_backend("host", device));
     }},
};

const TestBackend* test_backend(const std::string& name) {
  for (const TestBackend& t : kTestBackends) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const BackendInfo& info : compiled_backends())
    names.push_back(info.name);
  for (const TestBackend& t : kTestBackends)
    names.emplace_back(t.name);
  return names;
}

BackendInfo info_of(const std::string& name) {
  for (BackendInfo& info : compiled_backends()) {
    if (info.name == name) return info;
  }
  return BackendInfo{name, false, true, ""};  // a test backend: always available
}

std::unique_ptr<Backend> make_any_backend(const std::string& name) {
  if (const TestBackend* t = test_backend(name)) return t->make();
  return make_backend(name);
}

std::unique_ptr<Backend> make_any_backend_on(const std::string& name, int device) {
  if (const TestBackend* t = test_backend(name)) return t->make_on(device);
  return make_backend(name, device);
}

Bytes random_bytes(std::size_t n, std::uint64_t seed) {
  // Eight bytes per draw, stored as one word: this runs over megabytes, in
  // Debug builds under the sanitizers too.
  std::mt19937_64 rng(seed);
  Bytes out(n);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t word = rng();
    std::memcpy(out.data() + i, &word, 8);
  }
  if (i < n) {
    const std::uint64_t word = rng();
    std::memcpy(out.data() + i, &word, n - i);
  }
  return out;
}

::testing::AssertionResult same_bytes(const Bytes& got, const Bytes& expected) {
  if (got.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: got " << got.size() << " bytes, expected " << expected.size();
  }
  if (got == expected) return ::testing::AssertionSuccess();  // memcmp: fast in Debug too
  const auto first = std::mismatch(got.begin(), got.end(), expected.begin());
  const std::size_t at = static_cast<std::size_t>(first.first - got.begin());
  std::size_t wrong = 0;
  for (std::size_t i = at; i < got.size(); ++i)
    wrong += got[i] != expected[i] ? 1 : 0;
  std::ostringstream out;
  out << wrong << " of " << got.size() << " bytes wrong; first at offset " << at
      << " (got, expected):";
  for (std::size_t i = at; i < std::min(got.size(), at + 8); ++i) {
    out << " " << static_cast<int>(got[i]) << "/" << static_cast<int>(expected[i]);
  }
  return ::testing::AssertionFailure() << out.str();
}

void Conformance::SetUp() {
  info_ = info_of(GetParam());
  if (!info_.available) GTEST_SKIP() << info_.unavailable_reason;
  backend_ = make_any_backend(GetParam());
}

void Conformance::TearDown() {
  if (!backend_) return;
  for (DevicePtr p : owned_)
    backend_->free(p);
}

DevicePtr Conformance::alloc(std::size_t bytes) {
  DevicePtr p = b().alloc(bytes);
  std::lock_guard lock(owned_mutex_);
  owned_.push_back(p);
  return p;
}

DevicePtr Conformance::upload(const Bytes& content) {
  DevicePtr p = alloc(content.size());
  b().copy_h2d(p, content.data(), content.size(), stream());
  return p;
}

Bytes Conformance::download(DevicePtr p, std::size_t bytes) {
  return download(p, bytes, stream());
}

Bytes Conformance::download(DevicePtr p, std::size_t bytes, StreamView s) {
  Bytes out(bytes);
  b().copy_d2h(out.data(), p, bytes, s);
  return out;
}

void Conformance::check_batched_fill(std::size_t count, std::size_t max_size, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::pair<std::size_t, std::size_t>> layout;  // offset, size
  std::size_t cursor = rng() % 7;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t size = 1 + rng() % max_size;
    layout.emplace_back(cursor, size);
    cursor += size + rng() % 6;
  }
  Bytes expected = random_bytes(cursor + 16, seed + 1);
  DevicePtr p = upload(expected);
  std::vector<FillRegion> regions;
  for (auto [offset, size] : layout) {
    regions.push_back(FillRegion{p.offset(offset), size});
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), size, 0x3C);
  }
  std::shuffle(regions.begin(), regions.end(), rng);
  const CallCounts before = b().call_counts();
  b().fill_async(regions, 0x3C, stream());
  EXPECT_EQ(b().call_counts().fill - before.fill, 1u);
  EXPECT_TRUE(same_bytes(download(p, expected.size()), expected));
}

namespace {

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::ValuesIn(backend_names()), param_name);

}  // namespace kvport::conformance
