"""A prompt chunk's matmuls on the GPU: the 8-token tiled kernels (matmul.cu's matmul / moe_matmul) against the
shared-memory tiled GEMM (gemm.cu's gemm), side by side in TFLOPS (2 x rows x columns x tokens / time).

Cases, per format: one Qwen3-30B-A3B MoE layer's prompt chunk (--tokens x top-8 routed at random over 128 experts,
all resident): the gate/up projection [768, 2048] and the down projection [2048, 768] over the pairs grouped by
expert (one launch a projection, as GpuExperts.submit_groups queues them), and dense matmuls (--dense-shapes: the
attention's q, o and k/v projections) at --dense-tokens. Weights are random valid blocks (scales of about 1e-3),
distinct for every expert. Times: CUDA events, median of --repeats runs of QUEUED launches back to back. Each GEMM
result is checked against the old kernel's (the `diff` column: max |new - old| / max |old|). --variants: the empty
entry is the engine's choice (MoE: work tiles of MOE_GEMM_TOKENS; dense: Kernels.gemm's plan, 32- or 64-token blocks
and column splits); `t32` / `t64` force that kernel (MoE: tiles of that size; dense: no splits); any other entry
NAME or NAME=VALUE (several joined by +) compiles the module with `#define NAME VALUE` before its source (gemm.cu's
compile-time alternatives), run as the engine's kernel without splits.

    python bench/gpu_gemm.py [--formats q4_k,q6_k,q8_0] [--tokens 512] [--dense-tokens 16,64,512]
        [--dense-shapes 4096x2048,2048x4096,512x2048] [--variants ,t32,t64] [--repeats 10]
"""
import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
import gpu_kernels.kernels as kernels_module  # noqa: E402
from gpu_kernels.gemm import (GEMM_KERNEL, GEMM_ROWS, GEMM_THREADS, GEMM_TOKENS, MOE_GEMM_TOKENS,  # noqa: E402
                              allow_dynamic_shared, gemm_dynamic_shared, variant_defines)
from gpu_kernels.kernels import TILE_TOKENS, Kernels, format_tuning, tuned_module_name, tuned_source  # noqa: E402
from gpu_kernels.runtime import probe  # noqa: E402
from gpu_kernels.sources import GEMM_KERNELS  # noqa: E402
from hybrid.backends.gpu_experts import work_tiles  # noqa: E402

NUM_EXPERTS, TOP_K, WIDTH, HIDDEN = 128, 8, 768, 2048
FORCED = {"t32": MOE_GEMM_TOKENS, "t64": GEMM_TOKENS}  # --variants entries: that kernel, without splits
QUEUED = 4
F16_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}  # byte offsets of a block's f16 scales


def random_raw(rng, qtype, shape):
    """uint8 [..., R, B]: random valid blocks of qtype (its f16 scales about 1e-3) for float shape [..., R, C]."""
    if qtype in (Q.F32, Q.F16):
        values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        return values.astype(np.float32 if qtype == Q.F32 else np.float16).view(np.uint8)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_SCALES[qtype]:
        scale = rng.uniform(0.5e-3, 1.5e-3, num_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * block_bytes)


def timed(rt, fn, repeats):
    """Median seconds a call of fn() takes: QUEUED calls back to back behind an untimed one, by CUDA events."""
    fn()
    rt.cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = rt.event(timing=True), rt.event(timing=True)
        fn()
        start.record()
        for _ in range(QUEUED):
            fn()
        stop.record()
        stop.synchronize()
        times.append(rt.cp.cuda.get_elapsed_time(start, stop) / 1e3 / QUEUED)
    return float(np.median(times))


@contextmanager
def old_kernels():
    """Kernels.matmul without the GEMM (its token threshold out of reach) while inside."""
    saved = kernels_module.GEMM_MIN_TOKENS
    kernels_module.GEMM_MIN_TOKENS = 1 << 30
    try:
        yield
    finally:
        kernels_module.GEMM_MIN_TOKENS = saved


def variant_gemm(rt, kernels, qtype, variant):
    """{kernel name: compiled function} of qtype's GEMM module: the engine's for "", "t32", "t64", else with
    variant_defines(variant) before its source."""
    if variant in ("", *FORCED):
        return {name: kernels._mm(qtype, name) for name in GEMM_KERNELS}
    rows, _, blocks = format_tuning(qtype)
    defines = "".join(f"#define {name} {value}\n" for name, value in variant_defines(variant))
    suffix = "".join(f"_{name}{value}" for name, value in variant_defines(variant))
    return rt.compile(f"{tuned_module_name(qtype, rows, blocks)}{suffix}", defines + tuned_source(qtype, rows, blocks),
                      GEMM_KERNELS)


def variant_shared(kernels, fn, qtype, variant, tokens):
    """Dynamic shared bytes of a variant's kernel of `tokens` a block (gemm_dynamic_shared; its limit raised)."""
    shared = gemm_dynamic_shared(qtype, tokens, variant_defines(variant) if variant not in FORCED else (),
                                 kernels.gemm_mma())
    allow_dynamic_shared(fn, shared)
    return shared


def describe(rt, kernels, qtype, variants):
    """A line per kernel and compiled variant: registers a thread and blocks an SM holds."""
    for variant in [v for v in variants if v not in FORCED]:
        for tokens, name in GEMM_KERNEL.items():
            fn = variant_gemm(rt, kernels, qtype, variant)[name]
            shared = variant_shared(kernels, fn, qtype, variant, tokens)
            blocks = rt.resident_blocks(fn, GEMM_THREADS, shared) // rt.multiprocessors
            print(f"# {qtype.name} {variant or 'default'} {name}: {getattr(fn, 'num_regs', '?')} registers a thread, "
                  f"{blocks} blocks an SM")


def launch(kernels, fn, tokens, raw, x, out, num_rows, tiles=None, shared=0):
    """One launch of a compiled GEMM of `tokens` a block over x [N, C]: with work tiles (3 device int32 [W]), else
    dense without splits; shared: its dynamic shared bytes."""
    none = np.uint64(0)
    grid = (-(-num_rows // GEMM_ROWS), len(tiles[0]) if tiles else -(-x.shape[0] // tokens))
    kernels._launch(fn, grid, GEMM_THREADS, (raw, x, out, *(tiles or (none,) * 3), np.int32(x.shape[0]),
                                              np.int32(num_rows), np.int32(x.shape[1]), np.int64(raw.shape[-1])),
                    shared_mem=shared)


def moe_case(rt, kernels, qtype, raw, x, tiles, num_rows, variants, repeats):
    """(old seconds, {label: (seconds, diff)}) of one projection over the grouped pairs x [N, C]; tiles: {tokens a
    tile: device work tiles}. Variants: "" the engine's tiles (MOE_GEMM_TOKENS), "t32" / "t64" those tiles."""
    out_old = rt.empty((x.shape[0], num_rows), np.float32)
    out_new = rt.empty((x.shape[0], num_rows), np.float32)
    old = timed(rt, lambda: kernels.moe_matmul(raw, qtype, x, out_old, *tiles[TILE_TOKENS], tile_tokens=TILE_TOKENS),
                repeats)
    ref = rt.to_host(out_old)
    results = {}
    for variant in variants:
        tokens = FORCED.get(variant, MOE_GEMM_TOKENS)
        fn = variant_gemm(rt, kernels, qtype, variant)[GEMM_KERNEL[tokens]]
        shared = variant_shared(kernels, fn, qtype, variant, tokens)
        seconds = timed(rt, lambda: launch(kernels, fn, tokens, raw, x, out_new, num_rows, tiles[tokens], shared),
                        repeats)
        label = f"{variant or 'default'} (tiles {tokens})"
        results[label] = seconds, float(np.abs(rt.to_host(out_new) - ref).max() / np.abs(ref).max())
    return old, results


def dense_case(rt, kernels, qtype, raw, x, variants, repeats):
    """(old seconds, {label: (seconds, diff)}) of a dense matmul. Variants: "" the engine's plan (Kernels.gemm:
    tokens a block and column splits), "t32" / "t64" that kernel without splits, others the plan's kernel without
    splits."""
    num_tokens, num_rows = x.shape[0], raw.shape[0]
    out_old = rt.empty((num_tokens, num_rows), np.float32)
    out_new = rt.empty((num_tokens, num_rows), np.float32)
    with old_kernels():
        old = timed(rt, lambda: kernels.matmul(raw, qtype, x, out_old), repeats)
    ref = rt.to_host(out_old)
    results = {}
    plan_tokens, splits = kernels.gemm_plan(qtype, num_tokens, num_rows, x.shape[1])
    for variant in variants:
        if variant:
            tokens = FORCED.get(variant, plan_tokens)
            fn = variant_gemm(rt, kernels, qtype, variant)[GEMM_KERNEL[tokens]]
            shared = variant_shared(kernels, fn, qtype, variant, tokens)
            call = lambda: launch(kernels, fn, tokens, raw, x, out_new, num_rows, shared=shared)  # noqa: E731
            label = f"{variant} ({tokens} tokens)"
        else:
            call = lambda: kernels.gemm(raw, qtype, x, out_new)  # noqa: E731
            label = f"default ({plan_tokens} tokens, {splits} splits)"
        seconds = timed(rt, call, repeats)
        results[label] = seconds, float(np.abs(rt.to_host(out_new) - ref).max() / np.abs(ref).max())
    return old, results


def routed_groups(rng, num_tokens):
    """(row_starts [E + 1], slots [E]) of num_tokens tokens each routed to TOP_K distinct random experts."""
    ids = np.argsort(rng.random((num_tokens, NUM_EXPERTS)), axis=1)[:, :TOP_K]  # [T, K]
    sizes = np.bincount(ids.ravel(), minlength=NUM_EXPERTS)  # [E]
    return np.concatenate([[0], np.cumsum(sizes)]), np.arange(NUM_EXPERTS)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="q4_k,q6_k,q8_0")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dense-tokens", default="16,64,512")
    parser.add_argument("--dense-shapes", default="4096x2048,2048x4096,512x2048",
                        help="rows x columns; the first at every --dense-tokens, the others at the last")
    parser.add_argument("--variants", default="", help="comma-separated; the empty entry is the default GEMM")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    found = probe()
    if found.runtime is None:
        sys.exit(f"no GPU: {found.reason}")
    rt = found.runtime
    kernels = Kernels(rt)
    variants = args.variants.split(",")
    rng = np.random.default_rng(0)
    row_starts, slots = routed_groups(rng, args.tokens)
    num_pairs = int(row_starts[-1])
    sizes = np.diff(row_starts)
    print(f"# {rt.device_name}: {args.tokens} tokens x top-{TOP_K} over {NUM_EXPERTS} experts = {num_pairs} pairs, "
          f"{sizes.min()}-{sizes.max()} an expert (mean {sizes.mean():.1f})\n")
    tiles = {t: [rt.to_device(np.ascontiguousarray(a)) for a in work_tiles(row_starts, slots, t)]
             for t in (TILE_TOKENS, *GEMM_KERNEL)}
    formats = [Q[name.strip().upper()] for name in args.formats.split(",")]
    for qtype in formats:
        describe(rt, kernels, qtype, variants)
    print()
    print("| case | format | rows x cols | tokens (pairs) | old ms | old TFLOPS | variant | GEMM ms | GEMM TFLOPS "
          "| speed-up | diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def report(case, qtype, shape, tokens, old, results):
        flops = 2.0 * shape[0] * shape[1] * tokens
        for label, (seconds, diff) in results.items():
            print(f"| {case} | {qtype.name} | {shape[0]} x {shape[1]} | {tokens} | {old * 1e3:.3f} | "
                  f"{flops / old / 1e12:.2f} | {label} | {seconds * 1e3:.3f} | "
                  f"{flops / seconds / 1e12:.2f} | {old / seconds:.2f}x | {diff:.1e} |", flush=True)

    for qtype in formats:
        for case, (rows, cols) in (("moe gate/up", (WIDTH, HIDDEN)), ("moe down", (HIDDEN, WIDTH))):
            raw = rt.to_device(random_raw(rng, qtype, (NUM_EXPERTS, rows, cols)))
            x = rt.to_device(rng.standard_normal((num_pairs, cols), dtype=np.float32))
            old, results = moe_case(rt, kernels, qtype, raw, x, tiles, rows, variants, args.repeats)
            report(case, qtype, (rows, cols), num_pairs, old, results)
            del raw, x
        dense_tokens = [int(t) for t in args.dense_tokens.split(",")]
        for i, shape in enumerate(tuple(map(int, s.split("x"))) for s in args.dense_shapes.split(",")):
            raw = rt.to_device(random_raw(rng, qtype, shape))
            for tokens in dense_tokens if i == 0 else dense_tokens[-1:]:
                x = rt.to_device(rng.standard_normal((tokens, shape[1]), dtype=np.float32))
                old, results = dense_case(rt, kernels, qtype, raw, x, variants, args.repeats)
                report("dense", qtype, shape, tokens, old, results)


if __name__ == "__main__":
    main()
