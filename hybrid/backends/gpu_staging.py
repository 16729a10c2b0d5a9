"""Pinned host buffers for the GPU backend's host <-> device copies, and a queued device part of a layer's experts.
Shape legend: none (byte buffers viewed as any shape)."""
import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Pending:
    """The device part of one layer, queued: its output [T, H] and, when timed, its two events."""

    out: object
    start: object = None
    stop: object = None


class Staging:
    """Pinned host buffers by name, grown on demand. Each remembers the event after its last
    queued copy, and a new use first waits for it, so a buffer is never rewritten mid-copy."""

    def __init__(self, runtime):
        self.rt = runtime
        self.buffers = {}  # name -> (pinned uint8 array, event or None)
        self.events = {}  # name -> its event, recorded again at each use (a decode step makes hundreds)

    def view(self, name, shape, dtype):
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        buffer, event = self.buffers.get(name, (None, None))
        if event is not None:
            event.synchronize()
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self.rt.pinned_empty((max(nbytes, 4096) * 2,), np.uint8)
        self.buffers[name] = (buffer, None)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def queued(self, name, stream):
        """Mark the last copy through buffer `name` as queued on `stream`; returns its event (the buffer's own: a
        wait on it after a later use of the buffer waits for that use too)."""
        event = self.events.get(name)
        if event is None:
            event = self.events[name] = self.rt.event()
        event.record(stream)
        self.buffers[name] = (self.buffers[name][0], event)
        return event

    def upload(self, name, host, stream, out=None):
        """A device copy of the host array `host`, queued on `stream` through buffer `name`: into the device array
        `out` (same shape and type) where given, else a new one."""
        view = self.view(name, host.shape, host.dtype)
        np.copyto(view, host)
        dev = self.rt.empty(host.shape, host.dtype) if out is None else out
        self.rt.copy_from_host_async(dev, view, stream)
        self.queued(name, stream)
        return dev

    def download(self, name, dev, stream):
        """(pinned host view, event): a copy of the device array `dev` queued on `stream`; read the
        view after event.synchronize()."""
        view = self.view(name, dev.shape, dev.dtype)
        self.rt.copy_to_host_async(view, dev, stream)
        return view, self.queued(name, stream)

