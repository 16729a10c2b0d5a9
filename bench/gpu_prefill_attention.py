"""GPU time of a prompt chunk's paged attention at the Qwen3-30B-A3B shape (32 query heads, 4 kv heads, head dim 128):
kv_prefill.cu's paged_prefill (tensor cores) against kv.cu's paged_attention (SIMT, the kernel before it), each
launch (with its split merge) captured `--reps` times back to back in one graph, the best replay's time over reps.
Chunks of `--tokens` tokens whose last key is at each of `--keys`; then chunks of few tokens (PREFILL_MIN_TOKENS);
with --variants also paged_prefill compiled with other tiles (PF_KEYS, PF_VGROUP), cp.async double buffering
(PF_ASYNC) and the opt-in TF32. Each result's largest difference from the SIMT kernel's, relative to its largest
value, beside its time.

    python3 bench/gpu_prefill_attention.py [--tokens 512] [--keys 512,2048,8192] [--kv f32] [--variants]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.gpu_decode_ops import graph_us  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 4, 128, 64
VARIANTS = {"one buffer (no cp.async), PF_KEYS 32": "#define PF_ASYNC 0\n",
            "PF_KEYS 32, 66 KiB dynamic shared": "#define PF_KEYS 32\n#define PF_DYNAMIC_SHARED 1\n",
            "PF_VGROUP 8": "#define PF_VGROUP 8\n", "tf32 (opt-in)": "#define PF_MATH 1\n"}


class DynamicShared:
    """A compiled kernel launched with `shared` bytes of dynamic shared memory (allowed past 48 KiB)."""

    def __init__(self, fn, shared):
        fn.max_dynamic_shared_size_bytes = shared
        self.fn, self.shared = fn, shared

    def __call__(self, grid, block, args, shared_mem=0):
        self.fn(grid, block, args, shared_mem=self.shared)


def cache(rt, rng, kv_dtype, num_keys):
    """(k_pool, v_pool, table) of num_keys positions in shuffled blocks, random rows in kv_dtype's storage."""
    from hybrid import kv_store

    num_blocks = -(-num_keys // BLOCK_TOKENS)
    pools = []
    for _ in range(2):
        x = rng.standard_normal((num_blocks * BLOCK_TOKENS, KV_HEADS, HEAD_DIM)).astype(np.float32)
        data, _ = kv_store.encode(x, kv_dtype)
        pools.append(rt.to_device(np.ascontiguousarray(data.reshape(num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM))))
    return pools[0], pools[1], rt.to_device(rng.permutation(num_blocks).astype(np.int32))


def variant_function(rt, kv_dtype, defines):
    from gpu_kernels.sources import KV_KERNELS, kv_module_name, module_source

    mod = kv_module_name(kv_dtype)
    tag = "_".join(defines.split()[1::3] + defines.split()[2::3])
    fn = rt.compile(f"{mod}_{tag}", defines + module_source(mod), KV_KERNELS)["paged_prefill"]
    if "PF_DYNAMIC_SHARED 1" in defines:  # two buffers of 32 keys (f32): PF_SHARED_BYTES
        return DynamicShared(fn, 2 * 2 * 32 * (128 + 4) * 4)
    return fn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--keys", default="512,2048,8192", help="the chunk's last key + 1 (its start + tokens)")
    p.add_argument("--few", default="8,16,32,64,128", help="tokens of the small chunks (at 2048 keys)")
    p.add_argument("--kv", default="f32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", action="store_true")
    p.add_argument("--output")
    args = p.parse_args(argv)
    from gpu_kernels.kernels import Kernels
    from gpu_kernels.runtime import probe

    rt = probe().runtime
    if rt is None:
        raise SystemExit("no GPU")
    stream = rt.stream()
    new, old = Kernels(rt, stream), Kernels(rt, stream)
    old.prefill_mma = False
    new.prefill_tokens = 1 << 30  # set per case
    rng = np.random.default_rng(0)
    lines = [f"{rt.device_name}, KV {args.kv}, {HEADS} query heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}: ms a "
             f"launch, {args.reps} back to back in a graph (best of 5 replays); diff: largest |difference| from the "
             "SIMT kernel's result over its largest |value|", "",
             "| tokens | keys | kernel | ms | tok/s (attention alone, a layer) | diff |", "|---|---|---|---|---|---|"]
    cases = [(args.tokens, int(k)) for k in args.keys.split(",")] + [(int(t), 2048) for t in args.few.split(",")]
    functions = {name: variant_function(rt, args.kv, d) for name, d in VARIANTS.items()} if args.variants else {}
    for tokens, keys in cases:
        if tokens > keys:
            continue
        k_pool, v_pool, table = cache(rt, rng, args.kv, keys)
        q = rt.to_device(rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float32))
        outs = {}

        def run(kern, name, out):
            def launch():
                kern.paged_attention(args.kv, q, k_pool, v_pool, None, None, table, keys - tokens, 0,
                                     HEAD_DIM ** -0.5, out)
            return launch

        kernels = [("SIMT paged_attention", old), ("paged_prefill", new)] + [(n, new) for n in functions]
        for name, kern in kernels:
            out = rt.empty((tokens, HEADS, HEAD_DIM), np.float32)
            saved = dict(new._functions)
            if name in functions:
                new._functions[(args.kv, "paged_prefill")] = functions[name]
            new.prefill_tokens = 1 if kern is new else 1 << 30
            try:
                ms = graph_us(rt, stream, run(kern, name, out), args.reps) / 1e3
            except Exception as exc:  # a variant that does not run here: said, the others go on
                print(f"| {tokens} | {keys} | {name} | {type(exc).__name__}: {exc} | | |", flush=True)
                continue
            finally:
                new._functions = saved
            stream.synchronize()
            outs[name] = rt.to_host(out)
            ref = outs["SIMT paged_attention"]
            diff = np.abs(outs[name] - ref).max() / np.abs(ref).max()
            lines.append(f"| {tokens} | {keys} | {name} | {ms:.3f} | {tokens / ms * 1e3:,.0f} | {diff:.1e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
