"""Speculative decoding with n-gram drafts: acceptance and decode speed, with and without, at 1 and N slots.

Prompts come from the trained model's files (bench/placement_heldout.py `stdlib_files`):
- edit: a held-out file's start (whole lines, about `--length` tokens), then the same text with one identifier
  renamed, cut after half of its lines: the model continues the edited copy (what agents' code edits look like);
- edit-train: the same made from training files, which the model has memorized: it can continue the copy, as a
  model that copies from its context would (the best case for drafts);
- fresh: a held-out file's start alone, continued (new code: the drafts have only the file's own repetitions);
- train: a training file's start alone (memorized text, seldom repeating the prompt).
Each (set, slots) runs `--runs` times without and with drafts in turns, after an untimed warm-up; a run serves
every prompt of the set (greedy, `--decode` tokens) through an Engine with that many slots. Reported, as medians
over the runs: the median over requests of decode tok/s (llama.cpp's predicted_per_second), the process's CPU ms
per generated token (what other processes' load distorts least), drafted / accepted tokens, tokens per decode step
of a slot (1 + accepted drafts on average), and whether the outputs equal plain decoding's.

Then what a verification step costs: one sequence's steps of T one-token chunks (1 token and T - 1 drafts),
teacher-forced over a held-out file's text (real routing: each token its own experts), ms a step against T = 1,
with the distinct experts a layer reads per step.

    python bench/speculative.py --model ../shared/models/tiny-code-moe --threads 1 --out bench/results/speculative.md
"""
import argparse
import logging
import os
import re
import statistics
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.placement_heldout import STDLIB, stdlib_files  # noqa: E402
from hybrid.batch import Batch, SeqChunk  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.expert_usage import ExpertUsage  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from hybrid.request import Finished, Request  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from hybrid.speculative import SpecSettings  # noqa: E402

log = logging.getLogger("speculative")
IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
DEFINED = re.compile(r"^\s*def (\w+)|^\s*class (\w+)|^\s*(\w+) =", re.M)


def file_start(tokenizer, path, length):
    """(header, the file's first whole lines of about `length` tokens)."""
    header = f"# file: ./{os.path.relpath(path, STDLIB)}\n"
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines(keepends=True)
    text = ""
    for line in lines:
        if len(tokenizer.encode(text + line)) > length:
            break
        text += line
    return header, text


def renamed(text):
    """text with the name it defines (def, class, assignment) that it uses most, if twice or more, renamed
    new_<name>; or None."""
    defined = {n for groups in DEFINED.findall(text) for n in groups if len(n) > 2}
    counts = Counter(w for w in IDENTIFIER.findall(text) if w in defined)
    name, n = counts.most_common(1)[0] if counts else (None, 0)
    return re.sub(rf"\b{name}\b", f"new_{name}", text) if n >= 2 else None


def edit_prompt(tokenizer, path, length, eos):
    """(prompt ids, expected continuation text) of an edit prompt from `path`: its start, then the same text with
    a name renamed, cut after half its lines; None where the file is too short or names nothing twice."""
    header, text = file_start(tokenizer, path, length)
    edited = renamed(text)
    if len(tokenizer.encode(text)) < length // 2 or edited is None:
        return None
    lines = edited.splitlines(keepends=True)
    half = "".join(lines[:len(lines) // 2])
    return tokenizer.encode(header + text + eos + header + half), edited[len(half):]


def prompt_sets(tokenizer, count, length, eos):
    """{"edit", "edit-train", "fresh", "train": [prompt ids]} (count each), the edit prompts' expected
    continuations (text) and their files."""
    sets, expected, paths = {"edit": [], "edit-train": [], "fresh": [], "train": []}, [], []
    for path in stdlib_files(True):
        made = edit_prompt(tokenizer, path, length, eos) if len(sets["edit"]) < count else None
        if made is not None:
            sets["edit"].append(made[0])
            expected.append(made[1])
            paths.append(path)
            sets["fresh"].append(tokenizer.encode("".join(file_start(tokenizer, path, length))))
    for path in stdlib_files(False)[::25]:
        made = edit_prompt(tokenizer, path, length, eos) if len(sets["edit-train"]) < count else None
        if made is not None:
            sets["edit-train"].append(made[0])
        if len(sets["train"]) < count:
            sets["train"].append(tokenizer.encode("".join(file_start(tokenizer, path, length))))
    return sets, expected, paths


def copied_chars(tokenizer, outputs, expected):
    """Median characters of each expected continuation that the output reproduces before it first differs."""
    lengths = []
    for ids, want in zip(outputs, expected):
        got = tokenizer.decode(ids)
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        lengths.append(n)
    return statistics.median(lengths)


def serve(llm, prompts, slots, speculation, decode):
    """Results of `prompts` (greedy) through a fresh engine."""
    engine = Engine(llm, num_slots=slots, max_queue=len(prompts), speculation=speculation).start()
    try:
        handles = [engine.submit(Request(list(p), SamplingParams(max_tokens=decode, temperature=0)))
                   for p in prompts]
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    failed = [r for r in results if not isinstance(r, Finished)]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    return results


def summary(results, cpu_s):
    """decode tok/s (median request), drafted, accepted, tokens per step, CPU ms per decoded token of one run's
    results (cpu_s: the process's CPU seconds over the run's decoding: the run's less a prompts-only run's; each
    request's first token comes from its prompt's pass)."""
    t = [r.timings for r in results]
    generated = sum(x["predicted_n"] for x in t)
    drafted, accepted = sum(x.get("draft_n", 0) for x in t), sum(x.get("draft_n_accepted", 0) for x in t)
    return dict(tok_s=statistics.median(x["predicted_per_second"] for x in t), drafted=drafted, accepted=accepted,
                per_step=generated / (generated - accepted), cpu_ms=cpu_s * 1e3 / (generated - len(results)))


def cpu_seconds(run):
    """(run's result, the process's CPU seconds over it)."""
    cpu0 = time.process_time()
    result = run()
    return result, time.process_time() - cpu0


def measure(llm, prompts, slots, spec, decode, runs):
    """Plain and drafting runs taken in turns (the machine's load hits both alike), after an untimed warm-up of
    each: (plain, drafting) medians over the runs, each with every run's tok/s, and each one's outputs."""
    for speculation in (None, spec):
        serve(llm, prompts[:slots], slots, speculation, 8)  # compiles this batch size's kernels
    rows, outputs = ([], []), [None, None]
    for _ in range(runs):
        _, prompts_cpu = cpu_seconds(lambda: serve(llm, prompts, slots, None, 1))
        for i, speculation in enumerate((None, spec)):
            results, cpu = cpu_seconds(lambda: serve(llm, prompts, slots, speculation, decode))
            rows[i].append(summary(results, cpu - prompts_cpu))
            outputs[i] = [r.token_ids for r in results]
    medians = []
    for runs_of in rows:
        m = {key: statistics.median(r[key] for r in runs_of) for key in ("tok_s", "drafted", "accepted", "per_step", "cpu_ms")}
        m["tok_s_all"] = [r["tok_s"] for r in runs_of]
        medians.append(m)
    return medians[0], outputs[0], medians[1], outputs[1]


class _DistinctExperts(ExpertUsage):
    """ExpertUsage that also keeps how many distinct experts each layer's routing of a step picked."""

    def __init__(self, *args):
        super().__init__(*args)
        self.layer_counts = []

    def record(self, layer, ids):
        super().record(layer, ids)
        self.layer_counts.append(len(np.unique(np.asarray(ids))))


def step_costs(model, text_ids, max_t, runs, start=256, span=240):
    """[(T, median wall ms, median CPU ms, distinct experts a layer)] of one sequence's steps of T one-token chunks
    (T = 1..max_t), teacher-forced over text_ids[start:start + span] after reading text_ids[:start]; each T's
    median over its steps, then the median over `runs` rounds taken in turns."""
    kv = model.new_sequence(start + span + 8)
    model.forward(Batch([SeqChunk(kv, 0, np.asarray(text_ids[:start]), "none")]))
    walls, cpus, experts, kept_usage = {}, {}, {}, model.usage
    for _ in range(runs):
        for t in range(1, max_t + 1):
            kv.rollback(start)
            wall, cpu, usage = [], [], _DistinctExperts.for_config(model.config)
            model.usage = usage
            try:
                for pos in range(start, start + span - t + 1, t):
                    batch = Batch([SeqChunk(kv, pos + i, np.asarray(text_ids[pos + i:pos + i + 1])) for i in range(t)])
                    w0, c0 = time.perf_counter(), time.process_time()
                    model.forward(batch)
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
            finally:
                model.usage = kept_usage
            walls.setdefault(t, []).append(statistics.median(wall) * 1e3)
            cpus.setdefault(t, []).append(statistics.median(cpu) * 1e3)
            experts[t] = statistics.mean(usage.layer_counts)
    kv.rollback(0)
    return [(t, statistics.median(walls[t]), statistics.median(cpus[t]), experts[t]) for t in walls]


def cost_table(costs):
    lines = ["| T (1 + drafts) | ms a step, wall (ratio to T=1) | ms a step, CPU (ratio) | distinct experts a layer |",
             "|---|---|---|---|"]
    wall1, cpu1 = costs[0][1], costs[0][2]
    for t, wall, cpu, experts in costs:
        lines.append(f"| {t} | {wall:.2f} ({wall / wall1:.2f}) | {cpu:.2f} ({cpu / cpu1:.2f}) | {experts:.1f} |")
    return "\n".join(lines)


def table(results, spec):
    lines = ["| prompts | slots | drafts | decode tok/s per request, median (runs) | speed-up | decode CPU ms a "
             "token (speed-up) | drafted | accepted | acceptance | tokens per step | output = plain |", "|" + "---|" * 11]
    for (name, slots), (plain, plain_out, drafted, drafted_out) in results.items():
        for label, s, out in (("off", plain, plain_out), (f"n-gram K={spec.k}", drafted, drafted_out)):
            runs = ", ".join(f"{x:.1f}" for x in s["tok_s_all"])
            rate = f"{s['accepted'] / s['drafted']:.0%}" if s["drafted"] else "-"
            lines.append(f"| {name} | {slots} | {label} | {s['tok_s']:.1f} ({runs}) | "
                         f"{s['tok_s'] / plain['tok_s']:.2f}x | {s['cpu_ms']:.2f} ({plain['cpu_ms'] / s['cpu_ms']:.2f}x) | "
                         f"{s['drafted']:.0f} | {s['accepted']:.0f} | {rate} | "
                         f"{s['per_step']:.2f} | {'yes' if out == plain_out else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--length", type=int, default=300, help="tokens of a file's start")
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--slots", default="1,4")
    parser.add_argument("--spec", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--min-p", type=float, default=0.5)
    parser.add_argument("--sets", default="edit,edit-train,fresh", help="prompt sets, comma-separated ('': none)")
    parser.add_argument("--cost-runs", type=int, default=5, help="rounds of the verification step costs (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, device=args.device, threads=args.threads, max_context=2048,
              kv_sequences=max(int(s) for s in args.slots.split(",")))
    spec = SpecSettings(args.spec, args.ngram, args.min_p)
    eos = llm.tokenizer.token_text(llm.tokenizer.eos_id)
    sets, expected, edit_paths = prompt_sets(llm.tokenizer, args.prompts, args.length, eos)
    results = {}
    for name in filter(None, args.sets.split(",")):
        for slots in (int(s) for s in args.slots.split(",")):
            t0 = time.perf_counter()
            results[name, slots] = plain, plain_out, drafted, drafted_out = measure(
                llm, sets[name], slots, spec, args.decode, args.runs)
            print(f"{name} x{slots}: {plain['tok_s']:.1f} -> {drafted['tok_s']:.1f} tok/s, "
                  f"{drafted['accepted']:.0f}/{drafted['drafted']:.0f} accepted ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    parts = [table(results, spec)] if results else []
    if ("edit", 1) in results:
        parts.append(f"Edit prompts: the plain greedy output reproduces a median of "
                     f"{copied_chars(llm.tokenizer, results['edit', 1][1], expected):.0f} characters of the edited "
                     f"text's expected continuation.")
    if args.cost_runs:
        path = edit_paths[0]
        text_ids = llm.tokenizer.encode("".join(file_start(llm.tokenizer, path, 1000)))
        costs = step_costs(llm.model, text_ids, args.spec + 1, args.cost_runs)
        parts.append(f"One sequence's verification step of T tokens, teacher-forced over "
                     f"{os.path.relpath(path, STDLIB)} (medians of each T's steps, then of {args.cost_runs} rounds):"
                     f"\n\n{cost_table(costs)}")
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        lengths = [len(p) for p in sets["edit"]]
        write_keeping_sections(args.out, (
            f"# Speculative decoding (n-gram drafts) on {os.path.basename(os.path.normpath(args.model))}\n\n"
            f"    python bench/speculative.py {' '.join(argv or sys.argv[1:])}\n\n"
            f"{len(sets['edit'])} prompts a set (edit-train: training files; the others: held-out files); edit prompts "
            f"{min(lengths)}-{max(lengths)} tokens; "
            f"greedy, {args.decode} tokens; device {args.device}, threads {args.threads or 'all'}; "
            f"load average at the end {os.getloadavg()[0]:.1f}.\n\n{text}\n"))
    return 0


KEPT_SECTIONS = ("## MTP", "## What this says")  # sections of the results file that other runs or people write


def write_keeping_sections(path, text):
    """Write text to path, followed by the KEPT_SECTIONS the file already has (from the first one on)."""
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        starts = [i for i in (old.find("\n" + title) for title in KEPT_SECTIONS) if i >= 0]
        kept = old[min(starts):] if starts else ""
    with open(path, "w") as f:
        f.write(text + kept)

if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
