"""The host's own cost of a GPU decode step, on the CPU alone: GpuBackend's Python side and the kernel launchers
(gpu_kernels.kernels.Kernels), with launches that do nothing and NumPy arrays for device arrays
(gpu_kernels.numpy_runtime). On a GPU host a decode step's host time is this plus the GPU runtime's own cost a
launch (CuPy's argument packing and the driver call) and a device allocation; the difference tells how much of a
launch-bound step is ours.

Every expert resident (no CPU experts, no relay), --users sequences (default 1), one token each a step; the expert
launches of each layer go through a captured graph as on a GPU, and with --dense-graphs (STRATA_DENSE_GRAPHS=1) its
dense launches too (with --step-graphs the whole step). The table counts the host's launch calls a layer (a graph's
replay is one) and the kernels they run; --kernels lists one step's kernels. Medians of --steps steps after --warmup.

    python bench/gpu_host_cost.py --model /tmp/bench-tiny.gguf [--steps 30] [--dense-graphs] [--step-graphs]
        [--users 4] [--kernels] [--profile]

Make a small model with many layers with bench/make_model.py (the weights' size does not matter, nothing runs
them), e.g. `--type Q8_0 --layers 48 --hidden 256 --experts 16 --top-k 4 --moe-ff 128 --heads 4 --kv-heads 2
--head-dim 64`.
"""
import argparse
import cProfile
from collections import Counter
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from gpu_kernels.numpy_runtime import NumpyRuntime, capturing, queue_or_run  # noqa: E402
from hybrid.backends import CpuBackend  # noqa: E402
from hybrid.backends.gpu import GpuBackend  # noqa: E402
from hybrid.batch import Batch, SeqChunk  # noqa: E402
from hybrid.formats import load_model  # noqa: E402
from hybrid.model import Model  # noqa: E402


class LaunchCounter(NumpyRuntime):
    """Kernels compile to their names and launch as a count; arrays start zeroed (routing ids stay in range)."""

    multiprocessors = 132
    launches = 0  # launch calls of the host: kernels launched one by one, and graph replays
    kernels = 0  # kernels run: those launched one by one, and each replayed graph's

    def __init__(self):
        super().__init__()
        self.modules = {}
        self.names = []  # the kernels run, by name, in order (a replayed graph's again at each replay)

    def empty(self, shape, dtype):
        return np.zeros(shape, dtype)

    def compile(self, name, source, kernel_names):  # one dict read once compiled, as CupyRuntime's
        if name not in self.modules:
            self.modules[name] = {k: k for k in kernel_names}
        return self.modules[name]

    def launch(self, function, grid, block, args, shared_mem=0, stream=None):
        if not capturing():
            self.launches += 1
        queue_or_run(self._count_kernel, function)  # under a graph capture: counted at each of the graph's launches

    def _count_kernel(self, name):
        self.kernels += 1
        self.names.append(name)

    def capture(self, stream, queue):
        return CountedGraph(super().capture(stream, queue), self)

    def resident_blocks(self, function, threads, shared_mem=0):
        return 1 << 20

    def mapped_address(self, host):
        return None


class CountedGraph:
    """A captured graph whose replays count as one launch call each."""

    def __init__(self, graph, counter):
        self.graph, self.counter = graph, counter

    def launch(self, stream=None):
        self.counter.launches += 1
        self.graph.launch(stream)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of --steps steps")
    parser.add_argument("--dense-graphs", action="store_true", help="a layer's dense launches as two graphs "
                        "(GpuBackend dense_graphs)")
    parser.add_argument("--users", type=int, default=1, help="sequences decoding at once (one token each a step)")
    parser.add_argument("--kernels", action="store_true", help="also list one step's kernels in order, and each "
                        "kernel's count a step")
    parser.add_argument("--step-graphs", action="store_true", help="with --dense-graphs, the whole step as one graph "
                        "(GpuBackend step_graphs; every expert is resident here)")
    args = parser.parse_args()
    weights = load_model(args.model)
    c = weights.config
    rt = LaunchCounter()
    backend = GpuBackend(rt, max_context=args.warmup + 2 * args.steps + 16, kv_sequences=args.users,
                         resident=np.ones((c.num_layers, c.num_experts), bool), dense_graphs=args.dense_graphs,
                         step_graphs=args.step_graphs)
    model = Model(weights, backend, host=CpuBackend())
    kvs = [model.new_sequence(args.warmup + 2 * args.steps + 16) for _ in range(args.users)]
    for kv in kvs:
        model.forward(Batch([SeqChunk(kv, 0, np.arange(4), "last")]))

    def step():
        model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([7]), "last") for kv in kvs]))

    for _ in range(args.warmup):
        step()
    times, before = [], (rt.launches, rt.kernels)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    per_step = np.median(times)
    launches, kernels = ((after - b) / args.steps / c.num_layers for after, b in zip((rt.launches, rt.kernels), before))
    print(f"| layers | dense graphs | step (ms) | a layer (us) | launch calls a layer | kernels a layer | "
          f"a launch call (us) |\n|---|---|---|---|---|---|---|\n"
          f"| {c.num_layers} | {'yes' if args.dense_graphs else 'no'} | {per_step * 1e3:.2f} | "
          f"{per_step / c.num_layers * 1e6:.1f} | {launches:.1f} | {kernels:.1f} | "
          f"{per_step / c.num_layers / launches * 1e6:.2f} |")
    if args.kernels:
        rt.names.clear()
        step()
        print(f"\nOne step ({args.users} user(s), {model.runner.last_path}): {len(rt.names)} kernels\n\n"
              + " ".join(rt.names) + "\n\n| kernel | a step |\n|---|---|")
        for name, count in Counter(rt.names).most_common():
            print(f"| {name} | {count} |")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    model.close()


if __name__ == "__main__":
    main()
