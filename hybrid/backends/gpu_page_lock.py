"""The model's expert weights page-locked where they lie (the mapped file's pages), so that the device copies the
experts a prompt chunk borrows straight from them: one direct transfer an expert's tensor, no gather into a staging
buffer on a host core (which ran at ~2 GB/s beside the host's own experts, H100 host, bench/results/gpu_model.md).
Where the platform refuses (a memory-lock limit), borrowed experts go through the staging buffer as before."""
import logging
import time
import weakref

log = logging.getLogger(__name__)

PAGE_BYTES = 4096


def page_ranges(arrays):
    """[(start, end)]: the host address ranges of `arrays`, widened to whole pages, sorted, overlaps merged."""
    spans = sorted((a.ctypes.data // PAGE_BYTES * PAGE_BYTES, -(-(a.ctypes.data + a.nbytes) // PAGE_BYTES) * PAGE_BYTES)
                   for a in arrays if a.nbytes)
    merged = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class PageLocked:
    """The address ranges [(start, end)] a runtime holds page-locked (none: nothing is)."""

    def __init__(self, ranges=()):
        self.ranges = list(ranges)

    def holds(self, array):
        """Whether every byte of the contiguous host array lies in a locked range."""
        start = array.ctypes.data
        return any(lo <= start and start + array.nbytes <= hi for lo, hi in self.ranges)

    @property
    def num_bytes(self):
        return sum(hi - lo for lo, hi in self.ranges)


def lock_experts(rt, layers, owner):
    """Page-lock the expert tensors of `layers` (gate, up, down) through runtime `rt`, for as long as `owner` (the
    backend) lives: a PageLocked of what was locked, empty where the runtime refused any range (none stays locked)."""
    arrays = [t.raw for layer in layers for t in (layer.gate_exps, layer.up_exps, layer.down_exps)]
    t0, locked = time.perf_counter(), []
    for start, end in page_ranges(arrays):
        if not rt.page_lock(start, end - start):
            for lo, _ in locked:
                rt.page_unlock(lo)
            log.info("borrowed experts go through a staging buffer: the expert weights (%.1f GiB) could not be "
                     "page-locked in place (the memory-lock limit, `ulimit -l`?)", sum(a.nbytes for a in arrays) / 2**30)
            return PageLocked()
        locked.append((start, end))
    # the arrays stay referenced by the finalizer: their pages are unlocked before they can be unmapped
    weakref.finalize(owner, _unlock, rt, [lo for lo, _ in locked], arrays)
    result = PageLocked(locked)
    log.info("borrowed experts are copied straight from the model's pages: %.1f GiB page-locked in %.1f s",
             result.num_bytes / 2**30, time.perf_counter() - t0)
    return result


def _unlock(rt, starts, _arrays):
    for start in starts:
        rt.page_unlock(start)
