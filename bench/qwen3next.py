"""Qwen3-Next on the CPU at long contexts (issue 37): decode tokens/s at 4K, 32K and 128K tokens of context, the time
in its linear-attention and full-attention layers apart, and a returning 32K conversation restored from the
conversation cache against reading it again.

Decode: for each context C a sequence's KV (the full-attention layers) and recurrent state (the Gated DeltaNet
layers) are filled with random values for C positions, then --steps decode steps are timed (a step's cost depends
on how many positions attention reads, not on what they hold; reading 128K tokens first would take hours on a small
host). Per step the time inside the linear-attention blocks (hybrid/linear_attention.py) and inside the attention
reads (blocks.attend) is measured apart: the linear layers' cost must not grow with C.
Projections: the linear-attention layers' projections (attn_qkv, attn_gate, ssm_out of every such layer, in turn so
that they come from memory, not cache) as one-token matvecs with int16 x, with x as int16 hi + lo (`exact`, what
hybrid/linear_attention.py uses before the gated norm: the price of its accuracy) and with float x, min and median
of --repeats rounds.
Restore: an engine with a conversation cache reads a --history-token conversation and answers it (its time to first
token: what reading it again costs), then the conversation returns with --turn-tokens more: its time to first
token (restore of the KV and the last state checkpoint, then the new tokens).

    python bench/make_model.py --arch qwen3next --type Q4_K_M --layers 4 --hidden 2048 --heads 16 --kv-heads 2 \\
        --head-dim 256 --experts 512 --top-k 10 --moe-ff 512 --context 139264 -o /tmp/qwen3next-80b-4l.gguf
    python bench/qwen3next.py --model /tmp/qwen3next-80b-4l.gguf --threads 16
"""
import argparse
import logging
import os
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.conversation_cache import ask  # noqa: E402
from hybrid import blocks  # noqa: E402
from hybrid.batch import Batch, SeqChunk  # noqa: E402
from hybrid.conversation_cache import ConversationCache, model_fingerprint  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from hybrid.recurrent_state import Checkpoint  # noqa: E402
from cpu_kernels.act_quant import FLOAT  # noqa: E402 (after hybrid: it sets the ISA floor first)

GIB = 1 << 30


class BlockTimer:
    """Seconds spent in the linear-attention blocks and in the attention reads, by wrapping blocks' globals that
    the layers' steps call."""

    def __init__(self):
        self.seconds = {"linear": 0.0, "attention": 0.0}
        self.calls = {"linear": 0, "attention": 0}

    def _wrap(self, kind, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
                self.calls[kind] += 1
        return timed

    @contextmanager
    def installed(self):
        saved = blocks.linear_attention, blocks.attend
        blocks.linear_attention = self._wrap("linear", saved[0])
        blocks.attend = self._wrap("attention", saved[1])
        try:
            yield self
        finally:
            blocks.linear_attention, blocks.attend = saved


def filled_sequence(model, context, rng, max_tokens):
    """A sequence holding `context` positions of random KV and a random recurrent state."""
    kv = model.new_sequence(max_tokens)
    pool = model.kv_pool
    shape = (pool.num_layers, context, pool.num_kv_heads, pool.head_dim)  # [L, C, Hkv, D]
    kv.load(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
    rs = model.recurrent_shape
    kv.recurrent.load_checkpoint(Checkpoint(context, 0.1 * rng.standard_normal(rs.conv_shape, np.float32),
                                            0.1 * rng.standard_normal(rs.delta_shape, np.float32)))
    return kv


def decode_at(llm, context, steps, rng):
    """{tok_s, step_ms, linear_ms, attention_ms} of decode steps after `context` positions."""
    model = llm.model
    kv = filled_sequence(model, context, rng, context + steps + 1)
    token = np.asarray([int(rng.integers(3, llm.config.vocab_size))])
    model.forward(Batch([SeqChunk(kv, kv.length, token)]))  # warm: first touch of this context's pages
    timer = BlockTimer()
    with timer.installed():
        start = time.perf_counter()
        for _ in range(steps):
            model.forward(Batch([SeqChunk(kv, kv.length, token)]))
        seconds = time.perf_counter() - start
    if not timer.calls["linear"] or not timer.calls["attention"]:
        raise RuntimeError(f"the block timer saw no calls ({timer.calls}): the decode path does not run through "
                           "hybrid.blocks' linear_attention / attend any more")
    del kv
    return {"tok_s": steps / seconds, "step_ms": 1e3 * seconds / steps,
            "linear_ms": 1e3 * timer.seconds["linear"] / steps, "attention_ms": 1e3 * timer.seconds["attention"] / steps}


def projection_cost(llm, repeats, rng):
    """{"int16" / "int16 hi + lo" / "float": (min ms, median ms)} of one round of one-token matvecs over the
    linear-attention layers' big projections: at act_quant, exact (x as int16 hi + lo, cpu_kernels/exact_dot.py) and
    with float x (act_quant float)."""
    be = llm.model.backend
    weights = [llm.weights[f"blk.{layer}.{name}.weight"] for layer in llm.model.recurrent_shape.layers
               for name in ("attn_qkv", "attn_gate", "ssm_out")]
    xs = [rng.standard_normal((1, w.shape[1])).astype(np.float32) for w in weights]
    be.linear(weights[0], xs[0])  # the backend's act_quant is set at its first linear
    act_quant = be.act_quant
    rounds = {"int16": [], "int16 hi + lo": [], "float": []}
    for _ in range(repeats):
        for name, exact, code in (("int16", False, act_quant), ("int16 hi + lo", True, act_quant),
                                  ("float", True, FLOAT)):
            be.act_quant = code
            start = time.perf_counter()
            for w, x in zip(weights, xs):
                be.linear(w, x, exact)
            rounds[name].append(1e3 * (time.perf_counter() - start))
    be.act_quant = act_quant
    return {name: (min(ms), float(np.median(ms))) for name, ms in rounds.items()}


def returning_conversation(llm, args, rng):
    """{read_s, restore_ttft_s, cache_n, state_bytes}: a history read and answered, then returning with a turn."""
    cache = ConversationCache(4 * GIB, model_fingerprint(llm.weights), checkpoint_tokens=args.checkpoint_tokens)
    engine = Engine(llm, num_slots=1, conversation_cache=cache).start()
    try:
        history = rng.integers(3, llm.config.vocab_size, args.history_tokens).tolist()
        first, read_s = ask(engine, history, max_tokens=4)
        turn = history + first.token_ids + rng.integers(3, llm.config.vocab_size, args.turn_tokens).tolist()
        again, ttft = ask(engine, turn, max_tokens=4)
        return {"read_s": read_s, "restore_ttft_s": ttft, "cache_n": again.timings.get("cache_n", 0),
                "state_bytes": cache.state_bytes, "parked_bytes": cache.bytes_used, "turn": len(turn)}
    finally:
        engine.stop()


def report(args, llm, decode, projections, restore):
    c = llm.config
    lines = [f"## {os.path.basename(args.model)}: {c.num_layers} layers ({len(llm.model.recurrent_shape.layers)} "
             f"Gated DeltaNet, {llm.model.num_kv_layers} full attention), {llm.threads} threads "
             f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `python bench/qwen3next.py {' '.join(sys.argv[1:])}`", ""]
    if decode:
        lines += ["| context (tokens) | decode tok/s | ms a step | in linear-attention blocks (ms) "
                  "| in attention reads (ms) |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {n:,} | {r['tok_s']:.2f} | {r['step_ms']:.1f} | {r['linear_ms']:.2f} | {r['attention_ms']:.2f} |"
                  for n, r in decode.items()]
        lines.append("")
    if projections:
        qtype = llm.weights[f"blk.{llm.model.recurrent_shape.layers[0]}.attn_qkv.weight"].qtype.name
        lines += [f"| linear-attention projections, one token ({qtype}, {len(llm.model.recurrent_shape.layers)} layers) "
                  "| min (ms) | median (ms) |", "|---|---:|---:|"]
        lines += [f"| {name} x | {lo:.2f} | {mid:.2f} |" for name, (lo, mid) in projections.items()]
        lines.append("")
    if restore:
        r = restore
        lines += ["| returning conversation | read again: time to first token (s) | restored: time to first token (s) "
                  "| restored tokens | speed-up | parked state checkpoints (MiB) |", "|---|---:|---:|---:|---:|---:|",
                  f"| {args.history_tokens:,} tokens + {args.turn_tokens} new | {r['read_s']:.1f} "
                  f"| {r['restore_ttft_s']:.2f} | {r['cache_n']:,} | {r['read_s'] / r['restore_ttft_s']:.0f}x "
                  f"| {r['state_bytes'] / 2**20:.1f} |", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="4096,32768,131072", help="decode contexts, comma-separated (tokens)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    p.add_argument("--repeats", type=int, default=8, help="rounds of the projections' timing")
    p.add_argument("--history-tokens", type=int, default=32768, help="the returning conversation's history (0: skip)")
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--checkpoint-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "qwen3next.md"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    contexts = [int(n) for n in args.contexts.split(",") if n]
    llm = LLM(args.model, device="cpu", threads=args.threads,
              max_context=max(contexts + [args.history_tokens]) + args.turn_tokens + 512)
    rng = np.random.default_rng(0)
    decode = {}
    for n in contexts:
        decode[n] = decode_at(llm, n, args.steps, rng)
        print(n, decode[n], flush=True)
    projections = projection_cost(llm, args.repeats, rng)
    print(projections, flush=True)
    restore = returning_conversation(llm, args, rng) if args.history_tokens else None
    print(restore, flush=True)
    text = report(args, llm, decode, projections, restore)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
