# SPDX-License-Identifier: Apache-2.0
"""KV cache events from Python: PrefixCache.enable_events and
HybridKvCache.enable_events publish vLLM's wire format over ZeroMQ. A SUB
socket (python3-zmq) receives the three frames and python3-msgpack decodes
the batches, as a router would; a DEALER asks the replay socket. Sockets bind
127.0.0.1 with ephemeral ports; every receive is bounded."""

import pytest

import kvport
from conftest import make_config

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def subscriber(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def decode(payload):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def receive(sub, timeout_ms):
    """(topic, seq, batch) of the next message, or None after timeout_ms."""
    if not sub.poll(timeout_ms):
        return None
    frames = sub.recv_multipart()
    assert len(frames) == 3, frames
    topic, seq, payload = frames
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), decode(payload)


def join(owner, sub, store):
    """A PUB socket drops what it sends before a subscription arrives: stores
    (store(round)) and flushes until a message arrives. (rounds, message)."""
    for round in range(100):
        store(round)
        assert owner.flush_events(2.0)
        message = receive(sub, 100)
        if message is not None:
            return round + 1, message
    pytest.fail("no KV event arrived in 100 rounds")


def receive_until(sub, predicate, timeout_ms=2000):
    """Messages until one whose batch has events for which predicate holds:
    (message, those events)."""
    for _ in range(100):
        message = receive(sub, timeout_ms)
        assert message is not None, "no KV event arrived"
        found = [event for event in message[2][1] if predicate(event)]
        if found:
            return message, found
    pytest.fail("the expected event did not arrive")


def low64(hash_text):
    """The event hash of a PrefixMatch hash (32 hex digits, high then low)."""
    return int(hash_text[16:], 16)


def test_prefix_cache_events_on_the_wire(context):
    with kvport.PagedKvCache(make_config(), num_blocks=64) as cache, \
            kvport.PrefixCache(cache) as prefix:
        assert not prefix.events_enabled and prefix.events_endpoint is None
        with pytest.raises(kvport.InvalidArgument, match="not enabled"):
            prefix.events_stats()
        with pytest.raises(kvport.InvalidArgument, match="not enabled"):
            prefix.flush_events()
        prefix.disable_events()  # nothing to disable

        prefix.enable_events("tcp://127.0.0.1:0", topic="kv@pod-0@model", data_parallel_rank=2,
                             batch_interval=0.001)
        assert prefix.events_enabled
        endpoint = prefix.events_endpoint
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        assert prefix.events_replay_endpoint is None
        with pytest.raises(kvport.InvalidArgument, match="enabled already"):
            prefix.enable_events("tcp://127.0.0.1:0")

        sub = subscriber(context, endpoint)

        def store(round):
            with kvport.BlockTable(prefix) as t:
                t.append_tokens(range(1000 + 4 * round, 1004 + 4 * round))

        rounds, (topic, joined_seq, _) = join(prefix, sub, store)
        assert topic == b"kv@pod-0@model"

        # One table of two blocks: one BlockStored with both.
        with kvport.BlockTable(prefix) as t:
            t.append_tokens(range(100, 108))
            assert prefix.flush_events(2.0)
            topic, seq, batch = receive(sub, 2000)
        assert topic == b"kv@pod-0@model" and seq == joined_seq + 1
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 1.5e9 and rank == 2
        assert len(events) == 1
        e = events[0]
        assert e["type"] == "BlockStored"
        assert e["block_size"] == 4 and e["medium"] == "GPU"
        assert e["token_ids"] == list(range(100, 108))
        assert e["parent_block_hash"] is None
        assert e["lora_id"] is None and e["extra_keys"] is None
        assert e["group_idx"] is None and e["kv_cache_spec_kind"] is None
        hashes = e["block_hashes"]
        assert len(hashes) == 2 and all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        # The low 64 bits of the prefix cache's own block hashes.
        match = prefix.lookup(range(100, 108))
        assert [low64(h) for h in match.hashes] == hashes
        prefix.release_blocks(match.blocks)

        stats = prefix.events_stats()
        assert isinstance(stats, kvport.EventPublisherStats)
        assert stats.events_dropped == 0 and stats.send_failures == 0
        assert stats.events_accepted == rounds + 1 and stats.next_seq == seq + 1
        assert stats.batches_sent == stats.next_seq
        assert "events_accepted=" in repr(stats)

        # Eviction: BlockRemoved of those hashes.
        assert prefix.evict(1000) == rounds + 2 and prefix.num_cached_blocks == 0
        removed = set()
        while not set(hashes) <= removed:
            _, found = receive_until(sub, lambda ev: ev["type"] == "BlockRemoved")
            for event in found:
                assert event["medium"] == "GPU" and event["group_idx"] is None
                removed.update(event["block_hashes"])

        # Disable: AllBlocksCleared, then nothing is enabled.
        prefix.disable_events()
        _, (event,) = receive_until(sub, lambda ev: ev["type"] == "AllBlocksCleared")
        assert event["medium"] == "GPU"
        assert not prefix.events_enabled and prefix.events_endpoint is None
        with pytest.raises(kvport.InvalidArgument):
            prefix.events_stats()


def test_positional_form_and_replay(context):
    with kvport.PagedKvCache(make_config(), num_blocks=16) as cache, \
            kvport.PrefixCache(cache) as prefix:
        with kvport.BlockTable(prefix) as t:
            t.append_tokens(range(4))  # cached before events are on: announced by enable
        prefix.enable_events("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                             form="positional")
        replay = prefix.events_replay_endpoint
        assert replay.startswith("tcp://127.0.0.1:") and replay != prefix.events_endpoint
        with kvport.BlockTable(prefix) as t:
            t.append_tokens(range(10, 18))
        assert prefix.flush_events(2.0)

        # Replay from 0 (vLLM's protocol): every kept batch, then [-1, b""].
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events = []
        for _ in range(100):
            assert dealer.poll(2000)
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == b"\xff" * 8:
                assert payload == b""
                break
            ts, batch_events, rank = decode(payload)
            assert rank is None
            events.extend(batch_events)
        assert prefix.events_stats().replay_requests == 1
        stored = [e for e in events if e[0] == "BlockStored"]
        assert len(stored) == 2
        # ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
        #  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, window]
        assert all(len(e) == 12 for e in stored)
        before, table = stored
        assert len(before[1]) == 1 and before[3] == [] and before[4] == 4
        assert table[2] is None and table[3] == list(range(10, 18)) and len(table[1]) == 2
        assert table[6] == "GPU" and table[9] is None
        dealer.close()
        prefix.disable_events()


def test_the_publisher_lives_with_the_prefix_cache(context):
    cache = kvport.PagedKvCache(make_config(), num_blocks=16)
    prefix = kvport.PrefixCache(cache)
    prefix.enable_events("tcp://127.0.0.1:0", batch_interval=0.001)
    sub = subscriber(context, prefix.events_endpoint)
    table = kvport.BlockTable(prefix)

    def store(round):
        table.append_tokens(range(4 * round, 4 * round + 4))

    join(prefix, sub, store)
    # The Python objects go; the table keeps the prefix cache and its
    # publisher: its blocks are still announced.
    prefix.close()
    cache.close()
    table.append_tokens(range(5000, 5004))
    receive_until(sub, lambda ev: ev["type"] == "BlockStored"
                  and ev["token_ids"] == list(range(5000, 5004)))
    # The last owner goes: the prefix cache announces its clear, then the
    # publisher sends it as it shuts down.
    table.close()
    del table
    _, (event,) = receive_until(sub, lambda ev: ev["type"] == "AllBlocksCleared")
    assert event["medium"] == "GPU"


def test_bad_options_raise_invalid_argument():
    with kvport.PagedKvCache(make_config(), num_blocks=8) as cache, \
            kvport.PrefixCache(cache) as prefix:
        for endpoint in ["", "not-an-endpoint", "tcp://127.0.0.1:notaport"]:
            with pytest.raises(kvport.InvalidArgument):
                prefix.enable_events(endpoint)
        with pytest.raises(kvport.InvalidArgument, match="unknown form 'json'"):
            prefix.enable_events("tcp://127.0.0.1:0", form="json")
        with pytest.raises(kvport.InvalidArgument, match="batch_interval"):
            prefix.enable_events("tcp://127.0.0.1:0", batch_interval=-1.0)
        with pytest.raises(kvport.InvalidArgument, match="linger"):
            prefix.enable_events("tcp://127.0.0.1:0", linger=float("nan"))
        with pytest.raises(kvport.InvalidArgument):
            prefix.enable_events("tcp://127.0.0.1:0", max_batch_events=0)
        with pytest.raises(kvport.InvalidArgument):
            prefix.enable_events("tcp://127.0.0.1:0", replay_endpoint="tcp://nowhere:")
        assert not prefix.events_enabled

        # A port in use.
        prefix.enable_events("tcp://127.0.0.1:0")
        with kvport.PagedKvCache(make_config(), num_blocks=8) as other_cache, \
                kvport.PrefixCache(other_cache) as other:
            with pytest.raises(kvport.InvalidArgument, match="cannot bind"):
                other.enable_events(prefix.events_endpoint)
            assert not other.events_enabled
        with pytest.raises(kvport.InvalidArgument, match="timeout"):
            prefix.flush_events(-1)
        prefix.disable_events()


def test_hybrid_cache_events_carry_the_groups(context):
    window = 8
    layers = [kvport.LayerSpec.sliding_window(window, 2, 16),
              kvport.LayerSpec.full_attention(2, 16)]
    with kvport.HybridKvCache(layers, [32, 32], block_size=4) as cache:
        assert not cache.events_enabled
        with pytest.raises(kvport.InvalidArgument):
            cache.events_stats()
        with pytest.raises(kvport.InvalidArgument):
            cache.enable_events("not-an-endpoint")
        cache.enable_events("tcp://127.0.0.1:0", batch_interval=0.001)
        with pytest.raises(kvport.InvalidArgument, match="enabled already"):
            cache.enable_events("tcp://127.0.0.1:0")
        sub = subscriber(context, cache.events_endpoint)

        def store(round):
            with kvport.HybridBlockTable(cache) as t:
                t.append_tokens(range(4 * round, 4 * round + 4))

        join(cache, sub, store)
        stored_tokens = [900, 901, 902, 903]
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(stored_tokens)
            assert cache.flush_events(2.0)
            groups = {}
            while len(groups) < 2:
                message = receive(sub, 2000)
                assert message is not None, "no KV event arrived"
                for event in message[2][1]:
                    if event["type"] == "BlockStored" and event["token_ids"] == stored_tokens:
                        groups[event["group_idx"]] = event
        assert groups[0]["kv_cache_spec_kind"] == "sliding_window"
        assert groups[0]["kv_cache_spec_sliding_window"] == window
        assert groups[1]["kv_cache_spec_kind"] == "full_attention"
        assert groups[1]["kv_cache_spec_sliding_window"] is None
        # Both groups hash the same tokens the same way.
        assert groups[0]["block_hashes"] == groups[1]["block_hashes"]
        assert all(g["medium"] == "GPU" and g["block_size"] == 4 for g in groups.values())
        assert cache.events_stats().events_dropped == 0

        cache.disable_events()
        cleared = set()
        while len(cleared) < 2:
            message = receive(sub, 2000)
            assert message is not None, "no KV event arrived"
            cleared.update(e["group_idx"] for e in message[2][1] if e["type"] == "AllBlocksCleared")
        assert cleared == {0, 1}
        assert not cache.events_enabled
        # On again, then the cache is closed with events on.
        cache.enable_events("tcp://127.0.0.1:0")
