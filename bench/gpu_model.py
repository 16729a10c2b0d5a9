"""Hybrid GPU + CPU serving of a generated model: decode tok/s at several resident shares (one
user, and --users at once through the serving engine), prefill tok/s of a long prompt with and without
prefill borrow, and the per-layer overlap of the hybrid MoE step (CPU busy, GPU busy, step time).

The resident experts are the first n of each layer (n = share of E): a plain placement, not a
profile's, so the hit rate is about the share. Make the model with bench/make_model.py, e.g.
`--type Q8_0 --layers 52` (8.4 GB).

    python bench/gpu_model.py --model /tmp/bench-8g.gguf [--shares 0,25,50,75,100] [--decode-tokens 32]
        [--prompt-tokens 4096] [--borrow-shares 0,50] [--users 4] [--modes relay,spare,inline]

Prints the tables; --output also writes them to a file.
"""
import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from hybrid import LLM  # noqa: E402
from cpu_kernels.target import chosen_threads  # noqa: E402
from hybrid.backends.cpu import CpuBackend  # noqa: E402
from hybrid.moe import SplitSettings  # noqa: E402

log = logging.getLogger("bench.gpu_model")


# How a decode token's host part runs (ExpertSplit settings), each traced and timed at resident shares below 100 %.
DECODE_MODES = {
    "inline": dict(decode_relay=False, decode_host_thread=False, compiled_host_decode=True),
    "relay": dict(decode_relay=True, decode_host_thread=False, compiled_host_decode=True),
    "relay, a core spare": dict(decode_relay=True, decode_host_thread=False, compiled_host_decode=True,
                                relay_threads=lambda: max(1, chosen_threads() - 1)),
    "thread": dict(decode_relay=False, decode_host_thread=True, compiled_host_decode=True),
    "inline, op by op": dict(decode_relay=False, decode_host_thread=False, compiled_host_decode=False),
    "relay, static shares": dict(decode_relay=True, decode_host_thread=False, compiled_host_decode=True, claimed=False),
    "relay, step graph": dict(decode_relay=True, decode_host_thread=False, compiled_host_decode=True,
                              relay_graphs=True),
    "relay, step graph, static shares": dict(decode_relay=True, decode_host_thread=False, compiled_host_decode=True,
                                             relay_graphs=True, claimed=False),
}
DECODE_NOTES = {"inline": "one compiled call in the calling thread",
                "relay": "handed to a host worker through mapped memory, the calling thread never waits",
                "relay, a core spare": "the same, the worker's experts on one Numba thread fewer "
                "(STRATA_RELAY_THREADS), leaving the calling thread a core",
                "thread": "one compiled call in a worker thread", "inline, op by op": "NumPy bookkeeping and five "
                "kernel calls", "relay, static shares": "the relay, its worker's gate+up and down items in static "
                "shares of the threads rather than claimed (CpuBackend.claimed_host_experts off)",
                "relay, step graph": "the relay, the whole decode step one captured graph that waits on the host's "
                "rows inside it (relay_graphs; its overlap rows are traced layer by layer)",
                "relay, step graph, static shares": "the step graph with the worker's items in static shares"}
# --modes names; relayN (e.g. relay14): the relay's worker on N threads
MODE_KEYS = {"inline": "inline", "relay": "relay", "spare": "relay, a core spare", "thread": "thread",
             "opbyop": "inline, op by op", "static": "relay, static shares", "graph": "relay, step graph",
             "graphstatic": "relay, step graph, static shares"}


def mode_name(key):
    """The DECODE_MODES name of a --modes key (relayN added to DECODE_MODES as "relay, N threads"), or None."""
    if key.startswith("relay") and key[5:].isdigit() and int(key[5:]) > 0:
        name, threads = f"relay, {int(key[5:])} threads", int(key[5:])
        DECODE_MODES[name] = dict(DECODE_MODES["relay"], relay_threads=lambda: threads)
        DECODE_NOTES[name] = f"the relay, its worker's experts on {threads} Numba threads"
        return name
    return MODE_KEYS.get(key)
DEFAULT_SPLIT = SplitSettings()
DEFAULT_MODE = (("relay, step graph" if DEFAULT_SPLIT.relay_graphs else "relay") if DEFAULT_SPLIT.decode_relay
                else "inline")


def use_mode(split, mode):
    """Set the ExpertSplit's decode settings to DECODE_MODES[mode] (relay_threads: the split's own unless set)."""
    settings = DECODE_MODES[mode]
    split.relay.enabled = settings["decode_relay"]
    split.relay.graphs = settings.get("relay_graphs", False)
    split.host_side.decode_host_thread = settings["decode_host_thread"]
    split.host_side.compiled_host_decode = settings["compiled_host_decode"]
    threads = settings.get("relay_threads")
    split.relay.threads = threads() if threads else split.settings.relay_threads
    claimed = settings.get("claimed", CpuBackend.claimed_host_experts)
    if getattr(split.host, "claimed_host_experts", claimed) != claimed:
        split.host.claimed_host_experts = claimed
        split.relay.close()  # its layers warmed again: the new plans compile before the device waits on them


def first_experts(config, share):
    mask = np.zeros((config.num_layers, config.num_experts), bool)  # [L, E]
    mask[:, : round(share / 100 * config.num_experts)] = True
    return mask


def prompt(llm, num_tokens, seed):
    return np.random.default_rng(seed).integers(10, llm.config.vocab_size, num_tokens).tolist()


def decode_rate(llm, num_tokens):
    out = llm.generate(prompt(llm, 32, 1), max_tokens=num_tokens, temperature=0, ignore_eos=True)
    return out.timings["predicted_per_second"]


def concurrent_rates(llm, users, num_tokens, relay_tokens=None, graphs=None):
    """(tok/s each user saw, mean; tok/s of all users together, prompts included; tok/s of all users while every one
    of them decodes, as llama-batched-bench's S_TG counts): `users` greedy requests decoded at once by the serving
    engine (one decode batch of `users` tokens a step), each after its own 32-token prompt, all queued at once; decode
    steps of up to relay_tokens tokens through the relay (ExpertSplit.relay.tokens), each one step graph with graphs
    (relay_graphs); None: the split's own settings (the engine's defaults)."""
    from concurrent.futures import ThreadPoolExecutor

    from hybrid.engine import Engine
    from hybrid.request import Delta, Finished, Request
    from hybrid.sampling import SamplingParams

    def follow(handle):  # ([(time, tokens)] of its deltas, its last event)
        seen = []
        for event in handle:
            if isinstance(event, Delta):
                seen.append((time.perf_counter(), len(event.token_ids)))
            else:
                return seen, event

    split, usage = llm.model.split, llm.model.usage
    if split is not None:
        split.relay.tokens = split.relay.tokens if relay_tokens is None else relay_tokens
        split.relay.graphs = split.relay.graphs if graphs is None else graphs
    engine = Engine(llm, num_slots=users)
    try:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        # every request queued before the engine's first step, as llama-batched-bench gives its prompts together
        handles = [engine.submit(Request(prompt(llm, 32, 10 + u), params)) for u in range(users)]
        engine.start()
        with ThreadPoolExecutor(users) as pool:
            followed = list(pool.map(follow, handles))
        wall = time.perf_counter() - t0
    finally:
        engine.stop()
        llm.model.usage = usage  # the engine records usage while it serves; the runs after it as before
        if split is not None:
            split.relay.tokens, split.relay.graphs = split.settings.relay_tokens, split.settings.relay_graphs
    results = [event for _, event in followed]
    failed = [r for r in results if not isinstance(r, Finished)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {users} concurrent requests failed: {failed[0]}")
    start = max(seen[0][0] for seen, _ in followed)  # every user has its first token
    end = min(seen[-1][0] for seen, _ in followed)  # no user has finished
    tokens = sum(n for seen, _ in followed for t, n in seen if start < t <= end)
    return (float(np.mean([r.timings["predicted_per_second"] for r in results])),
            sum(len(r.token_ids) for r in results) / wall, tokens / (end - start) if end > start else float("nan"))


def traced(llm, run):
    """Per-layer trace of the MoE step over `run()`: [{layer, tokens, cpu_s, gpu_s, step_s, borrowed}]."""
    split, backend = llm.model.split, llm.model.backend
    split.trace, backend.time_experts = [], True
    try:
        run()
        return split.trace
    finally:
        split.trace, backend.time_experts = None, False


def overlap_rows(label, trace):
    """Table rows: mean per layer of the traced MoE steps of `label`."""
    if not trace:
        return []
    cpu = np.array([t["cpu_s"] for t in trace]) * 1e3
    gpu = np.array([t["gpu_s"] for t in trace]) * 1e3
    step = np.array([t["step_s"] for t in trace]) * 1e3
    queue = np.array([t["queue_s"] for t in trace]) * 1e3
    ratio = step / np.maximum(np.maximum(cpu, gpu), 1e-9)
    layers = np.array([t["layer"] for t in trace])
    log.info("%s: median step / max by layer: %s", label,
             " ".join(f"{np.median(ratio[layers == i]):.2f}" for i in np.unique(layers)))
    return [f"| {label} | {trace[0]['tokens']} | {cpu.mean():.3f} | {gpu.mean():.3f} | {queue.mean():.3f} | "
            f"{step.mean():.3f} | "
            f"{np.median(ratio):.2f} | {np.percentile(ratio, 90):.2f} | "
            f"{np.mean([t['borrowed'] for t in trace]):.1f} |"]


def blocking_sync():
    """Make the CUDA context's host waits sleep rather than spin (logged where the runtime refuses: a context made)."""
    try:
        import cupy

        cupy.cuda.runtime.setDeviceFlags(cupy.cuda.runtime.deviceScheduleBlockingSync)
        log.info("CUDA host waits block (cudaDeviceScheduleBlockingSync)")
    except Exception as exc:  # no CuPy, or flags refused: the run goes on with the default (spin where cores are free)
        log.warning("--blocking-sync not applied: %s: %s", type(exc).__name__, exc)


def handoff_rows(label, trace, rate, num_layers):
    """Table rows: a decode layer's host experts, step, hand-off and the relay worker's wait and gap (ms), mean per
    layer of the traced steps, against the decode step's wall time over its layers at `rate` tok/s."""
    if not trace:
        return []
    ms = {key: np.array([t.get(key, np.nan) for t in trace], dtype=float) * 1e3
          for key in ("cpu_s", "step_s", "wait_s", "gap_s")}
    per_layer = 1e3 / rate / num_layers
    relayed = not np.isnan(ms["wait_s"]).all()

    def mean(a):
        a = a[~np.isnan(a)]
        return f"{a.mean():.3f}" if a.size else "-"

    late = f"{np.mean(ms['wait_s'] < 2e-3):.0%}" if relayed else "-"
    return [f"| {label} | {per_layer:.3f} | {mean(ms['cpu_s'])} | {mean(ms['step_s'])} | "
            f"{mean(ms['step_s'] - ms['cpu_s'])} | {per_layer - np.nanmean(ms['step_s']):.3f} | "
            f"{mean(ms['wait_s']) if relayed else '-'} | {late} | {mean(ms['gap_s']) if relayed else '-'} |"]


def host_alone_rows(llm, share, threads, calls=64, gap_s=2e-4):
    """Table rows: the host's experts of a decode token (CpuBackend.host_decode_experts, as the relay worker runs
    them) called `calls` times on every layer in turn with random routings, at `threads` Numba threads in this
    thread: back to back, then with gap_s asleep between calls; the items in static shares, then claimed."""
    import numba

    from placement.borrow import expert_bytes

    split, model = llm.model.split, llm.model
    host, c = split.host, llm.config
    layers = [lay for lay in model.layers if getattr(lay, "gate_exps", None) is not None]
    rng = np.random.default_rng(5)
    k = c.num_experts_per_tok
    cases = [(rng.standard_normal((1, c.hidden_size)).astype(np.float32),
              rng.choice(c.num_experts, k, replace=False)[None].astype(np.int32),
              rng.random((1, k)).astype(np.float32)) for _ in range(calls)]
    before, was_claimed = numba.get_num_threads(), getattr(host, "claimed_host_experts", False)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    rows = []
    try:
        for claimed in (False, True):
            host.claimed_host_experts = claimed
            for layer, (x, ids, weights) in zip(layers, cases):  # warm-up: each layer's plan made, its code compiled
                host.host_decode_experts(layer, x, ids, weights, split.resident[layer.index])
            result = []
            for gap in (0.0, gap_s):
                seconds, pairs, nbytes = [], 0, 0
                for i, (x, ids, weights) in enumerate(cases):
                    layer = layers[i % len(layers)]
                    if gap:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    _, n = host.host_decode_experts(layer, x, ids, weights, split.resident[layer.index])
                    seconds.append(time.perf_counter() - t0)
                    pairs, nbytes = pairs + n, nbytes + n * expert_bytes(layer)
                result.append((float(np.mean(seconds)), nbytes / max(sum(seconds), 1e-12) / 1e9))
            (hot, hot_rate), (gaps, gap_rate) = result
            rows.append(f"| {share} | {threads} | {'claimed' if claimed else 'static'} | {pairs / calls:.1f} | "
                        f"{hot * 1e3:.3f} | {hot_rate:.1f} | {gaps * 1e3:.3f} | {gap_rate:.1f} |")
    finally:
        numba.set_num_threads(before)
        host.claimed_host_experts = was_claimed
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shares", default="0,25,50,75,100", help="resident shares, percent")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--borrow-shares", default="50", help="resident shares of the prefill runs (borrow on / off)")
    p.add_argument("--output", type=Path, help="write the tables here (bench/results/gpu_model.md keeps the history "
                   "by hand)")
    p.add_argument("--profile-share", type=int, default=None,
                   help="also profile (cProfile) a 16-token decode at this resident share and log the top functions")
    p.add_argument("--users", type=int, default=4, help="also decode this many requests at once through the serving "
                   "engine at each share (0: not)")
    p.add_argument("--modes", default="relay,spare,inline", help="decode host-part ways to time below 100 %% resident "
                   "(thread and opbyop, slower than the relay at every share in session 25, only when named) "
                   f"({', '.join(f'{k}: {v}' for k, v in MODE_KEYS.items())}; relayN: the relay, its worker on N "
                   "threads); the default way always runs")
    p.add_argument("--blocking-sync", action="store_true", help="the CUDA context's host waits block (sleep) rather "
                   "than spin (cudaDeviceScheduleBlockingSync), set before the model loads")
    args = p.parse_args(argv)
    unknown = {k for k in args.modes.split(",") if mode_name(k) is None}
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODE_KEYS)}, relayN)")
    modes = [DEFAULT_MODE] + [mode_name(k) for k in args.modes.split(",") if mode_name(k) != DEFAULT_MODE]
    if args.blocking_sync:
        blocking_sync()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    size_gb = os.path.getsize(args.model) / 1e9
    decode, overlap, prefill, concurrent, device, handoff, alone = [], [], [], [], "", [], []
    arch = model_config(args.model).arch
    borrow_shares = {int(s) for s in args.borrow_shares.split(",")}
    for share in [int(s) for s in args.shares.split(",")]:
        t0 = time.perf_counter()
        llm = LLM(args.model, device="gpu", max_context=args.prompt_tokens + 64, kv_sequences=max(1, args.users),
                  resident=first_experts(model_config(args.model), share))
        device = llm.model.backend.rt.device_name
        log.info("share %d %%: loaded in %.1f s", share, time.perf_counter() - t0)
        if llm.model.split is not None:
            use_mode(llm.model.split, DEFAULT_MODE)
        decode_rate(llm, 4)  # warm-up: compiles the kernels
        rate = decode_rate(llm, args.decode_tokens)
        decode.append(f"| {share} | {rate:.1f} |")
        log.info(decode[-1])
        if share == args.profile_share:
            log.info("decode profile at %d %% resident:\n%s", share, profiled(lambda: decode_rate(llm, 16)))
        if share < 100:
            split = llm.model.split
            for mode in modes:
                use_mode(split, mode)
                decode_rate(llm, 2)  # warm-up: the relay compiles its host side per layer
                trace = [t for t in traced(llm, lambda: decode_rate(llm, 8)) if t["tokens"] == 1]
                overlap += overlap_rows(f"decode, {share} % resident, {mode}", trace)
                mode_rate = rate
                if mode != DEFAULT_MODE:
                    mode_rate = decode_rate(llm, args.decode_tokens)
                    decode[-1] += f" {mode_rate:.1f} |"
                handoff += handoff_rows(f"{share} %, {mode}", trace, mode_rate, llm.config.num_layers)
            alone += host_alone_rows(llm, share, split.settings.relay_threads or chosen_threads())  # the default's
            use_mode(split, DEFAULT_MODE)
        else:
            decode[-1] += " |" * (len(modes) - 1)
        if args.users:
            concurrent.append(f"| {share} |")
            for relay_tokens, graphs in users_ways(args.users, modes):
                try:
                    each, together, decoding = concurrent_rates(llm, args.users, args.decode_tokens, relay_tokens,
                                                                graphs)
                    concurrent[-1] += f" {each:.1f} | {together:.1f} | {decoding:.1f} |"
                except Exception as exc:  # the other tables still come out
                    log.exception("%d users at once at %d %% resident failed", args.users, share)
                    concurrent[-1] += f" failed: {type(exc).__name__}: {exc} | | |"
            log.info("%d users at once: %s", args.users, concurrent[-1])
        if share in borrow_shares:
            prefill += prefill_rows(llm, args.prompt_tokens, share)
            overlap += overlap_rows(f"prefill chunk, {share} % resident, borrow",
                                    traced(llm, lambda: llm.score(prompt(llm, min(512, args.prompt_tokens), 3))))
        llm.close()  # its relay worker and host pool stop before the next share loads
        del llm  # and its VRAM is free
    lines = [f"# Hybrid GPU + CPU serving ({device}, {os.cpu_count()} host cores)", "",
             f"Model: `{Path(args.model).name}`, {size_gb:.1f} GB (bench/make_model.py, {arch}, random weights).",
             "Resident experts: the first n of each layer (no profile). Greedy decode after a 32-token prompt.", "",
             f"## Decode ({args.decode_tokens} tokens)", "", "Host part of a decode token: " + "; ".join(
                 f"{m}: {DECODE_NOTES[m]}" for m in modes) + ".", "",
             "| resident % | " + " | ".join(f"tok/s ({m}{', the default' if m == DEFAULT_MODE else ''})"
                                           for m in modes) + " |", "|---|" + "---|" * len(modes), *decode, "",
             *(users_table(args.users, args.decode_tokens, concurrent, modes) if concurrent else []),
             f"## Prefill ({args.prompt_tokens}-token prompt)", "",
             "| resident % | prefill borrow | tok/s (best of 3 alternating runs) |", "|---|---|---|", *prefill, "",
             "## Overlap of the hybrid MoE step, mean per layer", "",
             "CPU busy: the host experts; GPU busy: the device part's kernels (CUDA events), borrowed copies "
             "included; step: the whole ExpertSplit.run after the device is idle (routing copy, grouping, both "
             "parts, combine; relay: the device's clock from the routing posted to the host rows added); "
             "queuing: host time spent launching the device part (inside GPU busy). "
             "Target: step <= 1.15 x max(CPU, GPU).", "",
             "| run | tokens | CPU busy ms | GPU busy ms | queuing ms | step ms | step / max median | p90 | "
             "borrowed experts |",
             "|---|---|---|---|---|---|---|---|---|", *overlap, "",
             "## A decode layer's host part and its hand-off, mean per layer (ms)", "",
             "Token / layer: the decode step's wall time over the layers (the mode's own tok/s). Host experts: the "
             "host's time from the routing seen to the rows posted (CPU busy above). Step: the device's clock from "
             "the routing posted to the host rows added (relay; the whole ExpertSplit.run otherwise). Hand-off: "
             "step - host experts (the copies both ways, flags seen late). Outside: token / layer - step (the "
             "device's own layer, Python). Worker wait: the relay worker's spin before the routing came; late: the "
             "share of layers whose routing was there before the worker (wait < 2 us); gap: the worker's time "
             "between a layer's rows posted and its next wait (Python, the job queue).", "",
             "| run | token / layer | host experts | step | hand-off | outside | worker wait | late | worker gap |",
             "|---|---|---|---|---|---|---|---|---|", *handoff, "",
             "## The host experts alone (CpuBackend.host_decode_experts called back to back, every layer in turn, "
             "random routings, the relay worker's thread count)", "",
             "GB/s: the non-resident pairs' expert bytes over the time. Hot: calls back to back; gaps: 0.2 ms "
             "asleep between calls (as between a step's layers). Items: the gate+up and down items in static "
             "shares or claimed by the threads (CpuBackend.claimed_host_experts, the default).", "",
             "| resident % | threads | items | pairs a call | ms a call, hot | GB/s hot | ms a call, gaps | GB/s gaps |",
             "|---|---|---|---|---|---|---|---|", *alone, ""]
    log.info("\n%s", "\n".join(lines))
    if args.output:
        args.output.write_text("\n".join(lines))
        log.info("wrote %s", args.output)
    return 0


def users_ways(users, modes):
    """(relay_tokens, relay_graphs) of each users-at-once run: the prompt-chunk way, the whole step through the relay,
    and (with the step graph among the modes) that step as one graph."""
    graphed = ((users, True),) if "relay, step graph" in modes else ()
    return ((1, DEFAULT_SPLIT.relay_graphs), (users, False)) + graphed


def users_table(users, num_tokens, rows, modes):
    ways = ["one by one", "batch", "batch, step graph"][:len(users_ways(users, modes))]
    return [f"## {users} users at once ({num_tokens} tokens each, the serving engine's decode batches)", "",
            "Each: the mean tok/s each user saw; together: generated tok/s of all users, prompts included; all "
            "decoding: tok/s of all users while every one decodes (llama-batched-bench's S_TG). "
            f"One by one: relay_tokens 1 (a step of several tokens runs as a prompt chunk); batch: relay_tokens "
            f"{users} (the whole step through the relay, STRATA_DECODE_RELAY_TOKENS); step graph: that step as one "
            "graph (relay_graphs).", "",
            "| resident % | " + " | ".join(f"{what} ({way})" for way in ways for what in ("each", "together",
                                                                                        "all decoding")) + " |",
            "|---|" + "---|" * 3 * len(ways), *rows, ""]


def prefill_rows(llm, num_tokens, share, runs=3):
    """Table rows: prompt tok/s with prefill borrow on and off, the best of `runs` alternating runs each (a first
    run pays one-time costs, such as the borrow's staging buffers and the prompt kernels' loading)."""
    ids, best = prompt(llm, num_tokens, 2), {True: 0.0, False: 0.0}
    for _ in range(runs):
        for borrow in (True, False):
            llm.model.backend.prefill_borrow = borrow
            out = llm.generate(ids, max_tokens=1, temperature=0, ignore_eos=True)
            best[borrow] = max(best[borrow], out.timings["prompt_per_second"])
            log.info("prefill %d tokens at %d %% resident, borrow %s: %.0f tok/s", num_tokens, share, borrow,
                     out.timings["prompt_per_second"])
    llm.model.backend.prefill_borrow = True
    return [f"| {share} | {'on' if borrow else 'off'} | {best[borrow]:.0f} |" for borrow in (True, False)]


def profiled(run, top=30):
    """The `top` functions of run() by own time, as pstats prints them."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def model_config(path):
    from hybrid.formats import load_model

    return load_model(path).config


if __name__ == "__main__":
    sys.exit(main())
