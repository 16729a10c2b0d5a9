"""A GPU prompt read under each of the tiled GEMM's products (gpu_kernels/gemm.py's gemm_math), in one process, side
by side: the wall time of a one-chunk prompt read (every expert resident), the summed GPU time of the GEMM kernels
(`gemm`, `gemm32`, `gemm_reduce`) in it, and the last position's logits against those of the first math listed
(max |diff| / max |logit|, the same prompt). A math named MATH/VARIANT (e.g. tf32x3/GEMM_ASYNC=0+GEMM_DEQUANT=0) runs
with that Kernels.gemm_variant (gemm.cu's compile-time alternatives). --moe-tiles: the experts' work tiles of each
size listed (32: gemm32, 64: gemm; gemm.MOE_GEMM_TOKENS set while its runs go), each with every math.

    python bench/gpu_gemm_prompt.py --model /tmp/q8l.gguf [--tokens 512] [--maths fp32,tf32x3,tf32x3/GEMM_DEQUANT=1]
        [--moe-tiles 32] [--runs 5]
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.gpu_decode_profile import launch_times, timed_launches  # noqa: E402

GEMM_NAMES = ("gemm", "gemm32", "gemm_reduce")


def read(model, tokens, seed):
    """(seconds, logits [V] of the last position) of one `tokens`-token prompt read in one chunk into a new
    sequence."""
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(tokens + 8)
    ids = np.random.default_rng(seed).integers(10, 1000, tokens)
    t0 = time.perf_counter()
    logits = model.forward(Batch([SeqChunk(kv, 0, ids, "last")]))
    model.backend.stream.synchronize()
    seconds = time.perf_counter() - t0
    kv.truncate(0)
    return seconds, np.asarray(getattr(logits, "get", lambda: logits)(), np.float32)[-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--maths", default="fp32,tf32x3,tf32")
    p.add_argument("--moe-tiles", default="32")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    import gpu_kernels.gemm as gemm_module
    from gpu_kernels.gemm import gemm_math
    from hybrid import LLM

    llm = LLM(args.model, device="gpu", max_context=args.tokens + 64, kv_sequences=1)
    model, kernels = llm.model, llm.model.backend.kernels
    maths = [(m, int(t)) for t in args.moe_tiles.split(",") for m in args.maths.split(",")]

    def use(case):
        name, _, kernels.gemm_variant = case[0].partition("/")
        kernels.gemm_math, gemm_module.MOE_GEMM_TOKENS = gemm_math(name), case[1]

    print(f"Model `{Path(args.model).name}` on {model.backend.rt.device_name}, every expert resident, a "
          f"{args.tokens}-token prompt in one chunk; wall: median of {args.runs}, alternating maths.\n")
    walls, gemm_ms, logits = {m: [] for m in maths}, {}, {}
    for math in maths:  # warm-up: compiles each math's modules
        use(math)
        read(model, args.tokens, 0)
        logits[math] = read(model, args.tokens, 1)[1]
        with timed_launches(model.backend) as launched:
            read(model, args.tokens, 1)
        times = launch_times(model.backend, launched)
        gemm_ms[math] = sum(sum(v) for k, v in times.items() if k.split(".")[-1] in GEMM_NAMES) * 1e3
    for run in range(args.runs):
        for math in maths:
            use(math)
            walls[math].append(read(model, args.tokens, 2 + run)[0])
    llm.close()
    first = maths[0]
    print(f"| gemm_math | expert tiles | wall ms | tok/s | GEMM kernels' GPU ms | logits vs {first[0]}, tiles "
          f"{first[1]} |")
    print("|---|---|---|---|---|---|")
    for math in maths:
        wall = float(np.median(walls[math]))
        diff = np.abs(logits[math] - logits[first]).max() / np.abs(logits[first]).max()
        print(f"| {math[0]} | {math[1]} | {wall * 1e3:.1f} | {args.tokens / wall:.0f} | {gemm_ms[math]:.2f} | "
              f"{diff:.1e} |")


if __name__ == "__main__":
    main()
