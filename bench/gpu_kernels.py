"""GPU expert matvec bandwidth per format vs the device-to-device copy bandwidth of the same run.

For each format, random experts of one Qwen3-30B-A3B MoE layer (128 experts, gate/up projection
R=768, C=2048) sit in VRAM as expert-cache slots; a decode-sized step reads every expert once: one
moe_matmul launch with 128 groups of one row (the one-token kernel). Four layer copies are cycled so
the weights never sit in L2. Bandwidth = weight bytes read / time a launch (CUDA events, median of the
repeats), timed over QUEUED launches queued back to back behind one untimed launch, as a decode step queues its
kernels: a single launch on an idle GPU also times the host's launch latency, shown in its own column. The
copy bandwidth counts bytes read + written of a 2 GiB device-to-device copy. The
tuning (rows a lane group works on, slices a lane takes) is swept for --sweep formats over --rows x
--slices x --blocks (blocks an SM must hold, registers capped to fit; 0: the compiler's choice); the others
run at their default tuning (gpu_kernels.kernels.DECODE_TUNING, DECODE_MIN_BLOCKS). --act runs each tuning with x
as float and / or rounded to int16 in shared memory (the `_1q` kernels, formats in gpu_kernels.sources.INT_DECODE;
the others take float whatever --act says). --chunks runs each with blocks that walk that many runs of rows
(matmul.cu's block_walk; "auto": Kernels' choice, the fewest runs that fit the launch on the GPU at once).
--tiled also times each format's tiled kernel (prefill: PREFILL_ROWS rows an expert, tiles of TILE_TOKENS).
--variants runs each one-token case again per macro NAME (or NAME=VALUE, several joined by +) with `#define NAME 1`
(VALUE) before its module's source (a kernel's compile-time alternative, side by side with the plain source: the x
column names it).

    python bench/gpu_kernels.py [--formats q8_0,q4_k] [--sweep q8_0,q4_k] [--rows 1,2,4] [--slices 1,2,4]
        [--blocks 0] [--act int16,float] [--chunks auto,1] [--tiled] [--variants ,NAME] [--repeats 20]

Prints the table; --output also writes it to a file (bench/results/gpu_kernels.md keeps the history by hand).
"""
import argparse
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from gpu_kernels.errors import KernelCompileError  # noqa: E402
import gpu_kernels.kernels as kernels_module  # noqa: E402
from gpu_kernels.kernels import DECODE_TUNING, TILE_TOKENS, Kernels  # noqa: E402
from gpu_kernels.runtime import probe  # noqa: E402
from gpu_kernels.sources import INT_DECODE  # noqa: E402
from hybrid.backends.gpu_experts import work_tiles  # noqa: E402
from hybrid.formats.synthetic import encode  # noqa: E402

log = logging.getLogger("bench.gpu_kernels")

NUM_EXPERTS, ROWS, COLS, COPIES = 128, 768, 2048, 4
QUEUED = 8  # launches timed together, the GPU kept busy between them
PREFILL_ROWS = 16  # --tiled: pair rows an expert, as a prompt chunk gives the busier experts


def timed(rt, fn, repeats, queued=QUEUED):
    """Median seconds a call of fn() takes over `repeats` runs, by CUDA events, after one warm-up. queued > 0:
    `queued` calls back to back, the first queued behind an untimed call so that the timing starts with the
    GPU busy; 0: one call on an idle GPU (the host's launch latency included)."""
    fn()
    rt.cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = rt.event(timing=True), rt.event(timing=True)
        if queued:
            fn()
        start.record()
        for _ in range(max(1, queued)):
            fn()
        stop.record()
        stop.synchronize()
        times.append(rt.cp.cuda.get_elapsed_time(start, stop) / 1e3 / max(1, queued))
    return float(np.median(times))


def copy_bandwidth(rt, repeats):
    src = rt.zeros((1 << 29,), np.float32)  # 2 GiB
    dst = rt.empty(src.shape, np.float32)
    seconds = timed(rt, lambda: rt.cp.copyto(dst, src), repeats)
    return 2 * src.nbytes / seconds


def _layer(rt, qtype):
    """(host raw [E, R, B], COPIES device copies of it, x [E, C], out [E, R], decode work tiles) of one layer."""
    rng = np.random.default_rng(0)
    one = encode("w", rng.standard_normal((NUM_EXPERTS, ROWS, COLS)).astype(np.float32) * 0.02, qtype, rng).raw
    layers = [rt.to_device(one) for _ in range(COPIES)]  # [E, R, B] each
    x = rt.to_device(rng.standard_normal((NUM_EXPERTS, COLS)).astype(np.float32))  # [N, C], one row per expert
    out = rt.empty((NUM_EXPERTS, ROWS), np.float32)
    tiles = [rt.to_device(np.ascontiguousarray(t))
             for t in work_tiles(np.arange(NUM_EXPERTS + 1), np.arange(NUM_EXPERTS), 1)]
    return one, layers, x, out, tiles


def variant_defines(macro):
    """The `#define NAME VALUE` lines of a variant: macro "NAME=VALUE" or "NAME" (1), several joined by "+"."""
    pairs = [m.partition("=") for m in macro.split("+") if m]
    return "".join(f"#define {key} {value or 1}\n" for key, _, value in pairs)


@contextmanager
def compiled_with(macro):
    """Kernels made inside compile their matmul modules with variant_defines(macro) first, under names of their own
    (macro "": the plain source)."""
    source, name = kernels_module.tuned_source, kernels_module.tuned_module_name
    if macro:
        line = variant_defines(macro)
        suffix = "".join(c if c.isalnum() else "_" for c in macro.lower())
        kernels_module.tuned_source = lambda q, r, b, defines="": source(q, r, b, line + defines)
        kernels_module.tuned_module_name = lambda q, r, b: f"{name(q, r, b)}_{suffix}"
    try:
        yield
    finally:
        kernels_module.tuned_source, kernels_module.tuned_module_name = source, name


def expert_bandwidth(rt, tunings, acts, chunk_counts, qtype, repeats, variants=("",)):
    """{(decode_rows, lane_slices, min_blocks, x as (and variant), runs of rows a block): (bytes per second, seconds
    queued, seconds alone, registers a thread, local bytes a thread: spills)} of one decode step over a layer."""
    one, layers, x, out, tiles = _layer(rt, qtype)
    step = iter(range(1 << 30))
    results = {}
    cases = [(t, a, c, v) for t in tunings for a in (acts if qtype in INT_DECODE else ["float"]) for c in chunk_counts
             for v in variants]
    for (rows, lane_slices, blocks), act, chunks, variant in cases:
        with compiled_with(variant):
            kernels = Kernels(rt, decode_rows=rows, lane_slices=lane_slices, min_blocks=blocks, act_quant=act,
                              row_chunks=None if chunks == "auto" else int(chunks))

            def run():
                kernels.moe_matmul(layers[next(step) % COPIES], qtype, x, out, *tiles, tile_tokens=1)

            try:
                seconds, alone = timed(rt, run, repeats), timed(rt, run, repeats, queued=0)
            except KernelCompileError as exc:  # a variant written for other formats (e.g. XQ_HALVES: IQ3_S)
                log.warning("%s %s: not compiled, left out (%s)", qtype.name, variant,
                            next((ln for ln in str(exc).splitlines() if "error" in ln), str(exc))[:160])
                continue
            fn, num_blocks, _, shared = kernels._mm_launch(qtype, "moe_matmul_1", ROWS, COLS, one.shape[-1], True)
            runs = int(kernels._row_chunks(fn, num_blocks, NUM_EXPERTS, shared, True))
            runs = f"{runs}" + (" (auto)" if chunks == "auto" else "")
            results[rows, lane_slices, blocks, f"{act} {variant}".strip(), runs] = (
                one.nbytes / seconds, seconds, alone, getattr(fn, "num_regs", "?"),
                getattr(fn, "local_size_bytes", "?"))
    return one.nbytes, results


def tiled_speed(rt, qtype, repeats):
    """(seconds, multiply-adds a second) of one tiled moe_matmul launch over a layer: every expert with
    PREFILL_ROWS pair rows, in tiles of TILE_TOKENS (the prefill kernel, float x)."""
    one, layers, _, _, _ = _layer(rt, qtype)
    rng = np.random.default_rng(1)
    x = rt.to_device(rng.standard_normal((NUM_EXPERTS * PREFILL_ROWS, COLS)).astype(np.float32))  # [N, C]
    out = rt.empty((NUM_EXPERTS * PREFILL_ROWS, ROWS), np.float32)  # [N, R]
    row_starts = np.arange(0, NUM_EXPERTS * PREFILL_ROWS + 1, PREFILL_ROWS)
    tiles = [rt.to_device(np.ascontiguousarray(t))
             for t in work_tiles(row_starts, np.arange(NUM_EXPERTS), TILE_TOKENS)]  # [3, W]
    kernels, step = Kernels(rt), iter(range(1 << 30))

    def run():
        kernels.moe_matmul(layers[next(step) % COPIES], qtype, x, out, *tiles, tile_tokens=TILE_TOKENS)

    seconds = timed(rt, run, repeats)
    return seconds, NUM_EXPERTS * PREFILL_ROWS * ROWS * COLS / seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="f16,bf16,q8_0,q4_0,q4_k,q5_k,q6_k")
    p.add_argument("--sweep", default="q8_0,q4_k")
    p.add_argument("--rows", default="1,2,4", help="rows a lane group works on, swept")
    p.add_argument("--slices", default="1,2,4", help="slices a lane takes, swept")
    p.add_argument("--blocks", default="0", help="blocks an SM must hold (registers capped to fit), swept; 0: none")
    p.add_argument("--act", default="int16,float", help="x as int16 and / or float (INT_DECODE formats)")
    p.add_argument("--chunks", default="auto", help="runs of rows a block walks, swept; auto: Kernels' choice")
    p.add_argument("--tiled", action="store_true", help="also time the tiled (prefill) kernel of each format")
    p.add_argument("--variants", default="", help="macros each defined in a run of its own ('' the plain source)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--output", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = probe()
    if found.runtime is None:
        log.error("no GPU: %s", found.reason)
        return 1
    rt = found.runtime
    copy = copy_bandwidth(rt, args.repeats)
    log.info("%s: device-to-device copy %.0f GB/s (read + write)", rt.device_name, copy / 1e9)
    sweep = {Q[n.upper()] for n in args.sweep.split(",") if n}
    lines = [f"# GPU expert matvec bandwidth ({rt.device_name}, {rt.name})", "",
             f"Decode step over one MoE layer: {NUM_EXPERTS} experts x [{ROWS}, {COLS}], one row each, one launch.",
             f"Device-to-device copy: {copy / 1e9:.0f} GB/s (read + write).",
             "Default tuning (rows a lane group, slices a lane, blocks an SM or 0): "
             + ", ".join(f"{Q(q).name} {Kernels(rt).tuning(q)}" for q in Q if q in DECODE_TUNING) + ", others "
             + f"{Kernels(rt).tuning(Q.F32)}.", "",
             "| format | x | rows / group | slices / lane | blocks / SM | runs / block | registers | local bytes | "
             "MiB read | time (us) | time alone (us) | GB/s | % of copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.formats.split(","):
        qtype = Q[name.upper()]
        tunings = ([(int(r), int(s), int(b)) for r in args.rows.split(",") for s in args.slices.split(",")
                    for b in args.blocks.split(",")] if qtype in sweep else [Kernels(rt).tuning(qtype)])
        nbytes, results = expert_bandwidth(rt, tunings, args.act.split(","), args.chunks.split(","), qtype,
                                           args.repeats, args.variants.split(","))
        for (rows, lane_slices, blocks, act, runs), (bw, seconds, alone, regs, local) in results.items():
            lines.append(f"| {qtype.name} | {act} | {rows} | {lane_slices} | {blocks} | {runs} | {regs} | {local} | "
                         f"{nbytes / 2**20:.1f} | {seconds * 1e6:.1f} | {alone * 1e6:.1f} | {bw / 1e9:.0f} | "
                         f"{100 * bw / copy:.0f} |")
            log.info(lines[-1])
    if args.tiled:
        lines += ["", f"Tiled kernel (prefill): {NUM_EXPERTS} experts x {PREFILL_ROWS} rows, tiles of {TILE_TOKENS}, "
                  "float x, one launch.", "", "| format | time (us) | G multiply-adds / s |", "|---|---|---|"]
        for name in args.formats.split(","):
            seconds, rate = tiled_speed(rt, Q[name.upper()], args.repeats)
            lines.append(f"| {Q[name.upper()].name} | {seconds * 1e6:.1f} | {rate / 1e9:.0f} |")
            log.info(lines[-1])
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")
        log.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
