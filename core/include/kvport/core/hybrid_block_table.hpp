// SPDX-License-Identifier: Apache-2.0
// HybridBlockTable: one sequence over every KV cache group of a HybridKvCache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/block_id.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/prefix_hit_mode.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

/// A sequence's blocks in every group: one block list per block group
/// (full attention, MLA, sliding window, chunked), with kNullBlock entries
/// where blocks were released, and one state slot per state group.
///
/// Freeing rules (docs/hybrid-models.md), applied at the start of each
/// append, when the tokens appended before have been computed:
///  - sliding window W: every block wholly before token n - W + 1 (n: tokens
///    held) is released and its entry becomes kNullBlock;
///  - chunked C: every block before the chunk of token n is released;
///  - a released block that was full goes back to its group's prefix cache
///    with its hash kept (evictable, still hittable by other requests),
///    demoted (PrefixCache::release_demoted: evicted before the blocks
///    released otherwise).
///
/// State: the sequence's working state lives in one slot per state group,
/// zeroed when it is first allocated; the engine updates it in place. At an
/// append that starts at a multiple of state_checkpoint_interval blocks, the
/// working state (which then holds the state after those tokens: the engine
/// has computed everything appended before) is copied into a fresh slot that
/// is cached under the hash of the last full block, one batched copy per
/// group, in the prefix cache's LRU like any block. Checkpoints are
/// best-effort: with no slot free or evictable, none is taken.
///
/// Every block and hash is the table's. A model of one full-attention group
/// is the one-group case: BlockTable is this table over
/// HybridKvCache::over(a prefix cache, or a plain PagedKvCache) with
/// set_copy_last_block(true). Over one full-attention (or MLA) group the hit
/// is the cached chain of one lookup (a lower tier extends it), and one new
/// block's hashes are computed once, by extend_chain_hashes, for every group.
///
/// Not thread-safe. The cache must outlive the table; the destructor releases
/// everything.
class HybridBlockTable {
 public:
  /// An empty table; `extra_key` goes into every block hash (as BlockTable's).
  explicit HybridBlockTable(HybridKvCache& cache, std::uint64_t extra_key = 0);
  ~HybridBlockTable();
  HybridBlockTable(const HybridBlockTable&) = delete;
  HybridBlockTable& operator=(const HybridBlockTable&) = delete;
  HybridBlockTable(HybridBlockTable&& other) noexcept;
  HybridBlockTable& operator=(HybridBlockTable&& other) noexcept;

  /// Starts an empty table from the longest cached prefix of `prompt` valid
  /// for every group (find_hybrid_hit: full attention needs the chain from
  /// block 0; a window group the blocks covering the W - 1 tokens before the
  /// hit point; a chunked group the hit point's chunk; a state group a cached
  /// state at exactly the hit point) and returns how many tokens it covers.
  /// Entries before what a group needs are kNullBlock; a state group's
  /// working slot gets a copy of the checkpoint (one copy on `stream`; with no
  /// slot to copy into the hit is 0 tokens).
  ///
  /// compute_last_token (the default): the hit covers at most
  /// prompt.size() - 1 tokens, in whole blocks (vLLM's rule; the single-group
  /// BlockTable instead copies the last block to hit n - 1 tokens exactly,
  /// which a state group cannot do: its state exists at block boundaries
  /// only). full: every full block may hit.
  ///
  /// Throws InvalidArgument when the table is not empty; a backend error of
  /// the state copy propagates with the strong guarantee.
  std::size_t reuse_cached_prefix(std::span<const TokenId> prompt, StreamView stream);

  /// A table holding `tokens` whose KV is already in `blocks` (pulled from
  /// another process: HybridDecodeNode's result), so that decoding goes on
  /// from there. The caller's one reference on every block passes to the
  /// table. blocks[g] for a block group: the blocks of positions
  /// [first_blocks[g], ceil(n / bs)) (entries before are kNullBlock), with
  /// first_blocks[g] <= the group's first_needed_block at n; for a state
  /// group: one slot holding the state after `tokens` (first_blocks[g] 0).
  /// A state slot the group's prefix cache holds (a checkpoint) is copied
  /// into a fresh working slot on `stream` and its reference released; an
  /// uncached one becomes the working slot. Full blocks keep whatever prefix
  /// cache entries they have. Throws InvalidArgument (nothing taken) for
  /// counts that do not match, no tokens, an id out of range or free, or a
  /// first block past what the next token needs; CacheExhausted (nothing
  /// taken) when a checkpoint needs a working slot and none is free or
  /// evictable.
  static HybridBlockTable adopt(HybridKvCache& cache, std::span<const TokenId> tokens,
                                std::span<const std::vector<BlockId>> blocks,
                                std::span<const std::size_t> first_blocks, StreamView stream,
                                std::uint64_t extra_key = 0);

  PrefixHitMode prefix_hit_mode() const noexcept { return hit_mode_; }
  void set_prefix_hit_mode(PrefixHitMode mode) noexcept { hit_mode_ = mode; }

  /// BlockTable's compute_last_token rule, as an option (off by default):
  /// with compute_last_token, a block-aligned prompt of n tokens whose every
  /// block each group needs is cached on the device hits n - 1 tokens
  /// instead of n - block_size: the last block of every group is copied into
  /// a fresh block (one batched copy of all its layers per group, on the
  /// call's stream; copy_on_writes counts each), the table holds the copies
  /// with block_size - 1 tokens in them, and the cached blocks stay
  /// untouched. Applies where every group allows it: not with a state group
  /// (a state exists at block boundaries only), nor with a lower tier under
  /// some group of a cache of several groups (over one full-attention or MLA
  /// group the lower tier's blocks come in first and the last is copied as a
  /// device one), nor with block size 1; there, and when some group has no
  /// free or evictable block for its copy, the hit stops before the last
  /// block (the default rule's hit).
  /// Copied by fork and moves; release() keeps it.
  bool copies_last_block() const noexcept { return copy_last_; }
  void set_copy_last_block(bool copy) noexcept { copy_last_ = copy; }

  /// Whether the table keeps the sliding-window blocks before the end of the
  /// cached prefix its lookup found (see keep_hit_point), off by default.
  /// Kept blocks are held (blocks_in_use counts them) but are in no block
  /// list; num_kept_blocks tells how many. Copied by fork.
  bool keeps_shared_windows() const noexcept { return keep_shared_; }
  void set_keep_shared_windows(bool keep) noexcept { keep_shared_ = keep; }

  /// The extra references keep_hit_point and the shared-window rule hold in
  /// group g (a block may be counted twice: kept at both points).
  std::size_t num_kept_blocks(std::size_t g) const;

  /// Blocks (slots) appending `num_tokens` needs in each group, net of the
  /// blocks the freeing rules release first (which come back to the group
  /// when no other sequence holds them): what admission checks. One entry per
  /// group; a state group needs 1 when the table has no working slot yet.
  /// Checkpoint slots are not counted (they are best-effort).
  struct GroupNeed {
    std::size_t fresh = 0;     ///< blocks (slots) to allocate
    std::size_t released = 0;  ///< blocks the freeing rules give back to the group first
  };
  std::vector<GroupNeed> blocks_needed(std::size_t num_tokens) const;

  /// Whether append_tokens(num_tokens tokens) would find every block it
  /// needs in every group (free or evictable, counting what it releases);
  /// the groups of a shared pool together in that pool.
  bool can_append(std::size_t num_tokens) const;

  /// Appends `tokens` in every group: applies the freeing rules, takes a
  /// state checkpoint when due, fills the last block (copying it first when
  /// it is shared: copy-on-write, one batched copy per group), allocates the
  /// blocks needed and registers full blocks in every group's prefix cache.
  /// All or nothing: when some group lacks blocks it throws CacheExhausted
  /// naming the group before any change. A backend error of a copy also
  /// leaves the table as it was, except that blocks the freeing rules
  /// released to make room stay released (they were no longer part of the
  /// sequence's span).
  void append_tokens(std::span<const TokenId> tokens, StreamView stream);

  // ---- speculative decoding ------------------------------------------------------------
  //
  // A step that verifies k drafted tokens: append_draft(k drafts) gives them
  // KV slots (the verifier writes their KV), commit(a) keeps the a accepted,
  // truncate(num_committed()) drops the rest, and append_tokens(bonus)
  // continues. Only committed tokens are hashed, registered in the prefix
  // caches and announced, so no other request ever hits a rejected token's
  // KV; the freeing rules run on the committed length, so a rollback never
  // needs a block the table gave back (docs/hybrid-models.md, "Speculative
  // decoding").

  /// Appends `tokens` as draft tokens after every token the table holds:
  /// their blocks are allocated (a shared last block copied first) as
  /// append_tokens allocates, all or nothing (CacheExhausted names the
  /// group; can_append_draft counts the same), but nothing is hashed,
  /// registered or announced, and the freeing rules see the committed
  /// length only. A state group gets one slot per draft token
  /// (draft_state_slots: the verifier writes the state after each draft
  /// there) beside the working state, which stays the state after the
  /// committed tokens. Several calls add up.
  void append_draft(std::span<const TokenId> tokens, StreamView stream);
  /// Whether append_draft(num_tokens tokens) would find every block and
  /// state slot it needs (can_append counts no state slots for drafts).
  bool can_append_draft(std::size_t num_tokens) const;
  /// Commits the first `n` draft tokens (those the verifier accepted): their
  /// full blocks are hashed and registered in every group's prefix cache
  /// (announced), as append_tokens registers. In a state group the state
  /// after the n-th draft becomes the working state (its slot: no copy) and
  /// the working slot before it is given back; the state after a draft that
  /// ends a checkpoint interval is kept as that checkpoint (cached, no copy).
  /// InvalidArgument when `n` exceeds num_draft_tokens(); std::bad_alloc
  /// leaves the table as it was.
  void commit(std::size_t n);
  /// Keeps the first `n` tokens: the draft tokens past `n` are dropped
  /// (rejected) and the blocks wholly past token n, which only they used, are
  /// freed (never registered: nothing another request could see is undone).
  /// InvalidArgument when n < num_committed() (committed tokens are never
  /// taken back) or n > num_tokens().
  void truncate(std::size_t n);
  /// Tokens committed: num_tokens() less the draft tokens.
  std::size_t num_committed() const noexcept { return tokens_.size(); }
  /// Draft tokens held (appended by append_draft, not committed or dropped).
  std::size_t num_draft_tokens() const noexcept { return draft_.size(); }
  /// The draft tokens, after tokens().
  std::span<const TokenId> draft_tokens() const noexcept { return draft_; }
  /// State group g's slots for the state after each draft token (the i-th
  /// holds the state after draft_tokens()[i], written by the verifier);
  /// empty for other groups. OutOfRange out of range.
  std::span<const BlockId> draft_state_slots(std::size_t g) const;

  /// Keeps, until release(), the blocks every sliding-window group needs for
  /// a later request to hit at the table's last full block (the end of the
  /// prompt, when called after prefill: the next turn of a conversation hits
  /// there): one more reference on each, so that the freeing rules drop them
  /// from the table's lists but they are not evictable while the sequence
  /// runs (they would otherwise be among the first evicted, and the
  /// full-attention chain before them, which the table holds, could not be
  /// hit). At most a window's blocks per group; nothing for other kinds
  /// (full attention and MLA are held anyway; a chunk's blocks cost too much
  /// to keep). Calling it again moves the kept point. Best-effort: out of
  /// memory (or a refcount at its limit) keeps nothing. Released with the
  /// table.
  ///
  /// With set_keep_shared_windows(true) the table does the same by itself at
  /// the end of the cached prefix its lookup found (reuse_cached_prefix: the
  /// hit, or where the full-attention chain ended when a window block was
  /// missing), once the table reaches that point: other requests sharing
  /// the prefix hit there.
  void keep_hit_point() noexcept;

  /// A table sharing every live block (one reference each) with the same
  /// tokens; each state group's working state is copied into a new slot on
  /// `stream`. Throws CacheExhausted (strong guarantee) when a state group
  /// has no slot for the copy, InvalidArgument while the table holds draft
  /// tokens (commit or truncate them first).
  HybridBlockTable fork(StreamView stream) const;

  /// Releases every block and slot: the live blocks last position first over
  /// every group (so that the LRU evicts a sequence's tail first, as
  /// BlockTable's, whichever group a block is in), then the kept windows
  /// (keep_hit_point), which join the LRU last.
  void release() noexcept;

  /// Group g's block list (kNullBlock where released); empty for a state
  /// group. OutOfRange out of range.
  std::span<const BlockId> blocks(std::size_t g) const;
  /// Live (non-null) blocks of group g.
  std::size_t num_live_blocks(std::size_t g) const;
  /// Group g's working state slot, or nullopt (no state yet, or not a state
  /// group).
  std::optional<BlockId> state_slot(std::size_t g) const;

  /// The committed tokens (draft_tokens() follow them).
  std::span<const TokenId> tokens() const noexcept { return tokens_; }
  /// Every token the table holds KV slots for: committed and draft.
  std::size_t num_tokens() const noexcept { return tokens_.size() + draft_.size(); }
  bool empty() const noexcept { return num_tokens() == 0; }
  HybridKvCache& cache() const noexcept { return *cache_; }
  /// Copy-on-write copies (every group) this table made.
  std::uint64_t copy_on_writes() const noexcept { return copy_on_writes_; }

  /// Empty when consistent: each attention group holds one entry per block
  /// of num_tokens(), no entry before its first live one is live, and no
  /// block that holds a draft token (or is not yet full of committed tokens)
  /// is cached in its prefix cache, so no other request can hit it. O(blocks).
  InvariantReport check_invariants() const;

 private:
  friend class BlockTable;  // the one-group case: group_blocks(0) on its hot path
  struct Group {
    std::vector<BlockId> blocks;        // block groups; kNullBlock where released
    std::size_t live_begin = 0;         // entries before it are all null
    std::vector<BlockId> kept_end;      // keep_hit_point()'s references
    std::vector<BlockId> kept_hit;      // the window before the lookup's hit
    std::optional<BlockId> state;       // state groups: the working slot
    std::vector<BlockId> draft_states;  // state groups: the state after each draft token
  };
  struct Plan;

  // The shared pool's side of a plan: what its groups need together, what
  // it has, what their freeing rules give back.
  struct PoolNeed {
    std::size_t needed = 0;
    std::size_t available = 0;
    std::size_t releasable = 0;
  };

  Plan plan_append(std::size_t num_tokens, bool draft = false) const;
  // append_tokens (committed) and append_draft (`draft`).
  void append(std::span<const TokenId> tokens, StreamView stream, bool draft);
  // Whether plan_append(num_tokens, draft) finds every block it needs.
  bool plan_fits(std::size_t num_tokens, bool draft) const;
  // InvalidArgument naming `call` while the table holds draft tokens.
  void require_no_drafts(const char* call) const;
  // Replaces `into` (group g's kept references) with one more reference on
  // each live block g needs for a hit ending at block `end_block`; none for
  // full attention, MLA and state. Keeps nothing when that fails.
  void keep_window(std::size_t g, std::size_t end_block, std::vector<BlockId>& into) noexcept;
  // Gives back group g's kept references (last first) and empties `kept`.
  void release_kept(std::size_t g, std::vector<BlockId>& kept) noexcept;
  // keep_window at keep_at_ (the end of the prompt's cached prefix, in
  // blocks) once the table reaches it; then keep_at_ = 0.
  // Releases every group's blocks in `taken` (per group, last first) and
  // empties the lists.
  void release_taken(std::span<std::vector<BlockId>> taken) noexcept;
  // Reserves what committing a hit of `blocks` blocks and `tokens` tokens
  // fills, so that the commit cannot throw; on bad_alloc the (empty) table's
  // groups are reset and it rethrows.
  void reserve_hit(std::size_t blocks, std::size_t tokens);
  // Group g starts at a hit: `first` null entries, then `blocks` (the
  // caller reserved the room).
  void place_hit(std::size_t g, std::size_t first, std::span<const BlockId> blocks) noexcept;
  // reuse_cached_prefix's copy_last_ rule: the hit of n - 1 tokens of a
  // block-aligned `prompt` (`hashes`: its full blocks' hashes); 0, with
  // nothing taken, when the rule does not apply or a copy has no block.
  std::size_t reuse_copying_last_block(std::span<const TokenId> prompt,
                                       std::span<const BlockHash> hashes, StreamView stream);
  // reuse_cached_prefix over one full-attention (or MLA) group: the
  // cached chain is the hit, one lookup (a lower tier extends it), and
  // copy_last_'s copy works with a lower tier too.
  std::size_t reuse_one_group(std::span<const TokenId> prompt, StreamView stream);
  void keep_shared_point() noexcept;
  PoolNeed shared_need(const Plan& plan) const;
  // The first group whose pool lacks blocks for `plan` (num_groups: none).
  std::size_t short_group(const Plan& plan, const PoolNeed& shared) const;
  bool fits_in_place(std::size_t num_tokens, bool draft = false) const;
  // A state checkpoint is due at the current token count (a multiple of the
  // interval in blocks, not taken yet).
  bool checkpoint_due() const noexcept;
  void remember_prompt(std::span<const TokenId> prompt);
  void forget_prompt() noexcept;
  void register_full_blocks() noexcept;
  // commit's state groups: the state after the last of the `n` drafts
  // committed after `before` tokens becomes the working state; those at a
  // checkpoint's position are cached as checkpoints; the rest are freed.
  void commit_states(std::size_t before, std::size_t n) noexcept;
  // Caches state slot `slot` of group g as the checkpoint after block k
  // (under hashes_[k], announced with its origin); false when the index had
  // no room (no checkpoint).
  bool cache_checkpoint(std::size_t g, std::size_t k, BlockId slot) noexcept;
  void release_before(std::size_t g, std::size_t first) noexcept;
  // PrefixCache::release (release_demoted with `demoted`; free_block over a
  // plain cache) that never throws.
  void release_block(std::size_t g, BlockId block, bool demoted = false) noexcept;
  // blocks_needed(num_tokens)[g].fresh, without the vector.
  std::size_t group_needed(std::size_t g, std::size_t num_tokens) const;
  // Group g's block list, unchecked.
  std::span<const BlockId> group_blocks(std::size_t g) const noexcept { return groups_[g].blocks; }
  // Group g's pool and prefix cache (nullptr over a plain cache), unchecked.
  PagedKvCache& pool_at(std::size_t g) const noexcept { return *cache_->pool_at_[g]; }
  PrefixCache* prefix_at(std::size_t g) const noexcept { return cache_->prefix_at_[g]; }
  // Blocks group g can allocate (free, or evictable); one of them.
  std::size_t available_in(std::size_t g) const noexcept;
  BlockId alloc_in(std::size_t g);

  HybridKvCache* cache_;
  std::uint64_t extra_key_ = 0;
  std::size_t block_size_ = 0;
  std::vector<Group> groups_;
  std::vector<TokenId> tokens_;    // committed
  std::vector<TokenId> draft_;     // append_draft's, after tokens_
  std::vector<BlockHash> hashes_;  // chained hashes of every full committed block
  // The prompt reuse_cached_prefix looked up and its full blocks' hashes:
  // register_full_blocks takes them while the appended tokens are the
  // prompt's, instead of hashing again; dropped at the first difference or
  // once used up.
  std::vector<TokenId> prompt_;
  std::vector<BlockHash> prompt_hashes_;
  std::size_t checkpointed_at_ = 0;  // tokens at the last checkpoint (0: none)
  std::size_t keep_at_ = 0;          // keep_shared_point's block (0: none pending)
  bool keep_shared_ = false;         // set_keep_shared_windows
  std::uint64_t copy_on_writes_ = 0;
  PrefixHitMode hit_mode_ = PrefixHitMode::compute_last_token;
  bool copy_last_ = false;
};

}  // namespace kvport
