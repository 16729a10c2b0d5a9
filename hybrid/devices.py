"""The devices of a run over several GPUs (`--gpus`): one runtime per pipeline stage.

`--gpus 0,1`: a stage on each GPU. An index given more than once (`--gpus 0,0`) presents that GPU as that many
logical devices: each has its own runtime, stream, memory pool and budget (an even share of the GPU's free memory,
fixed at start-up, so that one stage's allocations never shrink another's plan), and a stage-to-stage copy takes
the path a peer copy takes (gpu_kernels/runtime.py copy_peer_async). Without `--gpus`: every visible GPU.
"""
import logging
from collections import Counter

log = logging.getLogger(__name__)


def visible_gpus():
    """The GPU indices CuPy sees, (0,) where it cannot count them."""
    try:
        import cupy

        return tuple(range(int(cupy.cuda.runtime.getDeviceCount()))) or (0,)
    except Exception:  # no CuPy or no driver: the probe already said why
        return (0,)


def stage_gpus(cfg, device):
    """The GPUs of a run (its pipeline stages): () on the CPU, --gpus, else every visible GPU; () where "auto" finds
    no usable GPU (the engine then runs on the CPU as it says)."""
    if device == "cpu":
        return ()
    gpus = cfg.gpus if cfg.gpus is not None else visible_gpus()
    if len(gpus) == 1 and gpus[0] != 0:
        raise ValueError(f"--gpus {gpus[0]}: one GPU runs as GPU 0; choose it with CUDA_VISIBLE_DEVICES={gpus[0]} "
                         f"(HIP_VISIBLE_DEVICES on ROCm)")
    if len(gpus) > 1 and device == "auto":
        from gpu_kernels.runtime import probe

        if probe().runtime is None:
            return ()
    return gpus


def open_runtimes(gpus):
    """[CupyRuntime] for `gpus` (indices, repeated ones shared as logical devices); ValueError naming --gpus when an
    index is not a visible GPU."""
    from gpu_kernels.runtime import CupyRuntime

    visible = visible_gpus()
    missing = sorted(set(gpus) - set(visible))
    if missing:
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: GPU {missing[0]} is not visible (GPUs "
                         f"{','.join(map(str, visible))})")
    shares = {}
    for index, count in Counter(gpus).items():
        if count > 1:
            free, total = CupyRuntime(index).memory_info()
            shares[index] = (free // count, total // count)
            log.info("GPU %d presented as %d logical devices of %.0f MiB free each", index, count,
                     free / count / 2**20)
    runtimes = [CupyRuntime(index, memory_limit=shares.get(index)) for index in gpus]
    runtimes[0].use()
    return runtimes


def stage_free(runtimes):
    """int [S]: the free bytes of each stage's device (its share for a logical device)."""
    return [int(rt.memory_info()[0]) for rt in runtimes]
