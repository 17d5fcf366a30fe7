#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generates a conversation-style Mooncake trace (JSONL) for `kvport replay`.

Each line is one request: {"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}, one hash id per 512 prompt tokens
(Mooncake's block; `kvport replay --trace-block-tokens 512`), as in
tests/data/mooncake_small.jsonl. The trace is deterministic for a seed.

The reuse is that of chat sessions: every session starts with one of a few
shared system prompts; each turn's prompt is the whole conversation so far
(system prompt, earlier user messages and answers) plus a new user message, so
a turn hits on the previous turn's prompt while it is still cached. An answer
enters the next prompt under new hash ids (the replay synthesizes decode tokens
that no prompt shares). Sessions start at random times and their turns are
spread by a think time, so many conversations interleave and the cache sees
both hits and evictions.

Usage: conversation_trace.py OUT.jsonl [--requests N] [--seed S] [options]
Prints a one-line summary (requests, prompt tokens, 16-token prompt blocks) to
stderr.
"""

import argparse
import json
import random
import sys

BLOCK = 512  # tokens per hash id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output .jsonl path ('-' for stdout)")
    ap.add_argument("--requests", type=int, default=20000, help="requests in the trace")
    ap.add_argument("--seed", type=int, default=1, help="random seed")
    ap.add_argument("--system-prompts", type=int, default=16,
                    help="distinct shared system prompts")
    ap.add_argument("--max-turns", type=int, default=12, help="most turns of one session")
    ap.add_argument("--max-context-blocks", type=int, default=48,
                    help="a session ends once its prompt would exceed this many hash ids")
    ap.add_argument("--sessions-per-s", type=float, default=2.0,
                    help="mean rate at which new sessions start")
    ap.add_argument("--think-s", type=float, default=40.0,
                    help="mean time between a session's turns (exponential)")
    args = ap.parse_args()
    if args.requests <= 0 or args.system_prompts <= 0 or args.max_turns <= 0:
        ap.error("--requests, --system-prompts and --max-turns must be positive")

    rng = random.Random(args.seed)
    next_id = 0

    def new_ids(n: int) -> list:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [new_ids(rng.randint(1, 6)) for _ in range(args.system_prompts)]
    requests = []
    start_ms = 0.0
    while len(requests) < args.requests:
        start_ms += rng.expovariate(args.sessions_per_s) * 1000.0
        context = list(rng.choice(systems))
        t = start_ms
        for _ in range(rng.randint(1, args.max_turns)):
            message = new_ids(rng.randint(1, 4))
            prompt = context + message
            if len(prompt) > args.max_context_blocks:
                break
            # The last hash id covers a partial block: the prompt ends inside it.
            input_length = len(prompt) * BLOCK - rng.randrange(BLOCK)
            output_length = rng.randint(20, 600)
            requests.append((t, input_length, output_length, prompt))
            # The answer joins the conversation under ids of its own.
            context = prompt + new_ids((output_length + BLOCK - 1) // BLOCK)
            t += rng.expovariate(1.0 / args.think_s) * 1000.0 + 1000.0
    requests.sort(key=lambda r: r[0])
    requests = requests[: args.requests]

    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="ascii")
    prompt_tokens = 0
    with out:
        for t, inp, outp, ids in requests:
            prompt_tokens += inp
            out.write(json.dumps({"timestamp": int(t), "input_length": inp,
                                  "output_length": outp, "hash_ids": ids}) + "\n")
    print(f"conversation_trace: {len(requests)} requests, {prompt_tokens} prompt tokens, "
          f"{prompt_tokens // 16} prompt blocks of 16 tokens (seed {args.seed})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
