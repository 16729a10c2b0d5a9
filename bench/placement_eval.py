"""Expert placement, held out: profile on one half of a prompt set, serve the other half.

A generated model with skewed routers (bench/make_model.py: Zipf-like per layer, a different hot
set in every layer) reads synthetic prompts: random token ids drawn per "topic" (each topic a
Zipf-weighted slice of the vocabulary, plus some words from anywhere), prompts alternating between
the halves so that both see every topic but no prompt twice. The first half is profiled; on the
second, each expert cache of the same VRAM budget serves the same prompts:

- plan: `--expert-cache auto --profile P.npz` (planned at start-up for the cache's room);
- uniform: the same count in every layer, each layer's most used experts (the profile's);
- global top-k: the most used (layer, expert) pairs of the profile, whatever their layer;
- dynamic: `--expert-cache dynamic`, from the plan, and from the same count per layer without a profile.

Measured: the decode (and prefill) hit rate, each step's routings against the mask it ran with,
the expert bytes the CPU read per decode token (static caches: misses x their layer's expert size),
and decode / prefill tok/s. Each of `--rounds` rounds runs every configuration once (a fresh
engine each time), in an order rotated and reversed from round to round so that none always runs
first or after the same one; the table gives the median speeds over the rounds with their range,
each median decode speed over uniform's, the hit rates (a range marked "varied" if a round gave
another), and each configuration's resident experts per layer. Writes placement.json (numbers,
every run) and placement.md (the table).

    python bench/placement_eval.py --out-dir /tmp/pe                  # makes the model first
    python bench/placement_eval.py --model m.gguf --device cpu --prompts 6 --decode 4 --rounds 2   # a dry run
"""
import argparse
import json
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.expert_usage import ExpertUsage  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from placement.budget import ModelSizes  # noqa: E402
from placement.planner import global_top_mask, plan_slots, uniform_mask  # noqa: E402
from placement.profile import model_id  # noqa: E402

log = logging.getLogger("placement_eval")


def synthetic_prompts(vocab_size, num_prompts, num_topics, seed, min_len=64, max_len=256):
    """[token ids]: prompt i is of topic i % num_topics; 85 % of its words from its topic."""
    rng = np.random.default_rng(seed)
    topics = [rng.choice(np.arange(16, vocab_size), size=300, replace=False) for _ in range(num_topics)]
    zipf = 1.0 / np.arange(1, 301) ** 1.1
    zipf /= zipf.sum()
    prompts = []
    for i in range(num_prompts):
        n = int(rng.integers(min_len, max_len + 1))
        own = rng.choice(topics[i % num_topics], size=n, p=zipf)
        anywhere = rng.integers(16, vocab_size, size=n)
        prompts.append(np.where(rng.random(n) < 0.85, own, anywhere).tolist())
    return prompts


def run_prompts(llm, prompts, decode, seed):
    """Generate `decode` tokens after each prompt; returns timings summed over the prompts."""
    total = {"prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0}
    for i, prompt in enumerate(prompts):
        out = llm.generate(prompt, max_tokens=decode, temperature=0.8, seed=seed + i, ignore_eos=True)
        for key in total:
            total[key] += out.timings[key]
    return total


def make_llm(args, **cache):
    llm = LLM(args.model, device=args.device, max_context=args.max_context, expert_cache_mib=args.cache_mib,
              threads=args.threads, **cache)
    if llm.model.usage is None:
        llm.model.usage = ExpertUsage.for_config(llm.config)
    return llm


def evaluate(args, name, prompts, **cache):
    """One run of one expert cache on the held-out prompts: hit rates, speeds, resident experts per layer."""
    t0 = time.perf_counter()
    llm = make_llm(args, **cache)
    run_prompts(llm, prompts[:1], 4, seed=999)  # warm-up (kernel compiles, first touches)
    llm.model.usage.reset()
    residency = llm.model.residency
    if residency is not None:
        residency.routed = {"prefill": 0, "decode": 0}
        residency.hits = {"prefill": 0, "decode": 0}
    resident = getattr(llm.model.backend, "resident", None)
    mask = cache.get("resident") if resident is None else resident  # the CPU dry run: the mask it would hold
    per_layer = None if mask is None else np.asarray(mask).sum(axis=1).tolist()  # at the start of the run
    timing = run_prompts(llm, prompts, args.decode, seed=1000)
    usage = llm.model.usage
    if residency is not None:
        hit = {p: residency.hit_rate(p) for p in ("decode", "prefill")}
    else:
        hit = {p: None if mask is None else usage.hit_rate(mask, p) for p in ("decode", "prefill")}
    host_mb = None if residency is not None or mask is None else host_mb_per_decode_token(llm, usage, mask)
    run = {"hit_rate_decode": hit["decode"], "hit_rate_prefill": hit["prefill"], "host_mb_per_decode_token": host_mb,
           "decode_tok_s": 1e3 * timing["predicted_n"] / timing["predicted_ms"],
           "prefill_tok_s": 1e3 * timing["prompt_n"] / timing["prompt_ms"], "decode_tokens": timing["predicted_n"],
           "prompt_tokens": timing["prompt_n"], "resident": None if mask is None else int(np.sum(mask)),
           "resident_per_layer": per_layer, "seconds": time.perf_counter() - t0}
    if residency is not None:
        run.update(swaps=residency.swaps_landed)
    log.info("%s: %s", name, json.dumps(run))
    return run


def host_mb_per_decode_token(llm, usage, mask):
    """Expert bytes the CPU read per decode token (MB): each layer's routings to non-resident experts
    times that layer's expert size. What the planner minimises at batch 1 (a miss in a layer of
    larger experts costs more), so a plan may trade a little hit rate for fewer bytes."""
    if usage.tokens_decode == 0:
        return None
    expert_bytes = np.asarray(ModelSizes.from_weights(llm.weights).expert_bytes, dtype=np.float64)  # [L]
    misses = np.where(np.asarray(mask, dtype=bool), 0, usage.decode).sum(axis=1)  # [L]
    return float(misses @ expert_bytes / usage.tokens_decode / 1e6)


def profile_half(args, prompts):
    """(profile of the prompts, one part per prompt as `strata profile` keeps them, the model's weights)."""
    llm = make_llm(args)
    usage, seen = llm.model.usage, []  # per prompt: (prefill [L, E], decode [L, E], tokens [2]) up to then
    for i, prompt in enumerate(prompts):
        run_prompts(llm, [prompt], args.decode, seed=i)
        seen.append((usage.prefill.copy(), usage.decode.copy(), (usage.tokens_prefill, usage.tokens_decode)))
    profile = usage.to_profile(model_id(llm.weights), source="placement_eval first half")
    return profile.with_parts(*(np.diff(np.stack([np.zeros_like(a[0]), *a]), axis=0) for a in zip(*seen))), \
        llm.weights


def round_order(names, round_index):
    """Round r starts at the r-th configuration and alternates direction, so that each configuration
    runs early and late, after each of the others."""
    order = names[round_index % len(names):] + names[:round_index % len(names)]
    return order[::-1] if round_index % 2 else order


def summarize(name, runs):
    """One table row from a configuration's runs: medians and ranges of the speeds, the hit rates
    (one value when every round gave the same, else the list)."""
    row = {"name": name, "rounds": len(runs), "resident": runs[0]["resident"],
           "resident_per_layer": runs[0]["resident_per_layer"], "runs": runs}
    for key in ("decode_tok_s", "prefill_tok_s"):
        values = [r[key] for r in runs]
        row[key] = float(np.median(values))
        row[f"{key}_range"] = [min(values), max(values)]
    for key in ("hit_rate_decode", "hit_rate_prefill", "host_mb_per_decode_token"):
        values = [r.get(key) for r in runs]
        row[key] = values[0] if all(v == values[0] for v in values) else values
    return row


def summarize_all(names, runs):
    rows = [summarize(n, runs[n]) for n in names if runs[n]]
    uniform = next((r for r in rows if r["name"] == "uniform"), None)
    for r in rows:
        r["decode_vs_uniform"] = None if uniform is None else r["decode_tok_s"] / uniform["decode_tok_s"]
    return rows


def write_table(path, result):
    def pct(v):
        if v is None or (isinstance(v, list) and None in v):
            return "n/a"
        if isinstance(v, list):  # differed between rounds
            return f"{100 * min(v):.2f}-{100 * max(v):.2f} % (varied)"
        return f"{100 * v:.2f} %"

    def megabytes(v):
        if v is None or (isinstance(v, list) and None in v):
            return "n/a"
        return f"{min(v):.1f}-{max(v):.1f} (varied)" if isinstance(v, list) else f"{v:.1f}"

    lines = ["| expert cache | resident | rounds | decode hit rate | prefill hit rate | host expert MB / decode token "
             "| decode tok/s median (min-max) | decode vs uniform | prefill tok/s median (min-max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        (dlo, dhi), (plo, phi) = r["decode_tok_s_range"], r["prefill_tok_s_range"]
        ratio = "n/a" if r["decode_vs_uniform"] is None else f"{r['decode_vs_uniform']:.3f}"
        lines.append(f"| {r['name']} | {r['resident']} | {r['rounds']} | {pct(r['hit_rate_decode'])} "
                     f"| {pct(r['hit_rate_prefill'])} | {megabytes(r.get('host_mb_per_decode_token'))} "
                     f"| {r['decode_tok_s']:.1f} ({dlo:.1f}-{dhi:.1f}) | {ratio} "
                     f"| {r['prefill_tok_s']:.0f} ({plo:.0f}-{phi:.0f}) |")
    lines += ["", "Resident experts per layer at the start of a run (layer 0 first):", ""]
    for r in result["rows"]:
        if r["resident_per_layer"] is not None:
            lines.append(f"- {r['name']}: {' '.join(map(str, r['resident_per_layer']))}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def save(out_dir, result):
    with open(os.path.join(out_dir, "placement.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_table(os.path.join(out_dir, "placement.md"), result)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF with skewed routers, made with bench/make_model.py when it does not exist "
                                   "(default: placement-model.gguf in --out-dir)")
    p.add_argument("--make-model", default="--type Q4_K_M --layers 16", help="make_model.py options")
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu", "auto"])
    p.add_argument("--fraction", type=float, default=0.33, help="share of all experts the cache holds")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--topics", type=int, default=8)
    p.add_argument("--decode", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated configurations to leave out")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of every configuration, in a rotated, alternating order per round; the table gives "
                        "the median speeds (default 3)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no run after this many seconds from the start (the rounds done so far are kept)")
    p.add_argument("--out-dir", default=".", help="where placement.json, placement.md and the profile go")
    return p.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: need at least 1")
    start = time.perf_counter()
    os.makedirs(args.out_dir, exist_ok=True)
    args.model = args.model or os.path.join(args.out_dir, "placement-model.gguf")
    if not os.path.exists(args.model):
        from bench.make_model import main as make_model

        make_model(args.make_model.split() + ["-o", args.model])
    from hybrid.formats import load_model

    weights = load_model(args.model)
    c, sizes = weights.config, ModelSizes.from_weights(weights)
    num_slots = int(round(args.fraction * c.num_layers * c.num_experts))
    args.cache_mib = (num_slots + 0.5) * max(sizes.expert_bytes) / (1 << 20)
    prompts = synthetic_prompts(c.vocab_size, args.prompts, args.topics, args.seed)
    first, held_out = prompts[0::2], prompts[1::2]
    log.info("%d prompts (%d tokens), %d topics; cache %d of %d experts (%.0f MiB)", len(prompts),
             sum(map(len, prompts)), args.topics, num_slots, c.num_layers * c.num_experts, args.cache_mib)
    profile, _ = profile_half(args, first)
    profile_path = os.path.join(args.out_dir, "placement-profile.npz")
    profile.save(profile_path)
    probs, _ = profile.decode_estimate()  # what the planner plans from
    layers = range(c.num_layers)
    predicted = plan_slots(profile, sizes, num_slots, batch=1, max_context=args.max_context)
    configs = [("uniform", {"resident": uniform_mask(probs, layers, num_slots)}),
               ("global top-k", {"resident": global_top_mask(probs, layers, num_slots)}),
               ("plan", {"profile": profile_path}),
               ("dynamic (from the plan)", {"profile": profile_path, "expert_cache": "dynamic"}),
               ("dynamic (no profile)", {"expert_cache": "dynamic"})]
    if args.device == "cpu":  # no expert cache: the masks' hit rates only
        configs = [(n, {"resident": predicted.resident_mask(c.num_layers, c.num_experts)} if n == "plan" else o)
                   for n, o in configs if "dynamic" not in n]
    skip = set(filter(None, args.skip.split(",")))
    result = {"model": os.path.basename(args.model), "device": args.device, "num_slots": num_slots,
              "num_experts_total": c.num_layers * c.num_experts, "prompts": len(prompts), "decode": args.decode,
              "rounds": args.rounds,
              "profile_tokens": {"prefill": profile.tokens_prefill, "decode": profile.tokens_decode},
              "predicted": {"plan": predicted.predicted, **predicted.baselines}, "rows": []}
    configs = {n: o for n, o in configs if n not in skip}
    names, runs = list(configs), {n: [] for n in configs}
    schedule = [name for r in range(args.rounds) for name in round_order(names, r)]
    save(args.out_dir, result)
    for i, name in enumerate(schedule):
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            log.warning("deadline: %d of %d runs made; round %d stopped before %s", i, len(schedule),
                        i // len(names) + 1, name)
            break
        runs[name].append(evaluate(args, name, held_out, **configs[name]))
        result["rows"] = summarize_all(names, runs)
        save(args.out_dir, result)
    print(open(os.path.join(args.out_dir, "placement.md")).read())


if __name__ == "__main__":
    main()
