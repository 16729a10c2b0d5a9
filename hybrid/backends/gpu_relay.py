"""The GPU backend's side of the decode relay (hybrid/relay.py) and the add of host rows: the mailbox in pinned
host memory mapped into the device, the kernels that post a layer's routing there and add the host's rows once
they are posted, and a one-token host row read by the add kernel straight from a mapped buffer.
Shape legend: n a relayed step's tokens, T tokens, H hidden, K top-k."""
import numpy as np

from cpu_kernels.sync import LINE

from ..relay import Mailbox

_MAILBOX_ARRAYS = ("inbox", "outbox", "flags_in", "flags_out", "error", "times")


class GpuRelay:
    """The relay state of one GPU backend: the device addresses of its mapped pinned buffers, and the step number the
    relay kernels read (int64 [1] on the device, written on the stream before a step's first post: a step graph of
    them serves every step). The backend comes with each call (no back-reference: see gpu_layer_graphs.LayerGraphs)."""

    def __init__(self):
        self._mapped = {}  # host address of a pinned buffer -> its device address (0: not mapped)
        self.step = None  # int64 [1] on the device: the step number the relay kernels post and wait for
        self._step_written = None  # the number last queued into it

    def decode_mailbox(self, be, num_layers, top_k, hidden, max_tokens=1):
        """A relay Mailbox (steps of up to max_tokens tokens) in pinned host memory with its arrays' device addresses
        (mailbox.addresses), or None where this runtime does not map pinned memory into the device."""
        mailbox = Mailbox.allocate(num_layers, top_k, hidden, empty=be.rt.pinned_empty, max_tokens=max_tokens)
        mapped = getattr(be.rt, "mapped_address", lambda _: None)
        addresses = {name: mapped(getattr(mailbox, name)) for name in _MAILBOX_ARRAYS}
        if not all(addresses.values()):
            return None
        mailbox.addresses = {name: np.uint64(a) for name, a in addresses.items()}
        if self.step is None:
            self.step = be.rt.zeros((1,), np.int64)
        return mailbox

    def set_step(self, be, seq):
        """Queue step number seq into `step`, where the relay kernels queued after read it (no copy where it holds
        seq already: inside a step graph's queuing, which the caller set it for before)."""
        if seq != self._step_written:
            be.staging.upload("relay_step", np.array([seq], np.int64), be.stream, out=self.step)
            self._step_written = seq

    def publish_decode(self, be, layer, x, ids, weights, mailbox, seq):
        """Queue the post of a decode step's routing (ids [n, K], weights [n, K]) and rows x [n, H] to the mailbox's
        inbox[layer] (ids, weights, rows one after another), flagged with step number seq."""
        self.set_step(be, seq)
        s = be.device_experts.stage_decode(be, x, ids, weights)
        a, i = mailbox.addresses, layer.index
        be.kernels.publish_decode(s["in"], a["inbox"] + np.uint64(i * mailbox.inbox[0].nbytes),
                                  a["flags_in"] + np.uint64(i * LINE * 8), self.step, a["times"] + np.uint64(i * 16))

    def await_host_rows(self, be, out, layer, mailbox, seq, timeout_s, add=True):
        """Queue out [n, H] += the host rows of step seq in outbox[layer] (add False: out = those rows), once the host
        posts them; returns out."""
        self.set_step(be, seq)
        a, i = mailbox.addresses, layer.index
        be.kernels.await_host_add(out, a["outbox"] + np.uint64(i * mailbox.outbox[0].nbytes),
                                  a["flags_out"] + np.uint64(i * LINE * 8), self.step, int(timeout_s * 1e9),
                                  a["error"], i, a["times"] + np.uint64(i * 16), add)
        return out

    def add_from_host(self, be, out, host_part):
        """out [T, H] (device) += host_part [T, H] (host). One token's row is read by the add kernel straight from
        a pinned buffer where the runtime maps pinned memory (one launch, no copy); else it is copied through one."""
        if host_part.shape[0] == 1:
            view = be.staging.view("host_row", host_part.shape, host_part.dtype)
            address = self._mapped.get(view.ctypes.data)
            if address is None:
                address = self._mapped[view.ctypes.data] = getattr(be.rt, "mapped_address", lambda _: 0)(view) or 0
            if address:
                np.copyto(view, host_part)
                be.kernels.add_into(out, np.uint64(address))
                be.staging.queued("host_row", be.stream)  # the buffer is not rewritten before the add ran
                return out
        be.kernels.add_into(out, be.staging.upload("host_part", host_part, be.stream))
        return out
