"""MTP / NextN drafts on a model with a trained head: acceptance and tokens per step, against n-gram drafts.

The model: tiny-code-moe with the NextN layer bench/train_mtp.py trained (on its training files only). Prompts:
bench/speculative.py's sets (edit and fresh from held-out files, train from training files). Each (set, slots,
drafter, K, min_p) serves every prompt greedily through an Engine whose clock makes every step look equally long, so the
draft policy (speculative/policy.py) drafts K wherever the drafter's confidence stays >= min_p: the numbers are
the drafter's, not the policy's choice on this machine (where a draft costs about a whole token: the n-gram
section above). Reported: drafted, accepted, acceptance, tokens per step of a slot (1 + accepted drafts per
verification step), whether the outputs equal plain greedy's, and the MTP layer's own time per drafted token.

    python bench/mtp.py --model /tmp/strata/mtp/tiny-code-moe-mtp.gguf --threads 1 --out bench/results/speculative.md
"""
import argparse
import itertools
import logging
import os
import sys
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.speculative import prompt_sets  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.llm import LLM  # noqa: E402
from hybrid.request import Finished, Request  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from hybrid.speculative import SpecSettings  # noqa: E402
from hybrid.speculative.mtp import MtpDrafter  # noqa: E402

SECTION = "## MTP"
DRAFTS = ((True, 1, 0.0), (True, 4, 0.0), (True, 4, 0.5), (False, 4, 0.0), (False, 4, 0.5))  # (MTP?, K, min_p)


class DraftTimer:
    """Seconds spent in the MTP drafter (MtpDrafter.draft and add_hidden, where it reads positions through its
    layer) and the tokens it drafted (wrapped while the bench runs)."""

    def __init__(self):
        self.seconds, self.tokens = 0.0, 0
        self._methods = {"draft": MtpDrafter.draft, "add_hidden": MtpDrafter.add_hidden}

    def __enter__(self):
        for name, method in self._methods.items():
            setattr(MtpDrafter, name, self._timed(method, name == "draft"))
        return self

    def _timed(self, method, counts):
        def timed(drafter, *args):
            t0 = time.perf_counter()
            out = method(drafter, *args)
            self.seconds += time.perf_counter() - t0
            self.tokens += len(out) if counts else 0
            return out

        return timed

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(MtpDrafter, name, method)


def serve(llm, prompts, slots, speculation, decode):
    """Token ids and summed draft counters of `prompts` served greedily, every step timed alike."""
    ticks = itertools.count()
    engine = Engine(llm, num_slots=slots, max_queue=len(prompts), speculation=speculation,
                    clock=lambda: next(ticks) * 1e-3).start()
    try:
        handles = [engine.submit(Request(list(p), SamplingParams(max_tokens=decode, temperature=0))) for p in prompts]
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    if any(not isinstance(r, Finished) for r in results):
        raise RuntimeError("a request failed")
    drafted = sum(r.timings.get("draft_n", 0) for r in results)
    accepted = sum(r.timings.get("draft_n_accepted", 0) for r in results)
    generated = sum(r.timings["predicted_n"] for r in results)
    return [r.token_ids for r in results], drafted, accepted, generated


def row(name, slots, label, plain_ids, measured, draft_ms=None):
    ids, drafted, accepted, generated = measured
    rate = f"{accepted / drafted:.0%}" if drafted else "-"
    ms = f"{draft_ms:.2f}" if draft_ms is not None else "-"
    per_step = generated / (generated - accepted)
    return (f"| {name} | {slots} | {label} | {drafted} | {accepted} | {rate} | {per_step:.2f} | {ms} "
            f"| {'yes' if ids == plain_ids else 'NO'} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF with a NextN / MTP layer")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=300)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--slots", default="1,4")
    p.add_argument("--sets", default="edit,fresh,train")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    slot_counts = [int(s) for s in args.slots.split(",")]
    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=2048, kv_sequences=max(slot_counts))
    if not llm.model.nextn_layers:
        raise SystemExit(f"{args.model} has no NextN / MTP layer (bench/train_mtp.py writes one)")
    eos = llm.tokenizer.token_text(llm.tokenizer.eos_id)
    sets = prompt_sets(llm.tokenizer, args.prompts, args.length, eos)[0]
    lines = ["| prompts | slots | drafts | drafted | accepted | acceptance | tokens per step | MTP ms per draft "
             "| output = plain |", "|" + "---|" * 9]
    for name in filter(None, args.sets.split(",")):
        for slots in slot_counts:
            t0 = time.perf_counter()
            plain = serve(llm, sets[name], slots, None, args.decode)
            lines.append(row(name, slots, "off", plain[0], plain))
            for mtp, k, min_p in DRAFTS:
                label = f"{'MTP' if mtp else 'n-gram'} K={k}" + (f", min_p {min_p}" if min_p else "")
                with DraftTimer() as timer:
                    measured = serve(llm, sets[name], slots, SpecSettings(k=k, min_p=min_p, mtp=mtp), args.decode)
                lines.append(row(name, slots, label, plain[0], measured,
                                 timer.seconds * 1e3 / timer.tokens if mtp and timer.tokens else None))
            print(f"{name} x{slots} ({time.perf_counter() - t0:.0f} s)", flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        lengths = [len(x) for x in sets["edit"]]
        about = textwrap.fill(
            f"{args.prompts} prompts a set (edit prompts {min(lengths)}-{max(lengths)} tokens); greedy, "
            f"{args.decode} tokens; CPU, threads {args.threads or 'all'}; every step timed alike, so each slot "
            f"drafts K whenever the drafter's confidence stays >= min_p (0 where not said; the policy's choice mostly "
            f"left out: its step-time estimates still vary a little). MTP ms per draft: the drafter's own time (its layer op by op on the CPU, the prompts' reads "
            f"through the layer included) per drafted token.", 116, break_on_hyphens=False)
        write_section(args.out, f"{SECTION} drafts on tiny-code-moe with a trained NextN layer\n\n"
                                f"    python bench/mtp.py {' '.join(argv or sys.argv[1:])}\n\n{about}\n\n{text}\n")
    return 0


def write_section(path, text):
    """Replace the file's SECTION (up to the next '## ' heading) with text, or append it."""
    old = open(path).read() if os.path.exists(path) else ""
    start = old.find("\n" + SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + 1)
        new = old[:start + 1] + text + (old[end:] if end >= 0 else "")
    with open(path, "w") as f:
        f.write(new)


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
