"""Pipeline stages on one GPU presented as two logical devices (`--gpus 0,0`) against the one-device engine: what
the stages themselves cost (issue 39's target: at most 10 % of decode and prompt-read speed), what pipelined slot
groups give several users at once, and the host RAM that trimmed stage weights save.

Tables (the same resident experts in both engines: the first share of each layer's experts):
- decode tok/s (one user) and prompt-read tok/s, one device vs two stages, and the stages' overhead;
- --users requests at once through the serving engine: total tok/s with the groups in sequence (--batch-groups 1)
  and pipelined (auto: a group per stage);
- host RAM the weights' copies take (MiB) without and with --trim-stage-weights.

    python bench/stages.py --model /tmp/bench-8g.gguf [--share 50] [--split auto] [--decode-tokens 32]
        [--prompt-tokens 1024] [--users 4] [--output bench/results/stages.md]

Two physical GPUs: the same command with --gpus 0,1 measures the two-card speed-up and the peer copies.
"""
import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path


sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_model import first_experts, prompt  # noqa: E402
from hybrid import LLM  # noqa: E402
from hybrid.formats import load_model  # noqa: E402

log = logging.getLogger("bench.stages")
MIB = 1 << 20


def rates(llm, decode_tokens, prompt_tokens, runs):
    """([decode tok/s of one user after a 32-token prompt], [prompt-read tok/s of a prompt_tokens prompt]), one of
    each a run, after a warm-up that compiles the kernels."""
    llm.generate(prompt(llm, 32, 0), max_tokens=4, temperature=0, ignore_eos=True)
    decode, read = [], []
    for run in range(runs):
        out = llm.generate(prompt(llm, 32, 1 + run), max_tokens=decode_tokens, temperature=0, ignore_eos=True)
        decode.append(out.timings["predicted_per_second"])
        out = llm.generate(prompt(llm, prompt_tokens, 100 + run), max_tokens=1, temperature=0, ignore_eos=True)
        read.append(out.timings["prompt_per_second"])
    return decode, read


def spread(values, digits):
    """'median (low-high)' of a run's values."""
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
            if len(values) > 1 else f"{values[0]:.{digits}f}")


def together(llm, users, num_tokens):
    """Total tok/s of `users` greedy requests decoded at once by the serving engine."""
    from hybrid.engine import Engine
    from hybrid.request import Finished, Request
    from hybrid.sampling import SamplingParams

    engine = Engine(llm, num_slots=users).start()
    try:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        engine.submit(Request(prompt(llm, 16, 99), SamplingParams(max_tokens=4, temperature=0))).result()  # warm
        t0 = time.perf_counter()
        handles = [engine.submit(Request(prompt(llm, 32, 10 + u), params)) for u in range(users)]
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
    finally:
        engine.stop()
    failed = [r for r in results if not isinstance(r, Finished)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {users} requests failed: {failed[0]}")
    return sum(len(r.token_ids) for r in results) / wall


def copied_bytes(llm):
    """Bytes of the weights the host copied into RAM (the rest stays mapped from the file)."""
    return sum(t.raw.nbytes for t in llm.weights.tensors.values() if t.raw.flags.writeable)


def engine(args, gpus, resident, **settings):
    return LLM(args.model, device="gpu", gpus=gpus, max_context=args.prompt_tokens + 64, kv_sequences=args.users,
               resident=resident, layer_split=args.split, **settings)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gpus", default="0,0", help="the stages' GPUs (default 0,0: one GPU as two logical devices)")
    p.add_argument("--share", type=int, default=50, help="resident share of each layer's experts, percent")
    p.add_argument("--split", default="auto", help="--layer-split of the stages")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--runs", type=int, default=3, help="decode and prompt-read runs of each engine (medians)")
    p.add_argument("--output", type=Path, help="also write the tables here")
    args = p.parse_args(argv)
    args.split = args.split if args.split == "auto" else tuple(int(k) for k in args.split.split(","))
    gpus = tuple(int(g) for g in args.gpus.split(","))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    lines = [f"# Pipeline stages: {Path(args.model).name}, --gpus {args.gpus}, {args.share} % resident, "
             f"--layer-split {args.split}", ""]
    measured, resident = {}, first_experts(load_model(args.model).config, args.share)
    for name, stage_gpus in (("one device", gpus[:1]), ("stages", gpus)):
        for trim in (False, True) if name == "stages" else (None,):
            llm = engine(args, stage_gpus, resident, trim_stage_weights=trim)
            key = name if trim is None else f"{name}, trim {'on' if trim else 'off'}"
            measured[key] = dict(ram=(copied_bytes(llm) if name == "one device" else llm.model.host_bytes) / MIB)
            if trim is not True:
                measured[key].update(zip(("decode", "read"), rates(llm, args.decode_tokens, args.prompt_tokens,
                                                                     args.runs)))
                if name == "stages":
                    for groups in (1, "auto"):
                        llm.model.batch_groups = groups
                        measured[key][f"users {groups}"] = together(llm, args.users, args.decode_tokens)
                else:
                    measured[key]["users 1"] = together(llm, args.users, args.decode_tokens)
            device = llm.model.backend.describe_kv(llm.model.kv_pool, args.prompt_tokens)
            log.info("%s: %s; %s", key, measured[key], device)
            llm.close()
            del llm
            gc.collect()
    lines += tables(measured, args)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


def tables(m, args):
    one, stages, trimmed = m["one device"], m["stages, trim off"], m["stages, trim on"]
    med = statistics.median
    overhead = lambda a, b: f"{100 * (1 - med(b) / med(a)):+.1f} %"  # noqa: E731
    return [f"Medians of {args.runs} runs (lowest-highest):", "",
            "| engine | decode tok/s | prompt read tok/s |", "|---|---|---|",
            f"| one device | {spread(one['decode'], 1)} | {spread(one['read'], 0)} |",
            f"| two stages | {spread(stages['decode'], 1)} | {spread(stages['read'], 0)} |",
            f"| stages' cost | {overhead(one['decode'], stages['decode'])} | {overhead(one['read'], stages['read'])} |",
            "", f"{args.users} users at once, {args.decode_tokens} tokens each (total tok/s):", "",
            "| one device | two stages in sequence (--batch-groups 1) | two stages pipelined (auto) |",
            "|---|---|---|",
            f"| {one['users 1']:.1f} | {stages['users 1']:.1f} | {stages['users auto']:.1f} |",
            "", "Host RAM the weights' copies take (the rest stays mapped from the file):", "",
            "| one device | two stages | two stages, --trim-stage-weights |", "|---|---|---|",
            f"| {one['ram']:.1f} MiB | {stages['ram']:.1f} MiB | {trimmed['ram']:.1f} MiB |"]


if __name__ == "__main__":
    sys.exit(main())
