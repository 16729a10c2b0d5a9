"""Speculative decoding with n-gram drafts: acceptance and decode speed, with and without, at 1 and N slots.

Prompts come from the trained model's held-out files (bench/placement_heldout.py `stdlib_files`):
- edit: a file's start (whole lines, about `--length` tokens), then the same text with one identifier renamed,
  cut after half of its lines: the model continues the edited copy (what agents' code edits look like);
- fresh: a file's start alone, continued (new code: the drafts have only the file's own repetitions);
- train: a training file's start (memorized: the model's best case, its text repeats as the file does).
Each (set, slots) runs `--runs` times without and with drafts in turns, after an untimed warm-up; a run serves
every prompt of the set (greedy, `--decode` tokens) through an Engine with that many slots. Reported, as medians over the runs: the
median over requests of decode tok/s (llama.cpp's predicted_per_second), drafted / accepted tokens, tokens
per decode step of a slot (1 + accepted drafts on average), and whether the outputs equal plain decoding's.

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


def prompt_sets(tokenizer, count, length, eos):
    """{"edit": [ids], "fresh": [ids], "train": [ids]} from the first held-out files long enough to give a
    prompt (train: training files' starts, which the model has memorized), and the edit prompts' expected
    continuations (text)."""
    sets, expected = {"edit": [], "fresh": [], "train": []}, []
    for path in stdlib_files(True):
        if len(sets["edit"]) == count:
            break
        header, text = file_start(tokenizer, path, length)
        edited = renamed(text)
        if len(tokenizer.encode(text)) < length // 2 or edited is None:
            continue
        lines = edited.splitlines(keepends=True)
        half = "".join(lines[:len(lines) // 2])
        sets["edit"].append(tokenizer.encode(header + text + eos + header + half))
        sets["fresh"].append(tokenizer.encode(header + text))
        expected.append(edited[len(half):])
    for path in stdlib_files(False)[::25][:count]:
        sets["train"].append(tokenizer.encode("".join(file_start(tokenizer, path, length))))
    return sets, expected


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
    """decode tok/s (median request), drafted, accepted, tokens per step, CPU ms per generated token of one run's
    results (cpu_s: the process's CPU seconds over the run)."""
    t = [r.timings for r in results]
    generated = sum(x["predicted_n"] for x in t)
    drafted, accepted = sum(x.get("draft_n", 0) for x in t), sum(x.get("draft_n_accepted", 0) for x in t)
    return dict(tok_s=statistics.median(x["predicted_per_second"] for x in t), drafted=drafted, accepted=accepted,
                per_step=generated / (generated - accepted), cpu_ms=cpu_s * 1e3 / generated)


def measure(llm, prompts, slots, spec, decode, runs):
    """Plain and drafting runs taken in turns (the machine's load hits both alike), after an untimed warm-up of
    each: (plain, drafting) medians over the runs, each with every run's tok/s, and each one's outputs."""
    for speculation in (None, spec):
        serve(llm, prompts[:slots], slots, speculation, 8)  # compiles this batch size's kernels
    rows, outputs = ([], []), [None, None]
    for _ in range(runs):
        for i, speculation in enumerate((None, spec)):
            cpu0 = time.process_time()
            results = serve(llm, prompts, slots, speculation, decode)
            rows[i].append(summary(results, time.process_time() - cpu0))
            outputs[i] = [r.token_ids for r in results]
    medians = []
    for runs_of in rows:
        m = {key: statistics.median(r[key] for r in runs_of) for key in ("tok_s", "drafted", "accepted", "per_step", "cpu_ms")}
        m["tok_s_all"] = [r["tok_s"] for r in runs_of]
        medians.append(m)
    return medians[0], outputs[0], medians[1], outputs[1]


def step_costs(model, prompt, max_k, reps):
    """Median ms of one slot's decode step scoring 1 + k tokens (as the engine batches them), k = 0..max_k."""
    kv = model.new_sequence(2048)
    model.forward(Batch([SeqChunk(kv, 0, np.asarray(prompt), "none")]))
    start, costs = kv.length, []
    for k in range(max_k + 1):
        times = []
        for _ in range(reps):
            chunks = [SeqChunk(kv, start + i, np.asarray(prompt[i:i + 1])) for i in range(k + 1)]
            t0 = time.perf_counter()
            model.forward(Batch(chunks))
            times.append(time.perf_counter() - t0)
            kv.rollback(start)
        costs.append(statistics.median(times) * 1e3)
    return costs


def table(results, spec):
    lines = ["| prompts | slots | drafts | decode tok/s per request, median (runs) | speed-up | CPU ms per token "
             "(ratio) | drafted | accepted | acceptance | tokens per step | output = plain |", "|" + "---|" * 11]
    for (name, slots), (plain, plain_out, drafted, drafted_out) in results.items():
        for label, s, out in (("off", plain, plain_out), (f"n-gram K={spec.k}", drafted, drafted_out)):
            runs = ", ".join(f"{x:.1f}" for x in s["tok_s_all"])
            rate = f"{s['accepted'] / s['drafted']:.0%}" if s["drafted"] else "-"
            lines.append(f"| {name} | {slots} | {label} | {s['tok_s']:.1f} ({runs}) | "
                         f"{s['tok_s'] / plain['tok_s']:.2f}x | {s['cpu_ms']:.2f} ({s['cpu_ms'] / plain['cpu_ms']:.2f}) | "
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
    parser.add_argument("--sets", default="edit,fresh,train")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, device=args.device, threads=args.threads, max_context=2048,
              kv_sequences=max(int(s) for s in args.slots.split(",")))
    spec = SpecSettings(args.spec, args.ngram, args.min_p)
    eos = llm.tokenizer.token_text(llm.tokenizer.eos_id)
    sets, expected = prompt_sets(llm.tokenizer, args.prompts, args.length, eos)
    results = {}
    for name in args.sets.split(","):
        for slots in (int(s) for s in args.slots.split(",")):
            t0 = time.perf_counter()
            results[name, slots] = plain, plain_out, drafted, drafted_out = measure(
                llm, sets[name], slots, spec, args.decode, args.runs)
            print(f"{name} x{slots}: {plain['tok_s']:.1f} -> {drafted['tok_s']:.1f} tok/s, "
                  f"{drafted['accepted']:.0f}/{drafted['drafted']:.0f} accepted ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    costs = step_costs(llm.model, sets["edit"][0], args.spec, 30)
    text = (table(results, spec) + "\n\nOne slot's decode step with k drafts (median of 30), ms: "
            + ", ".join(f"k={k} {ms:.1f}" for k, ms in enumerate(costs)) + ".")
    if ("edit", 1) in results:
        text += (f"\n\nEdit prompts: the plain greedy output reproduces a median of "
                 f"{copied_chars(llm.tokenizer, results['edit', 1][1], expected):.0f} characters of the edited "
                 f"text's expected continuation.")
    print(text)
    if args.out:
        lengths = [len(p) for p in sets["edit"]]
        with open(args.out, "w") as f:
            f.write(f"# Speculative decoding (n-gram drafts) on {os.path.basename(os.path.normpath(args.model))}\n\n"
                    f"    python bench/speculative.py {' '.join(argv or sys.argv[1:])}\n\n"
                    f"{len(sets['edit'])} held-out files; edit prompts {min(lengths)}-{max(lengths)} tokens; "
                    f"greedy, {args.decode} tokens; device {args.device}, threads {args.threads or 'all'}; "
                    f"load average at the end {os.getloadavg()[0]:.1f}.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
