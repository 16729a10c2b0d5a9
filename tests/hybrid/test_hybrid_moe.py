"""The hybrid MoE step without a GPU: a second CPU backend stands in for the device side.

Whatever the resident mask, the split (resident pairs on the "device", the rest on the host at
the same time, then combined) must give the plain CPU path's logits.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hybrid.backends import CpuBackend, select_backends
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.moe import PairGroups

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


class StandInDevice(CpuBackend):
    """The device side of an ExpertSplit, on the CPU: submit runs the resident pairs in a worker thread."""

    name = "stand-in"

    def __init__(self, resident):
        self.requested = resident
        self.pool = ThreadPoolExecutor(1)
        self.submitted = 0

    def place(self, model):
        self.resident = self.requested

    def submit_experts(self, layer, x, ids, weights, groups):
        self.submitted += 1
        return self.pool.submit(self.grouped_experts, x, weights, groups, layer.gate_exps, layer.up_exps,
                                layer.down_exps)

    def wait_experts(self, pending):
        return pending.result()

    def zeros_like(self, x):
        return np.zeros_like(x)

    def add_from_host(self, out, host_part):
        out += host_part
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
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=name)
        assert (device.submitted > 0) == bool(mask.any()), name


def _score(model):
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(256)
    prefill = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-1]), "all")]))
    decode = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[-1:]))]))
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
