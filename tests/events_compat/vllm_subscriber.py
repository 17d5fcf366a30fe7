# SPDX-License-Identifier: Apache-2.0
"""An independent consumer of kvport's KV events, written from vLLM's
published message structure (vllm/distributed/kv_events.py and its example
subscriber), not from kvport's C++ decoder.

Runs the driver (argv[1]) in the given form (argv[2]: map or positional),
subscribes to its PUB socket, fetches what the slow joiner missed from the
replay socket (deduplicating by sequence, as vLLM's consumers do), checks
every field's type, rebuilds the cached set and compares it with the driver's
own dump; then asks for a snapshot and compares that too.

Exits 77 (ctest: skipped) when python3-zmq or python3-msgpack is missing.
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import msgpack
    import zmq
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e} (apt-get install python3-zmq python3-msgpack)")
    sys.exit(77)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_MS = 5000
LIVE_TIMEOUT_MS = 1000  # after DONE: what has not come by then is replayed

# vLLM's field order for the positional (array_like, tagged) structs.
FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    # vLLM's AllBlocksCleared has no fields; kvport may add medium and
    # group_idx (a tier or group cleared alone).
    "AllBlocksCleared": ["medium", "group_idx"],
}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def as_event(raw):
    if isinstance(raw, dict):
        ev = dict(raw)
        tag = ev.pop("type", None)
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        ev = dict(zip(FIELDS.get(tag, []), raw[1:]))
    else:
        fail(f"event neither map nor array: {raw!r}")
    return tag, ev


def decode_batch(payload):
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, events, rank = batch["ts"], batch["events"], batch.get("data_parallel_rank")
    else:
        ts, events, rank = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    if not isinstance(ts, float):
        fail(f"ts not a float: {ts!r}")
    if rank is not None and not isinstance(rank, int):
        fail(f"data_parallel_rank: {rank!r}")
    return [as_event(e) for e in events]


def is_u64(x):
    return isinstance(x, int) and 0 <= x < 2**64


def check_stored(ev):
    hashes, tokens, bs = ev["block_hashes"], ev["token_ids"], ev["block_size"]
    if not hashes or not all(is_u64(h) for h in hashes):
        fail(f"block_hashes: {hashes!r}")
    if not isinstance(bs, int) or bs <= 0 or len(tokens) != len(hashes) * bs:
        fail(f"block_size {bs!r} with {len(tokens)} tokens for {len(hashes)} blocks")
    if not all(isinstance(t, int) and t >= 0 for t in tokens):
        fail("token_ids not ints")
    parent = ev.get("parent_block_hash")
    if parent is not None and not is_u64(parent):
        fail(f"parent_block_hash: {parent!r}")
    if not isinstance(ev.get("medium"), str):
        fail(f"medium: {ev.get('medium')!r}")
    for k in ("lora_name", "kv_cache_spec_kind"):
        if ev.get(k) is not None and not isinstance(ev[k], str):
            fail(f"{k}: {ev[k]!r}")
    for k in ("group_idx", "kv_cache_spec_sliding_window"):
        if ev.get(k) is not None and not isinstance(ev[k], int):
            fail(f"{k}: {ev[k]!r}")
    if ev.get("lora_id") is not None or ev.get("extra_keys") is not None:
        fail("lora_id/extra_keys should be nil")


def apply(state, tag, ev):
    if tag == "BlockStored":
        check_stored(ev)
        bs = ev["block_size"]
        for i, h in enumerate(ev["block_hashes"]):
            parent = ev.get("parent_block_hash") if i == 0 else ev["block_hashes"][i - 1]
            state[(ev["medium"], ev.get("group_idx"), h)] = (
                parent, tuple(ev["token_ids"][i * bs:(i + 1) * bs]), bs, ev.get("lora_name"),
                ev.get("kv_cache_spec_kind"), ev.get("kv_cache_spec_sliding_window"))
    elif tag == "BlockRemoved":
        for h in ev["block_hashes"]:
            state.pop((ev["medium"], ev.get("group_idx"), h), None)
    elif tag == "AllBlocksCleared":
        medium, group = ev.get("medium"), ev.get("group_idx")
        for key in [k for k in state
                    if (medium is None or k[0] == medium) and (group is None or k[1] == group)]:
            del state[key]
    else:
        fail(f"unknown event type {tag!r}")


def replay(ctx, endpoint, request):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.connect(endpoint)
    sock.send_multipart([b"", request])
    out = []
    while True:
        frames = sock.recv_multipart()
        if len(frames) != 3 or frames[0] != b"":
            fail(f"replay reply frames: {len(frames)}")
        if frames[1] == END_SEQ:
            break
        out.append((int.from_bytes(frames[1], "big"), frames[2]))
    sock.close()
    return out


def main():
    driver, form = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        dump_path = os.path.join(tmp, "dump.json")
        proc = subprocess.Popen([driver, form, dump_path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            run(proc, dump_path)
        finally:
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                    proc.wait(timeout=10)
                except Exception:
                    proc.kill()
                    proc.wait()


def run(proc, dump_path):
    words = proc.stdout.readline().split()
    if len(words) != 3 or words[0] != "ENDPOINTS":
        fail(f"driver said {words!r}")
    pub_ep, replay_ep = words[1], words[2]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, LIVE_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvport")
    sub.connect(pub_ep)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    done = proc.stdout.readline().split()
    if len(done) != 3 or done[0] != "DONE":
        fail(f"driver said {done!r}")
    total, dropped = int(done[1]), int(done[2])
    if dropped:
        fail(f"driver dropped {dropped} events")

    batches = {}
    last = -1
    while last < total - 1:
        try:
            topic, seq_bytes, payload = sub.recv_multipart()
        except zmq.Again:
            break  # the rest comes from the replay socket
        if topic != b"kvport" or len(seq_bytes) != 8:
            fail("frames")
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= last:
            fail(f"sequence went back: {seq} after {last}")
        batches[seq] = payload
        last = seq
    live = len(batches)
    missing = [s for s in range(total) if s not in batches]
    if missing:
        for seq, payload in replay(ctx, replay_ep, min(missing).to_bytes(8, "big")):
            batches.setdefault(seq, payload)  # at least once: dedupe by seq
    if sorted(batches) != list(range(total)):
        fail(f"sequences not contiguous from 0: have {len(batches)} of {total}")

    state = {}
    for seq in range(total):
        for tag, ev in decode_batch(batches[seq]):
            apply(state, tag, ev)

    with open(dump_path) as f:
        dump = json.load(f)
    expected = {(b["medium"], b["group_idx"], b["hash"]): (
        b["parent"], tuple(b["tokens"]), b["block_size"], b["lora_name"],
        b["kv_cache_spec_kind"], b["kv_cache_spec_sliding_window"]) for b in dump}
    if state != expected:
        only_ours = set(state) - set(expected)
        only_dump = set(expected) - set(state)
        fail(f"rebuilt set differs: {len(state)} vs {len(expected)} blocks, "
             f"{len(only_ours)} only here, {len(only_dump)} only in the dump")

    snap = replay(ctx, replay_ep, b"kvport.snapshot")
    if len(snap) != 1 or snap[0][0] != total:
        fail(f"snapshot: {[(s, len(p)) for s, p in snap]}")
    snap_state = {}
    for tag, ev in decode_batch(snap[0][1]):
        apply(snap_state, tag, ev)
    if snap_state != expected:
        fail("snapshot differs from the dump")
    print(f"OK: {total} batches ({live} live, {total - live} replayed), "
          f"{len(expected)} blocks rebuilt equal to the dump and to the snapshot")
    sub.close()
    ctx.term()


if __name__ == "__main__":
    main()
