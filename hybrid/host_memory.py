"""Large host arrays in anonymous mappings asked for transparent huge pages.

A decode that streams expert weights through 4 KiB pages misses the TLB at every page: ~7 GB/s on
one core instead of ~23 GB/s from 2 MiB pages (bench/results/cpu_decode_profile.md). The mappings are
advised for huge pages themselves (as NumPy does for its own large buffers), and skip swap
reservation, so a pool sized for the worst case costs memory only where it is written.
"""
import mmap

import numpy as np

MAPPED_MIN_BYTES = 1 << 21  # arrays from this size on are mappings of their own


def host_array(shape, dtype):
    """An uninitialized array; a large one is its own anonymous mapping, advised for huge pages and
    committed page by page as it is written."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return np.empty(shape, dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=dtype).reshape(shape)


def huge_page_copy(array):
    """A writable copy of `array` in a host_array."""
    out = host_array(array.shape, array.dtype)
    np.copyto(out, array)
    return out
