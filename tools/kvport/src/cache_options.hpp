// SPDX-License-Identifier: Apache-2.0
// The model, cache-shape and memory-budget flags that several subcommands
// share (plan, demo; later bench and conformance).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/cli/memory_budget.hpp"
#include "kvport/cli/model_spec.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/platform/backend.hpp"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace kvport::cli {

/// A flag kept as text and parsed by kvport (flag_values.hpp), so that every
/// bad value gets the same kind of message; `given()` after the parse.
struct TextFlag {
  std::string value;
  CLI::Option* option = nullptr;

  bool given() const;
};

/// Declares `name` on `app` bound to `flag`, shown as `type` in --help. Every
/// command declares its valued flags through this, so that they all behave
/// alike: a repeated flag takes its last value (scripts append overrides),
/// and the value is parsed by kvport (flag_values.hpp), not by CLI11.
CLI::Option* add_text_flag(CLI::App& app, const char* name, TextFlag& flag, const char* type,
                           const std::string& help);

/// --model, --hf-config, --layers, --kv-heads, --head-dim[-k|-v], --dtype,
/// --layer-dtypes, --block-size, --layout, --state-dtype, --ssm-state-dtype.
class CacheShapeOptions {
 public:
  void add_to(CLI::App& app, std::string_view default_model);

  /// The model (a preset, a config, flags) and the validated cache config.
  struct Resolved {
    ModelSpec model;
    KvCacheConfig config;
  };
  /// For the commands that run one PagedKvCache: throws InvalidArgument
  /// naming the bad flag or field, and for a hybrid model (its layers do not
  /// fit one cache config).
  Resolved resolve() const;

  /// A model of any layers, as the cache keeps them (`kvport plan`).
  struct Layered {
    ModelSpec model;
    /// One per layer: --dtype and --layer-dtypes applied to the layers with
    /// blocks, --state-dtype and --ssm-state-dtype to the state layers.
    std::vector<LayerSpec> layers;
    std::string dtype;  ///< --dtype's name: a KvCacheDtype's, or "fp8_ds_mla"
    std::size_t block_size = 0;
    KvCacheLayout layout = KvCacheLayout::layer_major;
    /// What resolve() gives, for a model whose every layer is full attention.
    std::optional<Resolved> full_attention;
  };
  /// Throws InvalidArgument naming the bad flag or field: as resolve(), and
  /// for --dtype fp8_ds_mla on a model with other than MLA layers,
  /// --layer-dtypes setting a layer without blocks (or with fp8_ds_mla), or
  /// a state dtype flag on a model without state layers.
  Layered resolve_layers() const;

 private:
  ModelOverrides overrides() const;
  Resolved resolve_full_attention(ModelSpec model) const;

  std::string default_model_;
  TextFlag model_, hf_config_, layers_, kv_heads_, head_dim_, head_dim_k_, head_dim_v_;
  TextFlag dtype_, layer_dtypes_, block_size_, layout_, state_dtype_, ssm_state_dtype_;
};

/// --memory, --utilization, --backend.
class BudgetOptions {
 public:
  void add_to(CLI::App& app, std::string_view default_memory);

  /// The backend named by --backend, else kvport::default_backend().
  /// Throws InvalidArgument for an unknown name, BackendError without a device.
  std::unique_ptr<Backend> make_backend() const;
  bool backend_given() const { return backend_.given(); }

  /// The parsed --memory value (InvalidArgument when malformed or zero, or
  /// when --utilization is given with a byte size).
  MemoryBudgetSpec memory_spec() const;

  /// Bytes of the budget; `backend` is used (and must be non-null) for
  /// "--memory device".
  MemoryBudget resolve(const Backend* backend) const;

  const std::string& memory_text() const { return memory_.value; }

 private:
  TextFlag memory_, utilization_, backend_;
};

}  // namespace kvport::cli
