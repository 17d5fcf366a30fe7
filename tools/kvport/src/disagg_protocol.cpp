// SPDX-License-Identifier: Apache-2.0
// The shared half of `kvport disagg`'s protocol (disagg.hpp): role names,
// message skeletons and the worker spec's JSON form.
#include <fmt/format.h>

#include "disagg.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli::disagg {

using nlohmann::json;

std::string_view to_string(Role role) noexcept {
  return role == Role::prefill ? "prefill" : "decode";
}

std::optional<Role> parse_role(std::string_view name) noexcept {
  if (name == "prefill") return Role::prefill;
  if (name == "decode") return Role::decode;
  return std::nullopt;
}

std::string worker_name(Role role, std::uint32_t instance, std::uint32_t rank) {
  return fmt::format("{}{}.{}", to_string(role), instance, rank);
}

json op_message(std::string_view name) {
  return json{{field::op, name}};
}

json event_message(std::string_view name) {
  return json{{field::event, name}};
}

json layer_spec_json(const LayerSpec& spec) {
  json tensors = json::array();
  for (const StateTensor& t : spec.state) {
    tensors.push_back(
        {{"name", t.name}, {"shape", t.shape}, {"dtype", std::string(kvport::to_string(t.dtype))}});
  }
  return json{{"kind", std::string(kvport::to_string(spec.kind))},
              {"kv_heads", spec.num_kv_heads},
              {"head_dim_k", spec.head_dim_k},
              {"head_dim_v", spec.head_dim_v},
              {"dtype", std::string(kvport::to_string(spec.dtype))},
              {"window", spec.window},
              {"chunk", spec.chunk},
              {"kv_lora_rank", spec.kv_lora_rank},
              {"rope_dim", spec.rope_dim},
              {"mla_format", std::string(kvport::to_string(spec.mla_format))},
              {"state", tensors}};
}

LayerSpec layer_spec_from_json(const json& j, std::size_t block_size) {
  try {
    LayerSpec s;
    const std::string kind = j.at("kind").get<std::string>();
    const auto k = parse_layer_kind(kind);
    if (!k) throw InvalidArgument("layer spec: unknown kind " + kind);
    s.kind = *k;
    s.num_kv_heads = j.at("kv_heads").get<std::size_t>();
    s.head_dim_k = j.at("head_dim_k").get<std::size_t>();
    s.head_dim_v = j.at("head_dim_v").get<std::size_t>();
    const std::string dtype = j.at("dtype").get<std::string>();
    const auto d = parse_dtype(dtype);
    if (!d) throw InvalidArgument("layer spec: unknown dtype " + dtype);
    s.dtype = *d;
    s.window = j.at("window").get<std::size_t>();
    s.chunk = j.at("chunk").get<std::size_t>();
    s.kv_lora_rank = j.at("kv_lora_rank").get<std::size_t>();
    s.rope_dim = j.at("rope_dim").get<std::size_t>();
    const std::string format = j.at("mla_format").get<std::string>();
    if (format == kvport::to_string(MlaFormat::fp8_ds_mla)) {
      s.mla_format = MlaFormat::fp8_ds_mla;
    } else if (format != kvport::to_string(MlaFormat::plain)) {
      throw InvalidArgument("layer spec: unknown mla_format " + format);
    }
    for (const auto& t : j.at("state")) {
      StateTensor st;
      st.name = t.at("name").get<std::string>();
      st.shape = t.at("shape").get<std::vector<std::size_t>>();
      const std::string sd = t.at("dtype").get<std::string>();
      const auto parsed = parse_state_dtype(sd);
      if (!parsed) throw InvalidArgument("layer spec: unknown state dtype " + sd);
      st.dtype = *parsed;
      s.state.push_back(std::move(st));
    }
    if (s.kind != LayerKind::none) s.validate(block_size);
    return s;
  } catch (const json::exception& e) {
    throw InvalidArgument(std::string("layer spec: ") + e.what());
  }
}

json WorkerSpec::to_json() const {
  json dtypes = json::array();
  for (KvCacheDtype d : config.layer_dtypes)
    dtypes.push_back(std::string(kvport::to_string(d)));
  return json{{"role", std::string(to_string(role))},
              {"instance", instance},
              {"rank", rank},
              {"tp", tp},
              {"layers", config.num_layers},
              {"block_size", config.block_size},
              {"kv_heads", config.num_kv_heads},
              {"head_dim_k", config.head_dim_k},
              {"head_dim_v", config.head_dim_v},
              {"dtype", std::string(kvport::to_string(config.dtype))},
              {"layer_dtypes", dtypes},
              {"layout", std::string(kvport::to_string(config.layout))},
              {"model_layers",
               [&] {
                 json a = json::array();
                 for (const LayerSpec& l : model_layers)
                   a.push_back(layer_spec_json(l));
                 return a;
               }()},
              {"state_slots", state_slots},
              {"capacity_blocks", capacity_blocks},
              {"peer_timeout_ms", peer_timeout.count()},
              {"lease_ttl_ms", lease_ttl.count()},
              {"scratch_bytes", scratch_bytes},
              {"bind", bind}};
}

WorkerSpec WorkerSpec::from_json(const json& j) {
  try {
    WorkerSpec s;
    const auto role = j.at("role").get<std::string>();
    const std::optional<Role> parsed = parse_role(role);
    if (!parsed) throw InvalidArgument("worker spec: bad role " + role);
    s.role = *parsed;
    s.instance = j.at("instance").get<std::uint32_t>();
    s.rank = j.at("rank").get<std::uint32_t>();
    s.tp = j.at("tp").get<std::uint32_t>();
    s.config.num_layers = j.at("layers").get<std::size_t>();
    s.config.block_size = j.at("block_size").get<std::size_t>();
    s.config.num_kv_heads = j.at("kv_heads").get<std::size_t>();
    s.config.head_dim_k = j.at("head_dim_k").get<std::size_t>();
    s.config.head_dim_v = j.at("head_dim_v").get<std::size_t>();
    auto dtype = [](const std::string& name) {
      auto d = parse_dtype(name);
      if (!d) throw InvalidArgument("worker spec: unknown dtype " + name);
      return *d;
    };
    s.config.dtype = dtype(j.at("dtype").get<std::string>());
    for (const auto& d : j.at("layer_dtypes"))
      s.config.layer_dtypes.push_back(dtype(d.get<std::string>()));
    const std::string layout = j.at("layout").get<std::string>();
    s.config.layout = layout == kvport::to_string(KvCacheLayout::block_major)
                          ? KvCacheLayout::block_major
                          : KvCacheLayout::layer_major;
    s.capacity_blocks = j.at("capacity_blocks").get<std::size_t>();
    s.state_slots = j.value("state_slots", std::size_t{0});
    if (j.contains("model_layers")) {
      for (const auto& l : j.at("model_layers"))
        s.model_layers.push_back(layer_spec_from_json(l, s.config.block_size));
    }
    s.peer_timeout = std::chrono::milliseconds(j.at("peer_timeout_ms").get<std::int64_t>());
    s.lease_ttl = std::chrono::milliseconds(j.at("lease_ttl_ms").get<std::int64_t>());
    s.scratch_bytes = j.at("scratch_bytes").get<std::size_t>();
    s.bind = j.at("bind").get<std::string>();
    return s;
  } catch (const json::exception& e) {
    throw InvalidArgument(std::string("worker spec: ") + e.what());
  }
}

}  // namespace kvport::cli::disagg
