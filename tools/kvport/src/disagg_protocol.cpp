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
