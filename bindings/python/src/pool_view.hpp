// SPDX-License-Identifier: Apache-2.0
// PoolView: a zero-copy view of cache memory (a layer's K or V pool, a
// block-major pool, an MLA latent pool, one state tensor of every slot),
// exported through DLPack and as a writable NumPy array. Every view and every
// capsule exported from it holds its owner, so the memory stays allocated
// while anything can still reach it.
#pragma once

#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::python {

namespace py = pybind11;

/// What a view keeps alive and where its memory lives.
struct ViewOwner {
  /// The state that owns the pools (a cache's, a hybrid cache's).
  std::shared_ptr<const void> keep;
  /// Synchronized (default stream) before a consumer reads; owned by `keep`.
  Backend* backend = nullptr;
  int device = 0;
};

/// kDLCPU for the host backend, kDLCUDA / kDLROCM with the device ordinal.
DLDevice dl_device(const ViewOwner& owner);

struct PoolView {
  ViewOwner owner;
  std::string what;      // "k_pool(0)", "state(ssm) of layer 3", ...
  std::string kv_dtype;  // what the cache stores: "bf16", "fp8_ds_mla", "f32", ...
  std::string dtype;     // NumPy-style name of the element type
  DLDataType dl_dtype{};
  std::uintptr_t data = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // in elements
  std::size_t scale_offset = 0;       // packed formats: where the scales start in a block
  std::size_t scale_bytes = 0;
};

/// Layer `layer`'s K (or V) pool of `cache`: [num_blocks, block_size, heads,
/// head_dim] of the element type for f16 / bf16 (uint16 words with `raw`) and
/// fp8 (uint8); [num_blocks, region bytes] uint8 for packed formats, with the
/// scales' offset. Throws InvalidArgument for a bad layer (and for V of a
/// K-only cache).
PoolView layer_pool_view(const ViewOwner& owner, const PagedKvCache& cache, bool k,
                         std::size_t layer, bool raw, std::string what);

/// A DLPack capsule ("dltensor") over the view; its deleter needs no GIL.
py::capsule to_dlpack(const PoolView& view);

/// A writable, zero-copy NumPy array over a host view (bf16 as uint16 words:
/// NumPy has no bfloat16), after synchronizing the backend's default stream.
py::array numpy_view(const PoolView& view);

py::tuple to_tuple(const std::vector<std::int64_t>& values);

/// Registers kvport.PoolView.
void register_pool_view(py::module_& m);

}  // namespace kvport::python
