"""A long conversation comes back after others used the server: restore from the conversation cache vs read again.

The seeds' 150K-token conversations scaled to this machine: one conversation of --tokens
(default 32K) is read and answered, --others conversations of --other-tokens each use the
engine after it, then the first returns with a new user turn. Measured: time to first token
of that turn with the conversation cache (restore) and without it (full re-read), bytes per
parked token for each KV store (f32, f16, int8), and how many such conversations fit in 1 GiB.

    python bench/make_model.py --type Q8_0 --layers 4 --hidden 512 --experts 16 --top-k 4 --moe-ff 256 \\
        --heads 8 --kv-heads 2 --head-dim 64 --context 65536 -o /tmp/conv-bench.gguf
    python bench/conversation_cache.py --model /tmp/conv-bench.gguf --tokens 32768
"""
import argparse
import logging
import os
import sys
import time
from datetime import datetime, timezone

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.conversation_cache import ConversationCache, model_fingerprint  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.kv_store import STORES, bytes_per_token  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from hybrid.request import Request  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402

GIB = 1 << 30
QWEN3_30B_KV = (48, 4, 128)  # layers, kv heads, head dim of Qwen3-30B-A3B


def ask(engine, ids, max_tokens=8):
    """Submit greedily; returns (result, seconds to the first token)."""
    sent = time.perf_counter()
    handle = engine.submit(Request(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             ignore_eos=True)))
    first = None
    for event in handle:
        if first is None:
            first = time.perf_counter() - sent
    return event, first


def returning_turn(llm, store, args, rng):
    """TTFT of the returning turn with a conversation cache storing `store` (None: no cache)."""
    cache = None if store is None else ConversationCache(GIB, model_fingerprint(llm.weights), store=store)
    engine = Engine(llm, num_slots=1, conversation_cache=cache).start()
    try:
        history = rng.integers(0, llm.config.vocab_size, args.tokens).tolist()
        first, first_ttft = ask(engine, history)
        for _ in range(args.others):
            ask(engine, rng.integers(0, llm.config.vocab_size, args.other_tokens).tolist())
        turn = history + first.token_ids + rng.integers(0, llm.config.vocab_size, args.new_tokens).tolist()
        again, ttft = ask(engine, turn)
        return {"first_read_s": first_ttft, "ttft_s": ttft, "cache_n": again.timings.get("cache_n", 0),
                "parked_bytes": cache.bytes_used if cache else 0}
    finally:
        engine.stop()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--others", type=int, default=2)
    p.add_argument("--other-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "conversation_cache.md"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, threads=args.threads, max_context=args.tokens + 1024)
    c = llm.config
    rows = []
    for store in (None, "f32", "f16", "int8"):
        run = returning_turn(llm, store, args, np.random.default_rng(0))
        rows.append((store or "off (full re-read)", run))
        print(store, run, flush=True)
    lines = [f"## {os.path.basename(args.model)}: {c.num_layers} layers, {c.num_kv_heads} kv heads x {c.head_dim}, "
             f"{args.tokens}-token conversation, {args.others} others of {args.other_tokens} in between, "
             f"{args.new_tokens} new tokens, {llm.threads} threads ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
             "", "| conversation cache | first read (s) | returning turn: time to first token (s) | restored tokens "
             "| speed-up |", "|---|---:|---:|---:|---:|"]
    base = rows[0][1]["ttft_s"]
    for name, run in rows:
        lines.append(f"| {name} | {run['first_read_s']:.1f} | {run['ttft_s']:.2f} | {run['cache_n']} "
                     f"| {base / run['ttft_s']:.0f}x |")
    lines += ["", "| KV store | bytes per parked token (this model) | 32K conversations in 1 GiB "
              "| bytes per token, Qwen3-30B-A3B | its 32K conversations in 1 GiB |", "|---|---:|---:|---:|---:|"]
    for store in STORES:
        ours = bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, store)
        qwen = bytes_per_token(*QWEN3_30B_KV, store)
        lines.append(f"| {store} | {ours:,} | {GIB / (32768 * ours):.1f} | {qwen:,} | {GIB / (32768 * qwen):.2f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
