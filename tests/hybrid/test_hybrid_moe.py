"""The hybrid MoE step without a GPU: a second CPU backend stands in for the device side.

Whatever the resident mask, the split (resident pairs on the "device", the rest on the host at
the same time, then combined) must give the plain CPU path's logits.
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hybrid.backends import CpuBackend, select_backends
from hybrid.formats import load_model
from hybrid.model import Model
from cpu_kernels.mailbox import WAIT_OK, post, ticks, wait_for
from cpu_kernels.sync import LINE
from cpu_kernels.target import chosen_threads
from hybrid.backends.base import Capabilities
from hybrid.pair_groups import PairGroups
from hybrid.relay import Mailbox

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


class StandInDevice(CpuBackend):
    """The device side of an ExpertSplit, on the CPU: submit runs the resident (and borrowed) pairs
    in a worker thread. borrow_bytes_per_second: a copy speed for the borrow cost model."""

    name = "stand-in"
    capabilities = Capabilities(decode_experts=True, decode_relay_device=True)
    time_experts = False

    def __init__(self, resident, prefill_borrow=False, borrow_bytes_per_second=1e9):
        self.requested = resident
        self.prefill_borrow, self.borrow_bytes_per_second = prefill_borrow, borrow_bytes_per_second
        self.pool = ThreadPoolExecutor(1)
        self.submitted = self.borrowed = self.decode_submitted = self.published = 0

    def place(self, model, host=None):
        self.resident = self.requested

    @staticmethod
    def chunk_expert_flops(layer):
        return 1e12

    @staticmethod
    def chunk_part_seconds(pending):
        return None

    def fetch_routing(self, ids, weights):
        return ids, weights

    def fetch_rows(self, x):
        return x

    def wait_rows(self, handle):
        return handle

    def synchronize(self):
        pass

    def submit(self, layer, x, ids, weights, groups=None, borrowed=None):
        if groups is None:
            return self._submit_decode(layer, x, ids, weights)
        self.submitted += 1
        parts = [g for g in (groups, borrowed) if g is not None and g.num_groups]
        self.borrowed += 0 if borrowed is None else borrowed.num_groups
        return self.pool.submit(lambda: sum(self.grouped_experts(x, weights, g, layer.gate_exps, layer.up_exps,
                                                                 layer.down_exps) for g in parts))

    def queue_routing(self, ids, weights, x):
        return ids, weights, x

    def wait_routing(self, handle):
        return handle

    def queue_ids(self, ids, tag):
        return ids.copy()

    def _submit_decode(self, layer, x, ids, weights):
        """The step's resident pairs (p = t * K + j), found from the routing as the device kernel finds them."""
        self.submitted += 1
        self.decode_submitted += 1
        experts = ids.reshape(-1)  # [n*K]
        pairs = np.flatnonzero(self.resident[layer.index][experts])
        order = pairs[np.argsort(experts[pairs], kind="stable")]
        starts = np.flatnonzero(np.r_[True, experts[order][1:] != experts[order][:-1]]) if len(order) else order
        groups = PairGroups(order, experts[order][starts], np.r_[starts, len(order)])
        return self.pool.submit(lambda: self.grouped_experts(x, weights, groups, layer.gate_exps, layer.up_exps,
                                                             layer.down_exps))

    def wait(self, pending):
        return pending.result()

    def zeros_like(self, x):
        return np.zeros_like(x)

    def add_from_host(self, out, host_part):
        out += host_part
        return out

    # the device side of the decode relay, as the GPU kernels do it: post the routing, wait for the rows

    def decode_mailbox(self, num_layers, top_k, hidden, max_tokens=1):
        return Mailbox.allocate(num_layers, top_k, hidden, max_tokens=max_tokens)

    def publish_decode(self, layer, x, ids, weights, mailbox, seq):
        self.published += 1
        n = ids.size
        row = mailbox.inbox[layer.index]  # [n * (2K + H)] used
        row[:n] = ids.reshape(-1).astype(np.int32).view(np.float32)
        row[n:2 * n], row[2 * n:2 * n + x.size] = weights.reshape(-1), x.reshape(-1)
        mailbox.times[layer.index, 0] = time.perf_counter_ns()
        post(mailbox.flags_in, layer.index * LINE, seq)

    def await_host_rows(self, out, layer, mailbox, seq, timeout_s, add=True):
        never = np.zeros(LINE, np.int64)
        if not add:
            out[...] = 0.0
        if wait_for(mailbox.flags_out, layer.index * LINE, seq, never, ticks(timeout_s)) != WAIT_OK:
            mailbox.error[:2] = seq, layer.index
            return out
        out += mailbox.outbox[layer.index, :out.size].reshape(out.shape)
        mailbox.times[layer.index, 1] = time.perf_counter_ns()
        return out


def _masks(num_layers, num_experts):
    rng = np.random.default_rng(0)
    return {"none": np.zeros((num_layers, num_experts), bool),
            "half": rng.random((num_layers, num_experts)) < 0.5,
            "all": np.ones((num_layers, num_experts), bool)}


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_split_matches_cpu_path(gguf_models, target):
    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    weights = load_model(path)
    c = weights.config
    plain = Model(weights, CpuBackend())
    ref = _score(plain)
    for name, mask in _masks(c.num_layers, c.num_experts).items():
        device = StandInDevice(mask)
        got = _score(Model(weights, device, host=CpuBackend()))
        _assert_close(got, ref, name)
        assert (device.submitted > 0) == bool(mask.any()), name
        assert (device.decode_submitted > 0) == bool(mask.any()), name  # the decode token took the one-row path
    inline = Model(weights, StandInDevice(_masks(c.num_layers, c.num_experts)["half"]), host=CpuBackend())
    inline.split.host_side.host_thread = False  # the device part queued first, the prompt's host part in the calling thread
    inline.split.host_side.decode_host_thread = True  # and the decode token's host part in the worker
    _assert_close(_score(inline), ref, "half, prompt host part inline, decode host part in the worker")


def _assert_close(got, ref, name=""):
    """The split only regroups sums, but the dots (prompt and decode) use int16 activations: an upstream
    difference of one float ulp can move a value across a rounding step (2^-15 of its block's largest
    value), so rows agree within 1e-4 of the largest logit, not to float rounding."""
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got[:-1], ref[:-1], rtol=0, atol=1e-4 * scale, err_msg=f"{name}: prompt rows")
    np.testing.assert_allclose(got[-1:], ref[-1:], rtol=0, atol=1e-4 * scale, err_msg=f"{name}: decode row")


def _score(model, prompt_tokens=None):
    from hybrid.batch import Batch, SeqChunk

    tokens = TOKENS if prompt_tokens is None else list(np.resize(TOKENS, prompt_tokens + 1))
    kv = model.new_sequence(256)
    prefill = model.forward(Batch([SeqChunk(kv, 0, np.asarray(tokens[:-1]), "all")]))
    decode = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(tokens[-1:]))]))
    return np.concatenate([prefill, decode])


def test_pair_groups_select():
    ids = np.array([[0, 2], [2, 1], [0, 1]], dtype=np.int64)  # [T, K]
    groups = PairGroups(*CpuBackend().group_pairs(ids, 3))
    keep = np.array([True, False, True])
    part = groups.select(keep)
    assert part.expert_ids.tolist() == [0, 2]
    assert part.row_starts.tolist() == [0, 2, 4]
    assert part.order.tolist() == [0, 4, 1, 2]  # pairs t*K+j of experts 0 then 2
    assert groups.select(~keep).order.tolist() == [3, 5]


def test_device_auto_falls_back_to_cpu(monkeypatch, caplog):
    from gpu_kernels import runtime

    monkeypatch.setattr(runtime, "probe", lambda: runtime.Probe(None, "no GPU here"))
    caplog.set_level("INFO")
    backend, host = select_backends("auto")
    assert isinstance(backend, CpuBackend) and host is None
    assert "no GPU here" in caplog.text
    with pytest.raises(ValueError, match="no GPU here"):
        select_backends("gpu")
    with pytest.raises(ValueError, match="expected one of"):
        select_backends("tpu")


@pytest.mark.parametrize("share", [None, 0.5])
def test_prefill_borrow_matches_cpu_path(gguf_models, share):
    """Non-resident experts borrowed by the device (cost model, or a fixed host share) give the same logits."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    ref = _score(Model(weights, CpuBackend()), prompt_tokens=64)
    device = StandInDevice(np.zeros((c.num_layers, c.num_experts), bool), prefill_borrow=True,
                           borrow_bytes_per_second=1e15)
    model = Model(weights, device, host=CpuBackend())
    model.split.borrow.cpu_share = share
    got = _score(model, prompt_tokens=64)
    _assert_close(got, ref)
    assert device.borrowed > 0


def test_a_chunk_layers_device_part_is_timed_once_the_device_is_past_it(gguf_models):
    """The borrow model gets each chunk layer's device part from the device's own clock (chunk_part_seconds), read
    at the next chunk layer's routing; never the caller's wait, which also holds the host part."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    device = StandInDevice(np.ones((c.num_layers, c.num_experts), bool), prefill_borrow=True)
    timed = []
    device.chunk_part_seconds = lambda pending: timed.append(pending) or 1e-3
    model = Model(weights, device, host=CpuBackend())
    folded = []
    model.split.borrow.measure_device = lambda layer, rows, seconds, *rest: folded.append((layer.index, rows, seconds))
    _score(model, prompt_tokens=64)
    moe_layers = [layer.index for layer in model.layers if layer.gate_exps is not None]
    assert [index for index, _, _ in folded] == moe_layers[:-1]  # the last one waits for the next chunk
    assert all(rows == 64 * c.num_experts_per_tok and seconds == 1e-3 for _, rows, seconds in folded)


def test_borrow_cost_model():
    from types import SimpleNamespace

    from placement.borrow import BorrowModel

    raw = np.zeros((4, 8, 100), np.uint8)  # [E, R, B]: 2400 bytes an expert
    layer = SimpleNamespace(gate_exps=SimpleNamespace(shape=(4, 8, 64), raw=raw), up_exps=SimpleNamespace(raw=raw),
                            down_exps=SimpleNamespace(raw=raw))
    groups = PairGroups(np.arange(106), np.arange(4), np.array([0, 100, 101, 103, 106]))  # rows 100, 1, 2, 3
    borrow = BorrowModel(cpu_share=None)
    borrow.host_flops = 6 * 64 * 8 * 1000.0  # 1 ms a row
    assert borrow.plan(layer, groups, bytes_per_second=2400 / 0.010).tolist() == [False, True, True, True]
    assert borrow.plan(layer, groups, bytes_per_second=2400 / 0.5).tolist() == [True] * 4  # copies too slow
    borrow.cpu_share = 0.06  # the least-used experts up to 6 % of the rows stay on the host
    assert borrow.plan(layer, groups, bytes_per_second=1.0).tolist() == [False, True, True, True]



@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_compiled_host_decode_is_bit_identical(gguf_models, target):
    """A decode token's host part as one compiled call (CpuBackend.host_decode_experts) gives the op-by-op
    path's logits bit for bit: the same kernels on the same rows in the same order."""
    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    weights = load_model(path)
    c = weights.config
    mask = _masks(c.num_layers, c.num_experts)["half"]
    scores = {}
    for compiled in (False, True):
        host = CpuBackend()
        model = Model(weights, StandInDevice(mask), host=host)
        assert model.split.host_side.compiled_host_decode  # on by default where the host has it
        model.split.host_side.compiled_host_decode = compiled
        model.split.relay.enabled = False  # the serving thread's own path (the relay always uses the compiled call)
        scores[compiled] = _score(model)
        assert bool(host._host_plans) == compiled
    np.testing.assert_array_equal(scores[True], scores[False])


@pytest.mark.parametrize("resident_share", [0.0, 0.5, 1.0])
def test_host_decode_experts_picks_the_non_resident_pairs(gguf_models, resident_share):
    path, _ = gguf_models("kquant", "Q4_K_M")
    weights = load_model(path)
    host = CpuBackend()
    layer, c = Model(weights, host).layers[1], weights.config
    rng = np.random.default_rng(int(resident_share * 10))
    x = rng.standard_normal((1, c.hidden_size)).astype(np.float32)  # [1, H]
    k = c.num_experts_per_tok
    ids = rng.choice(c.num_experts, k, replace=False)[None].astype(np.int32)  # [1, K], not sorted
    w = rng.random((1, k)).astype(np.float32)  # [1, K]
    resident = rng.random(c.num_experts) < resident_share  # [E]
    out, num_pairs = host.host_decode_experts(layer, x, ids, w, resident)
    slots = np.flatnonzero(~resident[ids[0]])
    assert num_pairs == len(slots)
    order = slots[np.argsort(ids[0][slots], kind="stable")]
    groups = PairGroups(order, ids[0][order].astype(np.int64), np.arange(len(order) + 1))
    ref = host.grouped_experts(x, w, groups, layer.gate_exps, layer.up_exps, layer.down_exps) if len(slots) \
        else np.zeros_like(x)
    np.testing.assert_array_equal(out, ref)


def _decode_steps(model, steps=3):
    """Logits [steps + 1, V]: the prompt's last row, then `steps` decode tokens (fixed ids) one at a time."""
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(256)
    rows = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-steps]), "last")]))]
    for token in TOKENS[-steps:]:
        rows.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([token]))])))
    return np.concatenate(rows)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_decode_relay_is_bit_identical(gguf_models, target):
    """Decode tokens whose host part goes through the relay (the stand-in device posts the routing to the
    mailbox and waits for the rows there, a worker thread runs the host experts) give the inline path's
    logits bit for bit, over several steps (the flags' step numbers grow) and every resident mask."""
    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    weights = load_model(path)
    c = weights.config
    for name, mask in _masks(c.num_layers, c.num_experts).items():
        scores, devices = {}, {}
        for relay in (False, True):
            device = devices[relay] = StandInDevice(mask)
            model = Model(weights, device, host=CpuBackend())
            model.split.relay.enabled = relay
            model.split.trace = []
            scores[relay] = _decode_steps(model)
        np.testing.assert_array_equal(scores[True], scores[False], err_msg=name)
        hybrid_layers = int((~mask).any(axis=1).sum())
        assert devices[True].published == 3 * hybrid_layers, name  # fully resident layers never relay
        assert devices[False].published == 0


def _batch_decode_steps(model, users=3, steps=2):
    """Logits [steps * users, V] of decode steps that hold one token of each of `users` sequences."""
    from hybrid.batch import Batch, SeqChunk

    kvs = [model.new_sequence(256) for _ in range(users)]
    for u, kv in enumerate(kvs):
        model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[u:u + 6]), "last")]))
    rows = []
    for step in range(steps):
        rows.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[7 + step + u]]))
                                         for u, kv in enumerate(kvs)])))
    return np.concatenate(rows)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_a_decode_step_of_several_users_through_the_relay_is_bit_identical(gguf_models, target):
    """With relay_tokens >= the users, a decode step of three sequences' tokens goes through the relay as one
    post a layer (the host groups the three tokens' pairs by expert, the device finds its resident pairs
    itself): the same logits bit for bit as the prompt-chunk way (relay_tokens 1), its usage too, and each
    relayed layer's trace counts three tokens."""
    from hybrid.expert_usage import ExpertUsage

    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    weights = load_model(path)
    c = weights.config
    for name, mask in _masks(c.num_layers, c.num_experts).items():
        scores, devices, usages, traces = {}, {}, {}, {}
        for tokens in (1, 3):
            device = devices[tokens] = StandInDevice(mask)
            model = Model(weights, device, host=CpuBackend())
            model.split.relay.enabled, model.split.relay.tokens, model.split.trace = True, tokens, []
            model.usage = usages[tokens] = ExpertUsage(c.num_layers, c.num_experts, c.num_experts_per_tok)
            scores[tokens] = _batch_decode_steps(model)
            traces[tokens] = [t for t in model.split.trace if t["tokens"] == 3]
            model.close()
        np.testing.assert_array_equal(scores[3], scores[1], err_msg=name)
        for field in ("prefill", "decode", "coactivation"):
            np.testing.assert_array_equal(getattr(usages[3], field), getattr(usages[1], field), err_msg=name)
        hybrid_layers = int((~mask).any(axis=1).sum())
        assert devices[1].published == 0 and devices[3].published == 2 * hybrid_layers, name  # a post a layer
        assert len(traces[3]) == 2 * c.num_layers and len(traces[1]) == 2 * c.num_layers, name
        # fully resident layers take a several-token step as a decode step with the relay or without
        assert devices[3].decode_submitted > devices[1].decode_submitted or mask.all() or not mask.any(), name


@pytest.mark.parametrize("field, value, message", [("relay_tokens", 0, "a token count >= 1"),
                                                    ("relay_threads", 0, "a thread count >= 1"),
                                                    ("cpu_share", 1.5, "a number from 0 to 1")])
def test_split_settings_are_checked(field, value, message):
    from hybrid.moe import SplitSettings

    with pytest.raises(ValueError, match=f"{field}={value}: expected {message}"):
        SplitSettings(**{field: value})


def test_closing_the_model_stops_the_relay_worker_and_a_later_step_starts_it_again(gguf_models):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    model = Model(weights, StandInDevice(_masks(c.num_layers, c.num_experts)["half"]), host=CpuBackend())
    model.split.relay.enabled = True
    first = _decode_steps(model, steps=1)
    relay = model.split.relay.worker
    assert relay is not None and relay.alive
    model.close()
    assert not relay.alive and model.split.relay.worker is None
    model.close()  # twice: nothing left to stop
    np.testing.assert_array_equal(_decode_steps(model, steps=1), first)
    assert model.split.relay.worker.alive
    model.close()


def test_relay_worker_runs_its_experts_on_the_chosen_thread_count(gguf_models, monkeypatch):
    """relay_threads (STRATA_RELAY_THREADS) sets the worker's Numba threads at each job (at most the cores), unset
    the count set_threads chose; the logits stay the inline path's bit for bit."""
    import numba

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    mask = _masks(c.num_layers, c.num_experts)["half"]
    inline = Model(weights, StandInDevice(mask), host=CpuBackend())
    inline.split.relay.enabled = False
    ref = _decode_steps(inline, steps=2)
    host = CpuBackend()
    seen = []
    real = host.relay_decode_experts

    def counting(layer, mailbox, *args):
        seen.append((threading.current_thread().name, numba.get_num_threads()))
        return real(layer, mailbox, *args)

    monkeypatch.setattr(host, "relay_decode_experts", counting)
    model = Model(weights, StandInDevice(mask), host=host)
    model.split.relay.enabled = True
    for threads in (None, 1, 4096):  # more than the cores: as many as there are
        model.split.relay.threads = threads
        seen.clear()
        np.testing.assert_array_equal(_decode_steps(model, steps=2), ref, err_msg=str(threads))
        worker = [n for name, n in seen if name == "host-relay"]  # not the warm-ups, in the calling thread
        assert worker and set(worker) == {min(threads or chosen_threads(), numba.config.NUMBA_NUM_THREADS)}, seen
    model.close()


def test_decode_relay_records_usage_and_trace(gguf_models):
    from hybrid.expert_usage import ExpertUsage

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    mask = _masks(c.num_layers, c.num_experts)["half"]
    usages = {}
    for relay in (False, True):
        model = Model(weights, StandInDevice(mask), host=CpuBackend())
        model.split.relay.enabled = relay
        model.usage = usages[relay] = ExpertUsage(c.num_layers, c.num_experts, c.num_experts_per_tok)
        model.split.trace = []
        _decode_steps(model, steps=2)
    for name in ("prefill", "decode", "coactivation"):
        np.testing.assert_array_equal(getattr(usages[True], name), getattr(usages[False], name), err_msg=name)
    assert usages[True].decode.sum() == 2 * c.num_layers * c.num_experts_per_tok
    trace = model.split.trace[-c.num_layers:]  # the last decode step's layers, relayed
    assert [t["layer"] for t in trace] == list(range(c.num_layers))
    for t in trace:
        assert t["cpu_s"] > 0 and t["step_s"] >= t["cpu_s"] * 0.5 and t["queue_s"] > 0, t
        assert t["wait_s"] >= 0 and (t["layer"] == 0 or t["gap_s"] >= 0), t  # the worker's spin, its time between
    assert np.isnan(trace[0]["gap_s"])  # layers (none before the step's first)


def test_decode_relay_failure_fails_the_step_and_the_next_one_runs(gguf_models, monkeypatch):
    """Host experts that raise in the relay's worker: that step raises an error naming the layer (its device
    wait ends at once, on zero rows), the next step runs as before."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    mask = _masks(c.num_layers, c.num_experts)["none"]
    ref = _decode_steps(Model(weights, CpuBackend()), steps=2)
    host = CpuBackend()
    model = Model(weights, StandInDevice(mask), host=host)
    model.split.relay.enabled = True
    real = host.relay_decode_experts
    failed = []

    def flaky(layer, mailbox, *args):
        if mailbox is model.split.relay.worker.mailbox and layer.index == 1 and not failed:  # not a warm-up's scratch
            failed.append(layer.index)
            raise MemoryError("test: no room")
        return real(layer, mailbox, *args)

    monkeypatch.setattr(host, "relay_decode_experts", flaky)
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(256)
    prompt = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-2]), "last")]))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"decode relay: layer 1: the host experts failed: MemoryError"):
        model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[-2:-1]))]))
    assert time.perf_counter() - start < 20  # no device wait ran into its timeout
    assert kv.length == len(TOKENS) - 2  # the failed step appended nothing
    rows = [prompt] + [model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])) for t in TOKENS[-2:]]
    _assert_close(np.concatenate(rows), ref)
