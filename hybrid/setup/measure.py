"""What `strata setup` measures on this box: DRAM read bandwidth per thread count, the CPU's ISA and NUMA
nodes, free RAM, the pinned-memory limit, and per GPU (through gpu_kernels' runtime; none without one) its
VRAM, host-to-device and on-device copy bandwidth. Progress goes to the log, one line per measurement."""
import logging
import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

MIB = 1 << 20
READ_MIB = 512  # the array the DRAM read is timed over: far beyond any last-level cache
COPY_MIB = 256  # the GPU copies timed
REPEATS = 3  # best of
EXPERT_SAMPLE_MIB = 256  # the model's expert weights the decode kernels are timed over
GPU_KVS = ("f16", "int8")  # the KV types setup chooses among on a GPU


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    vram_mib: float  # total
    free_mib: float
    h2d_gbps: float  # pinned host -> device
    vram_gbps: float  # device -> device copy, bytes read + written


@dataclass(frozen=True)
class Machine:
    cores: int
    isa: str  # the widest of avx512 / avx2 / avx the CPU has ("native" compiles for it)
    cpu_features: tuple  # the kernels' features (cpu_kernels.target.CHOSEN_FEATURES) it has
    numa_nodes: int
    ram_mib: float
    free_ram_mib: float  # MemAvailable
    pinned_limit_mib: float  # RLIMIT_MEMLOCK; None: unlimited
    dram_gbps: dict = field(default_factory=dict)  # threads -> GB/s read
    expert_gbps: dict = field(default_factory=dict)  # threads -> GB/s of the decode kernels over the model's experts
    gpus: tuple = ()
    gpu_note: str = ""  # why there is no GPU
    attention: dict = field(default_factory=dict)  # KV dtype -> AttentionCost of GPU 0 at the model's heads

    @property
    def cpu_gbps(self):
        """What CPU experts stream at: the decode kernels' rate over the model's experts, else the DRAM read."""
        return max((self.expert_gbps or self.dram_gbps).values())

    def describe(self):
        """What was measured, a line per part."""
        pinned = "unlimited" if self.pinned_limit_mib is None else f"{self.pinned_limit_mib:.0f} MiB"
        lines = [f"CPU {self.cores} cores, {self.isa} ({', '.join(self.cpu_features) or 'no AVX2'}), "
                 f"{self.numa_nodes} NUMA node(s); RAM {self.ram_mib:.0f} MiB, {self.free_ram_mib:.0f} free, "
                 f"locked-memory limit {pinned}",
                 "DRAM read GB/s by threads: " + ", ".join(f"{n}: {v:g}" for n, v in sorted(self.dram_gbps.items()))]
        if self.expert_gbps:
            lines.append("expert decode kernels GB/s by threads: " + ", ".join(
                f"{n}: {v:g}" for n, v in sorted(self.expert_gbps.items())))
        lines += [f"GPU {g.index} {g.name}: {g.vram_mib:.0f} MiB, {g.free_mib:.0f} free, host to device "
                  f"{g.h2d_gbps:g} GB/s, on-device copy {g.vram_gbps:g} GB/s" for g in self.gpus]
        lines += [cost.describe() for cost in self.attention.values()]
        return lines if self.gpus else lines + [f"no GPU ({self.gpu_note})"]


def _meminfo():
    """{field: MiB} of /proc/meminfo ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    return {row[0].rstrip(":"): int(row[1]) / 1024 for row in rows if len(row) >= 2 and row[1].isdigit()}


def numa_nodes():
    try:
        return max(1, sum(1 for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit() and n[:4] == "node"))
    except OSError:
        return 1


def pinned_limit_mib():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft / MIB


def cpu_isa():
    """(widest ISA floor name, the kernels' features present) of this CPU, from Numba's host target."""
    from cpu_kernels.target import CHOSEN_FEATURES, _target_features

    features = _target_features()
    present = tuple(f for f in CHOSEN_FEATURES if features.get(f))
    isa = "avx512" if "avx512bw" in present else "avx2" if "avx2" in present else "avx"
    return isa, present


def thread_counts(cores):
    """1, 2, 4, ... up to every core (and every core itself)."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


def _read_kernel():
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def read_sum(x):  # x float32 [N]: every byte read once, 16 KiB per iteration
        rows = x.size // 4096
        sums = np.zeros(rows, np.float32)  # [rows]
        for r in prange(rows):
            sums[r] = x[r * 4096:(r + 1) * 4096].sum()
        return sums.sum()

    return read_sum


def dram_bandwidth(counts, read_mib=READ_MIB):
    """{threads: GB/s} of a parallel read of a `read_mib` array, best of REPEATS per count."""
    import numba

    read = _read_kernel()
    x = np.random.default_rng(0).random(int(read_mib * MIB // 4), dtype=np.float32)
    read(x[:4096 * 8])  # compile
    before, result = numba.get_num_threads(), {}
    try:
        for n in counts:
            numba.set_num_threads(n)
            best = min(_timed(read, x) for _ in range(REPEATS))
            result[n] = round(x.nbytes / best / 1e9, 1)
            log.info("DRAM read with %d threads: %.1f GB/s", n, result[n])
    finally:
        numba.set_num_threads(before)
    return result


def _timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def expert_bandwidth(weights, counts, sample_mib=EXPERT_SAMPLE_MIB):
    """{threads: GB/s} of the CPU decode kernels (one token per expert) over a sample of the model's own expert
    weights, copied into RAM as the CPU backend copies them; best of REPEATS per count; {} without experts the
    CPU kernels take."""
    import numba

    from cpu_kernels.act_quant import act_quant_code
    from cpu_kernels.formats import is_supported

    tensors = [t for name, t in weights.tensors.items() if name.endswith("_exps.weight") and is_supported(t.qtype)]
    calls, total = [], 0
    for tensor in tensors:
        if total >= sample_mib * MIB:
            break
        calls.append(_expert_call(tensor))
        total += calls[-1][1][0].nbytes
    if not calls:
        return {}
    act_quant = act_quant_code(None)

    def read():
        for kernel, raws, x, expert_ids, row_starts, outs in calls:
            kernel(raws, x, expert_ids, row_starts, outs, act_quant)

    read()  # compile or load the kernels
    before, result = numba.get_num_threads(), {}
    try:
        for n in counts:
            numba.set_num_threads(n)
            result[n] = round(total / min(_timed(read) for _ in range(REPEATS)) / 1e9, 1)
            log.info("expert decode kernels with %d threads: %.1f GB/s over %.0f MiB", n, result[n], total / MIB)
    finally:
        numba.set_num_threads(before)
    return result


def _expert_call(tensor):
    """(kernel, (raw,), x, expert_ids, row_starts, (out,)) of a decode step over every expert of `tensor`."""
    from cpu_kernels.formats import format_for
    from cpu_kernels.tiles import kernels_of
    from hybrid.host_memory import huge_page_copy

    raw = huge_page_copy(tensor.raw if tensor.raw.ndim == 3 else tensor.raw.reshape(1, *tensor.raw.shape))
    kernel, _, cols = kernels_of(format_for(tensor.qtype), raw)  # raw [E, R, B]
    num_experts, num_rows = raw.shape[:2]
    x = np.random.default_rng(0).standard_normal((num_experts, cols)).astype(np.float32)  # [E, C]
    ids, starts = np.arange(num_experts, dtype=np.int64), np.arange(num_experts + 1, dtype=np.int64)
    return kernel, (raw,), x, ids, starts, (np.empty((num_experts, num_rows), np.float32),)


def measure_gpus(copy_mib=COPY_MIB, heads=None):
    """(tuple of Gpu, note, {KV dtype: AttentionCost}): every GPU the runtime finds, or () and why there is none;
    heads (query heads, kv heads, head dim): the model's, whose decode attention is timed on GPU 0."""
    from gpu_kernels.runtime import CupyRuntime, probe

    found = probe()
    if found.runtime is None:
        log.info("no GPU: %s", found.reason)
        return (), found.reason, {}
    count = found.runtime.cp.cuda.runtime.getDeviceCount()
    gpus = tuple(_measure_gpu(found.runtime if i == 0 else CupyRuntime(i), i, copy_mib) for i in range(count))
    found.runtime.device.use()
    attention = _time_attention(found.runtime, heads) if heads else {}
    cp = found.runtime.cp  # the copies' buffers back to the driver: --check's engine budgets the VRAM free
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    return gpus, "", attention


def _time_attention(rt, heads):
    """{KV dtype: AttentionCost} of the KV types setup chooses among, on `rt`'s device."""
    from gpu_kernels.kernels import Kernels

    from .attention_time import time_attention

    kernels = Kernels(rt, rt.stream())
    try:
        return {kv: time_attention(rt, kernels, *heads, kv) for kv in GPU_KVS}
    except Exception as exc:  # the kernel refuses these heads, or CuPy's runtime errors: predict from the KV's bytes
        log.warning("the GPU's one-token attention was not timed (%s): predictions count the KV's bytes only", exc)
        return {}


def _measure_gpu(rt, index, copy_mib):
    """The Gpu of runtime `rt` (its device current): free and total VRAM, copy bandwidths."""
    free, total = rt.memory_info()
    host = rt.pinned_empty((int(copy_mib * MIB),), np.uint8)
    dev, other = rt.empty(host.shape, np.uint8), rt.empty(host.shape, np.uint8)
    stream = rt.stream()
    h2d = min(_gpu_seconds(rt, stream, lambda: rt.copy_from_host_async(dev, host, stream)) for _ in range(REPEATS))
    d2d = min(_gpu_seconds(rt, stream, lambda: rt.copy_on_device_async(other, dev, stream)) for _ in range(REPEATS))
    gpu = Gpu(index, rt.device_name, round(total / MIB), round(free / MIB), round(host.nbytes / h2d / 1e9, 1),
              round(2 * host.nbytes / d2d / 1e9, 1))
    log.info("GPU %d (%s): %.0f of %.0f MiB free, host to device %.1f GB/s, on-device copy %.0f GB/s", index,
             gpu.name, gpu.free_mib, gpu.vram_mib, gpu.h2d_gbps, gpu.vram_gbps)
    return gpu


def _gpu_seconds(rt, stream, queue):
    start, stop = rt.event(timing=True), rt.event(timing=True)
    start.record(stream)
    queue()
    stop.record(stream)
    return rt.elapsed(start, stop)


def measure(read_mib=READ_MIB, weights=None, gpus=True):
    """The Machine of this box (read_mib: the DRAM read's array; weights: a model whose expert kernels are
    timed too; gpus False: skip the GPUs)."""
    cores = os.cpu_count() or 1
    isa, features = cpu_isa()
    info = _meminfo()
    log.info("CPU: %d cores, %s (%s), %d NUMA node(s); RAM %.0f MiB, %.0f MiB free", cores, isa,
             ", ".join(features) or "no AVX2", numa_nodes(), info.get("MemTotal", 0), info.get("MemAvailable", 0))
    counts = thread_counts(cores)
    dram = dram_bandwidth(counts, read_mib)
    experts = expert_bandwidth(weights, counts) if weights is not None else {}
    heads = None if weights is None else (weights.config.num_heads, weights.config.num_kv_heads,
                                          weights.config.head_dim)
    found, note, attention = measure_gpus(heads=heads) if gpus else ((), "not measured", {})
    return Machine(cores, isa, features, numa_nodes(), info.get("MemTotal", 0.0), info.get("MemAvailable", 0.0),
                   pinned_limit_mib(), dram, experts, found, note, attention)
