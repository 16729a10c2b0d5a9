"""CPU controls that must be in place before Numba compiles anything.

The ISA floor compiles for an older CPU than the one we run on (users run AVX-only Ivy Bridge
Xeons; hybrid/config.py's isa_floor applies it). `NUMBA_CPU_NAME` alone is not a floor: LLVM keeps
the host's features (FMA stays on), so the feature list is set explicitly as well.
"""
import functools
import logging
import os

log = logging.getLogger(__name__)

ISA_FLOORS = {
    # name: (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES)
    "avx": ("sandybridge", ""),
    "avx2": ("haswell", ""),
    "avx512": ("skylake-avx512", ""),
    "native": (None, None),
}


def apply_isa_floor(floor="native"):
    """Set Numba's target CPU for `floor` (a name of ISA_FLOORS); call before the kernel modules are imported
    (they choose code by the target at import). Numba is told through its own variables."""
    if floor not in ISA_FLOORS:
        raise ValueError(f"ISA floor {floor!r}: expected one of {', '.join(ISA_FLOORS)}")
    cpu_name, features = ISA_FLOORS[floor]
    if cpu_name is not None:
        from numba.core import config

        os.environ["NUMBA_CPU_NAME"] = cpu_name
        os.environ["NUMBA_CPU_FEATURES"] = features
        config.reload_config()
    return floor


CHOSEN_FEATURES = ("avx512bw", "avx512vl", "avx512vnni", "avxvnni", "avx2", "f16c")
# Features of the CPU names a target may be set to with an empty feature list (Sandy Bridge has none).
NAMED_CPU_FEATURES = {
    "sandybridge": set(),
    "ivybridge": {"f16c"},
    "haswell": {"avx2", "f16c"},
    "skylake": {"avx2", "f16c"},
    "skylake-avx512": {"avx512bw", "avx512vl", "avx2", "f16c"},
    "cascadelake": {"avx512bw", "avx512vl", "avx512vnni", "avx2", "f16c"},
}


@functools.cache
def _enabled_features():
    """The compile target's CPU features, read from what Numba will compile for (its CPU_NAME / CPU_FEATURES,
    however they were set), not from the host: code for a feature the target lacks does not compile."""
    import llvmlite.binding as ll
    from numba.core import config

    name, features = config.CPU_NAME, config.CPU_FEATURES
    if features:  # an explicit "+avx2,-avx512bw,..." list
        return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))
    if name and name != "host":
        return frozenset(NAMED_CPU_FEATURES.get(name.lower(), set()))  # unknown names: the portable path
    return frozenset(f for f, on in ll.get_host_cpu_features().items() if on)


def _target_features():
    """The compile target's CPU features that kernels choose code by: {"avx512bw", ..., "f16c"} -> bool."""
    enabled = _enabled_features()
    return {f: f in enabled for f in CHOSEN_FEATURES}


def int_dot_width():
    """The widest pmaddwd of the compile target, in int16 lanes: 32 (AVX-512BW), 16 (AVX2) or 8 (SSE2)."""
    features = _target_features()
    return 32 if features["avx512bw"] else 16 if features["avx2"] else 8


def vnni_width():
    """The widest vpdpbusd (u8 x s8 dot into int32) of the compile target, in bytes: 64 (AVX-512 VNNI),
    32 (AVX-VNNI, or AVX-512 VNNI with VL), or 0 where the target has none."""
    features = _target_features()
    if features["avx512vnni"] and features["avx512bw"]:
        return 64
    return 32 if features["avxvnni"] or (features["avx512vnni"] and features["avx512vl"]) else 0


def has_byte_permutes():
    """Whether the compile target has AVX-512 VBMI (vpermi2b: 64 byte lookups in a 128-byte table) and BITALG
    (vpshufbitqmb: 64 bits picked from qwords into a mask)."""
    return {"avx512bw", "avx512vbmi", "avx512bitalg"} <= _enabled_features()


def has_f16c():
    """Whether the compile target converts halves to float in one instruction (vcvtph2ps)."""
    return _target_features()["f16c"]


_chosen_threads = None  # the count set_threads chose, for the threads that start later (use_chosen_threads)


def set_threads(num_threads=None):
    """Use `num_threads` Numba threads (None: leave the count as it is); returns the count in use.

    Numba keeps this count per calling thread, and a new thread starts at NUMBA_NUM_THREADS (every
    core): each thread that runs kernels calls `use_chosen_threads` first."""
    global _chosen_threads
    import numba

    if num_threads is None:
        return numba.get_num_threads()
    if num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    num_threads = min(num_threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(num_threads)
    _chosen_threads = num_threads
    return num_threads


def chosen_threads():
    """The Numba thread count set_threads chose, else the one a new thread starts with (NUMBA_NUM_THREADS)."""
    if _chosen_threads is not None:
        return _chosen_threads
    import numba

    return numba.config.NUMBA_NUM_THREADS


def use_chosen_threads():
    """In the calling thread, the Numba thread count set_threads chose (nothing when none was chosen)."""
    if _chosen_threads is not None:
        import numba

        numba.set_num_threads(_chosen_threads)
