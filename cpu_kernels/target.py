"""CPU controls that must be in place before Numba compiles anything.

`STRATA_ISA_FLOOR` compiles for an older CPU than the one we run on (users run
AVX-only Ivy Bridge Xeons). `NUMBA_CPU_NAME` alone is not a floor: LLVM keeps the
host's features (FMA stays on), so the feature list is set explicitly as well.
"""
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


def apply_isa_floor(floor=None):
    """Set Numba's target CPU from `floor` or `STRATA_ISA_FLOOR`; call before importing numba."""
    floor = (floor or os.environ.get("STRATA_ISA_FLOOR") or "native").strip().lower()
    if floor not in ISA_FLOORS:
        raise ValueError(f"STRATA_ISA_FLOOR={floor!r}: expected one of {', '.join(ISA_FLOORS)}")
    cpu_name, features = ISA_FLOORS[floor]
    if cpu_name is not None:
        os.environ["NUMBA_CPU_NAME"] = cpu_name
        os.environ["NUMBA_CPU_FEATURES"] = features
    return floor


def set_threads(num_threads=None):
    """Use `num_threads` (or `STRATA_THREADS`) Numba threads; returns the count in use."""
    import numba

    if num_threads is None:
        env = os.environ.get("STRATA_THREADS")
        num_threads = int(env) if env else None
    if num_threads is None:
        return numba.get_num_threads()
    if num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    num_threads = min(num_threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(num_threads)
    return num_threads
