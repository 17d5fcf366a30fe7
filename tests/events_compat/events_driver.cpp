// SPDX-License-Identifier: Apache-2.0
// The publishing side of the independent decoder test (vllm_subscriber.py):
// a Publisher fed a scripted sequence of events over real block hashes
// (chains with parents, a LoRA adapter, the CPU tier, KV cache groups,
// removals, a tier cleared), and a JSON dump of the cached set the script
// leaves, computed here from the script alone.
//
// Protocol on stdin/stdout: prints "ENDPOINTS <pub> <replay>", waits for a
// line, publishes, writes the dump to argv[2], prints "DONE <next seq>",
// waits for a line and exits. Exits by itself after 60 s whatever happens.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "kvport/core/block_hash.hpp"
#include "kvport/events/publisher.hpp"

using namespace kvport;

namespace {

struct Rec {
  std::optional<std::uint64_t> parent;
  std::vector<TokenId> tokens;
  std::uint32_t block_size;
  std::optional<std::string> lora;
  std::optional<std::string> kind;
  std::optional<std::uint32_t> window;
};
using Key = std::tuple<std::string, std::optional<std::uint32_t>, std::uint64_t>;

struct Script {
  events::Publisher& pub;
  std::map<Key, Rec> model;

  void store(const EventSource& src, const std::vector<TokenId>& tokens, std::uint32_t bs,
             std::size_t skip_blocks, std::optional<std::string_view> lora) {
    const auto hashes = hash_full_blocks(tokens, bs, lora ? 7 : 0);
    std::span<const BlockHash> h(hashes);
    h = h.subspan(skip_blocks);
    std::span<const TokenId> t(tokens);
    t = t.subspan(skip_blocks * bs, h.size() * bs);
    BlockStoredView v;
    v.hashes = h;
    if (skip_blocks > 0) v.parent = hashes[skip_blocks - 1];
    v.tokens = t;
    v.block_size = bs;
    v.lora_name = lora;
    pub.stored(src, v);
    for (std::size_t i = 0; i < h.size(); ++i) {
      Rec r;
      r.parent = i == 0 ? (v.parent ? std::optional(v.parent->low) : std::nullopt)
                        : std::optional(h[i - 1].low);
      r.tokens.assign(t.begin() + i * bs, t.begin() + (i + 1) * bs);
      r.block_size = bs;
      if (lora) r.lora = std::string(*lora);
      r.kind = src.spec_kind;
      r.window = src.sliding_window;
      model[Key{std::string(to_string(src.medium)), src.group_idx, h[i].low}] = r;
    }
  }
  void remove(const EventSource& src, const std::vector<TokenId>& tokens, std::uint32_t bs,
              std::size_t first, std::size_t count) {
    const auto hashes = hash_full_blocks(tokens, bs);
    std::span<const BlockHash> h = std::span(hashes).subspan(first, count);
    pub.removed(src, h);
    for (const BlockHash& x : h)
      model.erase(Key{std::string(to_string(src.medium)), src.group_idx, x.low});
  }
  void clear(const EventSource& src) {
    pub.cleared(src);
    std::erase_if(model, [&](const auto& kv) {
      return std::get<0>(kv.first) == to_string(src.medium) &&
             (!src.group_idx || std::get<1>(kv.first) == src.group_idx);
    });
  }
};

std::vector<TokenId> seq_tokens(TokenId start, std::size_t n) {
  std::vector<TokenId> t(n);
  for (std::size_t i = 0; i < n; ++i)
    t[i] = start + static_cast<TokenId>(i * 7 % 1000);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  alarm(60);
  if (argc != 3) {
    std::cerr << "usage: kvport_events_driver map|positional DUMP.json\n";
    return 2;
  }
  events::PublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.topic = "kvport";
  o.data_parallel_rank = 0;
  o.max_batch_events = 5;
  o.batch_interval = std::chrono::milliseconds(1);
  o.form =
      std::string(argv[1]) == "positional" ? events::EventForm::positional : events::EventForm::map;
  events::Publisher pub(o);
  std::cout << "ENDPOINTS " << pub.endpoint() << " " << pub.replay_endpoint() << std::endl;
  std::string line;
  if (!std::getline(std::cin, line)) return 3;

  Script s{pub, {}};
  const EventSource gpu{};
  const EventSource cpu{Medium::cpu, std::nullopt, std::nullopt, std::nullopt};
  const EventSource full{Medium::gpu, 0u, std::string("full_attention"), std::nullopt};
  const EventSource swa{Medium::gpu, 1u, std::string("sliding_window"), 128u};
  for (int conv = 0; conv < 20; ++conv) {
    const auto t = seq_tokens(static_cast<TokenId>(conv * 3), 16 * (4 + conv % 5));
    s.store(gpu, t, 16, 0, std::nullopt);
    // A follow-up turn extends the chain: only the new blocks, with a parent.
    auto longer = t;
    const auto more = seq_tokens(5000 + static_cast<TokenId>(conv), 32);
    longer.insert(longer.end(), more.begin(), more.end());
    s.store(gpu, longer, 16, t.size() / 16, std::nullopt);
    if (conv % 3 == 0) s.store(cpu, t, 16, 0, std::nullopt);  // offloaded
    if (conv % 4 == 1) s.remove(gpu, t, 16, 1, 2);            // evicted
    if (conv % 5 == 2) s.store(gpu, t, 16, 0, std::string_view("sql-adapter"));
  }
  const auto g = seq_tokens(9000, 64);
  s.store(full, g, 16, 0, std::nullopt);
  s.store(swa, g, 16, 0, std::nullopt);
  s.remove(swa, g, 16, 0, 2);  // out of the window
  s.clear(cpu);                // the host tier dropped everything
  const auto late = seq_tokens(7000, 48);
  s.store(cpu, late, 16, 0, std::nullopt);

  if (!pub.flush(std::chrono::seconds(10))) return 4;
  nlohmann::json dump = nlohmann::json::array();
  for (const auto& [key, r] : s.model) {
    nlohmann::json b;
    b["medium"] = std::get<0>(key);
    b["group_idx"] = std::get<1>(key) ? nlohmann::json(*std::get<1>(key)) : nlohmann::json();
    b["hash"] = std::get<2>(key);
    b["parent"] = r.parent ? nlohmann::json(*r.parent) : nlohmann::json();
    b["tokens"] = r.tokens;
    b["block_size"] = r.block_size;
    b["lora_name"] = r.lora ? nlohmann::json(*r.lora) : nlohmann::json();
    b["kv_cache_spec_kind"] = r.kind ? nlohmann::json(*r.kind) : nlohmann::json();
    b["kv_cache_spec_sliding_window"] = r.window ? nlohmann::json(*r.window) : nlohmann::json();
    dump.push_back(b);
  }
  if (FILE* f = std::fopen(argv[2], "w")) {
    const std::string text = dump.dump();
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  } else {
    return 5;
  }
  const auto st = pub.stats();
  std::cout << "DONE " << st.next_seq << " " << st.events_dropped << std::endl;
  std::getline(std::cin, line);
  return 0;
}
