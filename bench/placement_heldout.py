"""The planner against its baselines on prompts it did not see, from real routings of a trained model.

Each prompt of a set is read and continued for `--decode` tokens once, recording every token's routing
(layer, experts). Then, for `--splits` random halves of the set: a profile is made from half A as a short
profiling run makes it (every prompt token, and only the first `--profile-decode` generated tokens of each
prompt; one part per prompt, as `strata profile` keeps them), each expert cache of `--fraction` of all
experts is chosen from it, and is scored on half B's decode routings (all `--decode` tokens of each prompt):

- plan: the planner (`plan_slots`): its plan where its check on the profile's own parts keeps it, else
  the global top-k (planner.cross_check);
- plan, unchecked: the planner's plan of the same profile without its parts (no check possible);
- global top-k: the most used (layer, expert) pairs by the profile's counts, prompt and decode together;
- uniform: each layer's most used experts by those counts, the same number in every layer.

Scores: the hit rate of B's decode routings, and the decode step the planner's cost model predicts from B's
decode shares (the planner's own objective, `CostModel.step_seconds`), both as medians over the splits,
with the share of splits where the plan is at least as good as global top-k.

    python bench/placement_heldout.py --model ../shared/models/tiny-code-moe --out bench/results/placement_heldout.md
"""
import argparse
import hashlib
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.expert_usage import ExpertUsage  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from placement.budget import ModelSizes  # noqa: E402
from placement.planner import CostModel, Speeds, global_top_mask, plan_slots, uniform_mask  # noqa: E402
from placement.profile import ExpertProfile  # noqa: E402

log = logging.getLogger("placement_heldout")
STDLIB = "/usr/lib/python3.11"
SKIPPED_DIRS = ("test", "tests", "idlelib", "lib2to3")


class RoutingLog(ExpertUsage):
    """ExpertUsage that also keeps every step's routing: steps [(is_decode bool [T], {layer: ids [T, K]})]."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = []

    def begin(self, batch):
        super().begin(batch)
        self.steps.append((self._decode_rows.copy(), {}))

    def record(self, layer, ids):
        super().record(layer, ids)
        self.steps[-1][1][layer] = np.array(ids, dtype=np.int64)


def stdlib_files(held_out):
    """Paths of the standard library's .py files the trained model held out (or trained on)."""
    found = []
    for root, dirs, files in os.walk(STDLIB):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(("site-packages", "__")))
        for name in sorted(files):
            if name.endswith(".py"):
                rel = "./" + os.path.relpath(os.path.join(root, name), STDLIB)
                if (int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0) == held_out:
                    found.append(os.path.join(root, name))
    return found


def code_prompts(tokenizer, files, count, length, rng):
    """`count` prompts of `length` tokens, each from a random place of a random file (as the model saw them)."""
    prompts = []
    while len(prompts) < count:
        path = files[rng.integers(len(files))]
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f"# file: ./{os.path.relpath(path, STDLIB)}\n" + f.read()
        ids = tokenizer.encode(text)
        if len(ids) < 2 * length:
            continue
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
    return prompts


def random_prompts(vocab_size, count, length, rng):
    return [rng.integers(16, vocab_size, size=length).tolist() for _ in range(count)]


def record(llm, prompts, decode, seed):
    """Per prompt: (prefill counts [L, E], prefill tokens, decode steps' ids [D][L] of [K])."""
    L, E, K = llm.config.num_layers, llm.config.num_experts, llm.config.num_experts_per_tok
    out = []
    for i, prompt in enumerate(prompts):
        usage = RoutingLog(L, E, K)
        llm.model.usage = usage
        llm.generate(prompt, max_tokens=decode, temperature=0.7, seed=seed + i, ignore_eos=True)
        prefill, tokens, steps = np.zeros((L, E), np.int64), 0, []
        for is_decode, by_layer in usage.steps:
            if is_decode.all() and len(is_decode) == 1:
                steps.append(np.stack([by_layer[layer][0] for layer in range(L)]))  # [L, K]
            else:
                tokens += len(is_decode)
                for layer in range(L):
                    prefill[layer] += np.bincount(by_layer[layer].ravel(), minlength=E)
        out.append((prefill, tokens, np.array(steps)))  # steps [D, L, K]
    return out


def save_records(path, key, recorded):
    """Writes {set name: records} (see `record`) with `key`, the settings they were made with."""
    arrays = {"key": np.array(key), "sets": np.array(list(recorded))}
    for i, records in enumerate(recorded.values()):
        arrays[f"prefill{i}"] = np.stack([r[0] for r in records])  # [N, L, E]
        arrays[f"tokens{i}"] = np.array([r[1] for r in records])  # [N]
        arrays[f"steps{i}"] = np.stack([r[2] for r in records])  # [N, D, L, K]
    np.savez_compressed(path, **arrays)


def load_records(path, key):
    """{set name: records} of `path` when it was written with `key`, else None."""
    if not os.path.exists(path):
        return None
    with np.load(path) as data:
        if str(data["key"]) != key:
            log.info("%s was recorded with other settings: recording again", path)
            return None
        return {str(name): list(zip(data[f"prefill{i}"], data[f"tokens{i}"].tolist(), data[f"steps{i}"]))
                for i, name in enumerate(data["sets"])}


def decode_counts(records, num_tokens, num_experts):
    """(int64 [L, E], tokens): the first `num_tokens` decode routings of each record (None: all)."""
    counts, tokens = 0, 0
    for _, _, steps in records:
        steps = steps[:num_tokens]
        tokens += len(steps)
        L = steps.shape[1]
        counts = counts + np.stack([np.bincount(steps[:, layer].ravel(), minlength=num_experts) for layer in range(L)])
    return counts, tokens


def profile_of(records, profile_decode, shape, k):
    """The profile of `records` as `strata profile` writes it: one part per prompt."""
    L, E = shape
    parts = [(r[0], *decode_counts([r], profile_decode, E), r[1]) for r in records]  # (prefill, decode, tokens)
    dec, dec_tokens = decode_counts(records, profile_decode, E)
    profile = ExpertProfile("heldout", k, sum(r[0] for r in records), dec, np.zeros((L, E, E), np.int64),
                            sum(r[1] for r in records), dec_tokens)
    return profile.with_parts(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]),
                              np.array([(p[3], p[2]) for p in parts]))


def masks(profile, sizes, num_slots):
    """({name: bool [L, E]} of every cache choice from one profile, the plan's check)."""
    layers = range(profile.num_layers)
    counts = profile.counts("all").astype(np.float64)
    one_part = ExpertProfile(profile.model_id, profile.num_experts_per_tok, profile.prefill, profile.decode,
                             profile.coactivation, profile.tokens_prefill, profile.tokens_decode)
    shape = (profile.num_layers, profile.num_experts)
    checked = plan_slots(profile, sizes, num_slots, batch=1)
    return {"plan": checked.resident_mask(*shape),
            "plan, unchecked": plan_slots(one_part, sizes, num_slots, batch=1).resident_mask(*shape),
            "global top-k": global_top_mask(counts, layers, num_slots),
            "uniform": uniform_mask(counts, layers, num_slots)}, checked.settings["check"]


def evaluate(records, args, sizes, k, shape, num_slots, rng):
    """{name: ([hit rate], [predicted step ms])} over the random halves."""
    scores = {}
    for _ in range(args.splits):
        order = rng.permutation(len(records))
        a, b = [records[i] for i in order[: len(order) // 2]], [records[i] for i in order[len(order) // 2:]]
        profile = profile_of(a, args.profile_decode, shape, k)
        scores.setdefault("prior strength", []).append(profile.decode_estimate()[1])
        held_counts, held_tokens = decode_counts(b, None, shape[1])
        cost = CostModel(held_counts / held_tokens, sizes, 1, Speeds(), 4096, "f16")
        choices, check = masks(profile, sizes, num_slots)
        scores.setdefault("plan kept", []).append(check["keep"])
        for name, mask in choices.items():
            hit = float(held_counts[mask].sum() / held_counts.sum())
            entry = scores.setdefault(name, ([], []))
            entry[0].append(hit)
            entry[1].append(1e3 * cost.step_seconds(mask))
    return scores


def table(results):
    lines = ["| prompt set | cache | choice | held-out decode hit rate, median (min-max) | predicted step ms, median "
             "| plan >= global top-k: hit rate / step, splits |", "|---|---|---|---|---|---|"]
    for (set_name, fraction), scores in results:
        top_hit, top_ms = scores["global top-k"]
        strength, kept = scores.pop("prior strength"), scores.pop("plan kept")
        log.info("%s, %.0f %%: the plan's prompt prior %.3g routings (median)", set_name, 100 * fraction,
                 np.median(strength))
        for name, (hits, ms) in scores.items():
            wins = ""
            if name.startswith("plan"):
                gap = 100 * (np.array(hits) - np.array(top_hit))  # hit-rate points over global top-k, per split
                wins = (f"{sum(h >= t - 1e-12 for h, t in zip(hits, top_hit))}/{len(hits)} / "
                        f"{sum(m <= t + 1e-12 for m, t in zip(ms, top_ms))}/{len(ms)}; points over top-k: "
                        f"median {np.median(gap):+.2f}, worst {gap.min():+.2f}")
            if name == "plan":
                wins += f"; check kept the plan in {sum(kept)}/{len(kept)}"
            lines.append(f"| {set_name} | {fraction:.0%} | {name} | {np.median(hits):.2%} ({min(hits):.2%}-"
                         f"{max(hits):.2%}) | {np.median(ms):.4f} | {wins} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models",
                                                         "tiny-code-moe"))
    parser.add_argument("--prompts", type=int, default=60, help="prompts per set (halved for profile / held out)")
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--decode", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument("--profile-decode", type=int, default=4, help="of which the profile keeps")
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", default=None,
                        help="an .npz keeping the recorded routings: read when it was made with the same model, "
                             "prompts and decode settings, written otherwise (scoring runs then skip generation)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = np.random.default_rng(args.seed)
    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=1024)
    c = llm.config
    shape, k = (c.num_layers, c.num_experts), c.num_experts_per_tok
    sizes = ModelSizes.from_weights(llm.weights)
    sets = {"held-out stdlib files": code_prompts(llm.tokenizer, stdlib_files(True), args.prompts,
                                                  args.prompt_tokens, rng),
            "training stdlib files": code_prompts(llm.tokenizer, stdlib_files(False), args.prompts,
                                                  args.prompt_tokens, rng),
            "random tokens": random_prompts(c.vocab_size, args.prompts, args.prompt_tokens, rng)}
    key = repr((os.path.abspath(args.model), args.prompts, args.prompt_tokens, args.decode, args.seed))
    cached = load_records(args.records, key) if args.records else None
    recorded = {}
    results = []
    for set_name, prompts in sets.items():
        log.info("%s: %d prompts of %d tokens, %d generated each", set_name, len(prompts), args.prompt_tokens,
                 args.decode)
        records = cached[set_name] if cached else record(llm, prompts, args.decode, args.seed)
        recorded[set_name] = records
        for fraction in map(float, args.fractions.split(",")):
            num_slots = int(round(fraction * shape[0] * shape[1]))
            results.append(((set_name, fraction), evaluate(records, args, sizes, k, shape, num_slots, rng)))
    if args.records and not cached:
        save_records(args.records, key, recorded)
    text = table(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Placement on held-out prompts ({os.path.basename(os.path.normpath(args.model))})\n\n"
                    f"    python bench/placement_heldout.py {' '.join(argv or sys.argv[1:])}\n\n"
                    f"{args.prompts} prompts per set of {args.prompt_tokens} tokens, {args.decode} generated each; "
                    f"profiles from a random half ({args.profile_decode} generated tokens per prompt), scored on "
                    f"the other half's decode routings, {args.splits} splits.\n\n{text}\n")


if __name__ == "__main__":
    main()
