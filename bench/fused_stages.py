"""Where a fused CPU decode layer's time goes, stage by stage and thread by thread.

The fused layer (hybrid/backends/cpu_decode_fused.py) runs a decode layer as one parallel region whose
workers meet between 8 stages. With `CpuBackend.stage_trace` set, each worker adds the time-stamp-counter
ticks it spends per stage on its own serial work (norms, rounding, routing: the same on every worker),
on its items, and waiting for the others at the stage's meeting. This script decodes `--steps` tokens
that way and prints, per stage, those three times in us a layer (mean over workers, and the slowest
worker's items), next to the layer's wall time seen from Python and the step's time outside the layers.

    python bench/fused_stages.py --model /tmp/bm-q4km.gguf --threads 16 --steps 64

Prints a markdown table.
"""
import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

# bench/ holds a cpu_kernels.py: drop the folder from the path so `cpu_kernels` is the package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.compiled_decode import decode_seconds  # noqa: E402
from bench.cpu_kernels import median_seconds  # noqa: E402
from cpu_kernels import sync  # noqa: E402
from hybrid.backends import cpu_decode_fused as fused  # noqa: E402
from hybrid.llm import LLM  # noqa: E402

STAGE_NAMES = ("q k v", "rope, kv write", "attention", "o", "router", "gate+up", "down", "combine")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args(argv)
    model = LLM(args.model, device="cpu", threads=args.threads, max_context=512, fused_decode=True).model
    backend = model.backend
    rng = np.random.default_rng(0)
    layer_seconds, captured = [], []

    def timed(fn):
        def call(*a):
            if not captured:
                captured.append(a)
            start = time.perf_counter()
            out = fn(*a)
            layer_seconds.append(time.perf_counter() - start)
            return out
        call.__wrapped__ = fn
        return call

    decode_seconds(model, rng, 16)  # compile and warm
    for plan in model.runner.plans.values():  # each layer's fused call, timed
        fn, fixed = plan.fused_call
        plan.fused_call = (timed(fn), fixed)
    workers = numba.get_num_threads()
    backend.stage_trace = np.zeros((workers, fused.TRACE_COLUMNS), dtype=np.int64)
    layer_seconds.clear()
    step_seconds = decode_seconds(model, rng, args.steps) / args.steps
    rate = sync.ticks_per_second()
    calls = len(layer_seconds)
    per_layer = backend.stage_trace / rate / calls * 1e6  # [W, TRACE_COLUMNS], us a layer call
    layers_per_step = calls / args.steps
    layer_wall = 1e6 * float(np.mean(layer_seconds))
    print(f"\n{Path(args.model).name}, {workers} threads, {args.steps} steps: {1 / step_seconds:.1f} tok/s, "
          f"{step_seconds * 1e3:.2f} ms a step, {layers_per_step:.0f} layers; a layer call {layer_wall:.0f} us "
          f"(mean, from Python), outside the layers {1e3 * (step_seconds - sum(layer_seconds) / args.steps):.2f}"
          f" ms a step\n")
    print("| stage | own serial work (us) | items, mean / slowest worker (us) | wait (us) | stage total (us) |")
    print("|---|---|---|---|---|")
    totals = per_layer.mean(axis=0)
    stages = totals[:fused.START]
    for s, name in enumerate(STAGE_NAMES):
        serial, items, wait = stages[3 * s:3 * s + 3]
        slowest = per_layer[:, 3 * s + 1].max()
        print(f"| {name} | {serial:.1f} | {items:.1f} / {slowest:.1f} | {wait:.1f} | {serial + items + wait:.1f} |")
    inside = stages.sum()
    print(f"| all | {stages[0::3].sum():.1f} | {stages[1::3].sum():.1f} | {stages[2::3].sum():.1f} | {inside:.1f} |")
    start, whole, prologue = totals[fused.START], per_layer[0, fused.WHOLE], per_layer[0, fused.PROLOGUE]
    print(f"\nA layer call, us: {layer_wall:.1f} from Python; {whole:.1f} from its first line to its return, of which "
          f"{prologue:.1f} in its serial prologue, {start - prologue:.1f} more before a worker starts (the region's "
          f"fork; mean over workers), {inside:.1f} "
          f"in the stages, {whole - start - inside:.1f} after (the region's join); {layer_wall - whole:.1f} calling it "
          f"(Numba's dispatch, the arguments' unboxing).")
    print(f"\nThe call from Python, us (median of {CALLS} calls of layer 0 on a fixed input): "
          + ", ".join(f"{name} {us:.1f}" for name, us in call_costs(model.runner.plans[0], captured[0]).items()))


CALLS = 200


def call_costs(plan, full):
    """us per call: the fused instance called directly, and a compiled function that takes the same arguments
    and does nothing (Numba's dispatch); full: a call's arguments."""
    fn, _ = plan.fused_call
    full = full[:7] + (np.zeros((0, 0), dtype=np.int64),) + full[8:]  # no stage trace
    nothing = numba.njit(lambda *a: 0)

    def median_us(call):
        return 1e6 * median_seconds(call, CALLS)

    x, rest = full[0], full[1:]  # each call gets a fresh copy of x (the layer adds to it in place)
    return {"the fused instance": median_us(lambda: fn.__wrapped__(x.copy(), *rest)),
            "an empty function of the same arguments": median_us(lambda: nothing(x.copy(), *rest))}


if __name__ == "__main__":
    main()
