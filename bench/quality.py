"""What rounder settings cost in quality on a trained model, as llama.cpp's `llama-perplexity --kl-divergence`
measures it: perplexity on held-out text, and the mean KL divergence of each next-token distribution from the
reference run's (F32 weights, float activations, F32 KV), for each weight file x activation rounding x KV encoding;
with --device gpu, for each weight file x --gemm-maths on the GPU (every expert resident: a prompt's matmuls and
attention multiply as gemm_math says), against the reference file read on the CPU.

The model is ../shared/models/tiny-code-moe (a qwen3moe trained on Python's standard library); its held-out files
are those whose path's SHA-1 is divisible by 20 (its README). The text is read in chunks of --context tokens, each
chunk's first --skip positions only as context (scored: the rest), on the CPU backend.

    python bench/quality.py --ref /tmp/tcm-f32.gguf --weights Q8_0=/tmp/tcm-Q8_0.gguf \
        --weights Q4_K_M=/tmp/tcm-Q4_K_M.gguf --weights IQ4_XS=/tmp/tcm-IQ4_XS.gguf --output bench/results/quality.md
    python bench/quality.py --ref /tmp/tcm-q4_0.gguf --device gpu --gemm-maths tf32x3,tf32 --chunks /tmp/tcm-chunks.npy

--chunks: the held-out token chunks as a .npy, written where it does not exist yet and read where it does (a machine
without this Python's standard library reads the same text).
"""
import argparse
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
log = logging.getLogger("bench.quality")
ACTS = ("float", "int16", "int8")
KVS = ("f32", "f16", "int8")


def held_out_files(stdlib="/usr/lib/python3.11"):
    """The held-out files of tiny-code-moe's README, each as its training text writes it."""
    parts = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "lib2to3", "__pycache__",
                                                              "site-packages", "dist-packages"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = "./" + os.path.relpath(os.path.join(dirpath, name), stdlib)
            if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0:
                with open(os.path.join(dirpath, name), errors="replace") as f:
                    parts.append(f"# file: {rel}\n{f.read()}")
    return parts


def chunk_logits(llm, chunk, skip, path):
    """Next-token logits [len(chunk) - 1 - skip, V] of a chunk's positions from `skip` on: read with the prompt
    (one call), or decoded one token at a time after a `skip`-token prompt (the decode path, teacher-forced)."""
    if path == "prefill":
        return llm.score(chunk[:-1])[skip:]
    from hybrid.batch import Batch, SeqChunk

    model = llm.model
    kv = model.new_sequence(len(chunk))
    rows = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(chunk[:skip + 1]), "last")]))]
    for pos in range(skip + 1, len(chunk) - 1):
        rows.append(model.forward(Batch([SeqChunk(kv, pos, np.asarray(chunk[pos:pos + 1]))])))
    return np.concatenate(rows)


def log_probs(path, chunks, context, skip, mode, device="cpu", **settings):
    """log-softmax of the scored positions' next-token logits [N, V] and the tokens they predict [N]."""
    from hybrid import LLM

    llm = LLM(path, device=device, max_context=context + 1, **settings)
    out, targets = [], []
    for chunk in chunks:
        rows = chunk_logits(llm, chunk, skip, mode).astype(np.float64)
        rows -= rows.max(axis=1, keepdims=True)
        out.append(rows - np.log(np.exp(rows).sum(axis=1, keepdims=True)))
        targets.append(np.asarray(chunk[skip + 1:]))
    llm.close()
    return np.concatenate(out), np.concatenate(targets)


def measure(args, chunks):
    ref, targets = log_probs(args.ref, chunks, args.context, args.skip, args.path, act_quant="float", kv="f32",
                             threads=args.threads)
    rows = [("reference", "cpu", "float", "f32", ref, None)]
    if args.device == "gpu":
        runs = [(name, path, "gpu " + math, dict(gemm_math=math, kv="f32")) for name, path in
                [("reference", args.ref)] + args.weights for math in args.gemm_maths]
    else:
        runs = [("reference", args.ref, "cpu", dict(act_quant="float", kv=kv)) for kv in args.kvs if kv != "f32"]
        runs += [(name, path, "cpu", dict(act_quant=act, kv=kv)) for name, path in args.weights for act in args.acts
                 for kv in args.kvs]
    for name, path, where, settings in runs:
        t0 = time.perf_counter()
        act, kv = settings.get("act_quant", "auto"), settings["kv"]
        try:
            lp, _ = log_probs(path, chunks, args.context, args.skip, args.path, device=where.split()[0],
                              threads=args.threads, **settings)
        except Exception as exc:  # a rounding this file's types lack: reported, not fatal
            rows.append((name, where, act, kv, None, f"{type(exc).__name__}: {exc}"))
            continue
        rows.append((name, where, act, kv, lp, None))
        log.info("%s %s act %s kv %s: %.0f s", name, where, act, kv, time.perf_counter() - t0)
    table = []
    for name, where, act, kv, lp, error in rows:
        if lp is None:
            table.append(f"| {name} | {where} | {act} | {kv} | - | - | - | {error[:80]} |")
            continue
        nll = -lp[np.arange(len(targets)), targets]
        kl = (np.exp(ref) * (ref - lp)).sum(axis=1)
        same = float(np.mean(lp.argmax(axis=1) == ref.argmax(axis=1)))
        table.append(f"| {name} | {where} | {act} | {kv} | {np.exp(nll.mean()):.3f} | {kl.mean():.6f} | {same:.1%} | |")
    return table, len(targets)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="the F32 GGUF of the model (the reference)")
    p.add_argument("--weights", action="append", default=[], metavar="NAME=GGUF", help="a quantized file (repeatable)")
    p.add_argument("--files", type=int, default=24, help="held-out files read (the first --context + 1 tokens of each)")
    p.add_argument("--path", choices=("prefill", "decode"), default="prefill",
                   help="read each chunk as one prompt, or decode it a token at a time (teacher-forced)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--skip", type=int, default=64, help="first positions of each chunk not scored")
    p.add_argument("--acts", default=",".join(ACTS), help="activation roundings of the quantized files")
    p.add_argument("--kvs", default=",".join(KVS), help="KV encodings")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the non-reference runs read")
    p.add_argument("--gemm-maths", default="tf32x3,tf32", help="with --device gpu: the gemm_math of each run")
    p.add_argument("--chunks", type=Path, help="the held-out token chunks (.npy): written if missing, else read")
    p.add_argument("--output")
    args = p.parse_args(argv)
    args.weights = [tuple(w.split("=", 1)) for w in args.weights]
    args.acts, args.kvs, args.gemm_maths = args.acts.split(","), args.kvs.split(","), args.gemm_maths.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from hybrid import LLM

    if args.chunks and args.chunks.exists():
        chunks = [list(c) for c in np.load(args.chunks)][:args.files]
    else:
        tokenizer = LLM(args.ref, device="cpu", max_context=args.context).tokenizer
        chunks = [ids[:args.context + 1] for ids in map(tokenizer.encode, held_out_files())
                  if len(ids) > args.context][:args.files]
        if args.chunks:
            np.save(args.chunks, np.asarray(chunks, np.int32))
    table, scored = measure(args, chunks)
    text = "\n".join([
        f"Held-out files of tiny-code-moe: the first {args.context + 1} tokens of {len(chunks)} files, each "
        f"{'read as one prompt' if args.path == 'prefill' else 'decoded a token at a time'}, its first {args.skip} "
        f"positions as context only: {scored} positions scored. KL: mean over positions of KL(reference || this "
        "run), nats. Same top token: the share of positions whose argmax is the reference's.", "",
        "| weights | run | activations | KV | perplexity | mean KL | same top token | |",
        "|---|---|---|---|---|---|---|---|",
        *table, ""])
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
