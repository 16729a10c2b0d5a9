"""ExpertUsage: the model records each layer's routing, prefill and decode apart."""
import numpy as np

from hybrid.backends import CpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.expert_usage import ExpertUsage
from hybrid.formats import load_model
from hybrid.model import Model


def test_record_counts_and_coactivation():
    usage = ExpertUsage(num_layers=2, num_experts=4, num_experts_per_tok=2)
    usage.begin(Batch([SeqChunk(None, 0, np.array([1, 2, 3])), SeqChunk(None, 7, np.array([4]))]))
    usage.record(1, np.array([[0, 1], [0, 2], [3, 0], [2, 1]]))  # the last row is the decode token
    assert usage.prefill[1].tolist() == [3, 1, 1, 1] and usage.decode[1].tolist() == [0, 1, 1, 0]
    assert (usage.prefill[0] == 0).all() and (usage.tokens_prefill, usage.tokens_decode) == (3, 1)
    co = usage.coactivation[1]
    assert (co == co.T).all() and co[0, 1] == co[0, 2] == co[0, 3] == co[1, 2] == 1 and co.sum() == 8
    resident = np.zeros((2, 4), dtype=bool)
    resident[1, 0] = True
    snap = usage.snapshot(resident)
    assert snap["hit_rate_prefill"] == 0.5 and snap["hit_rate_decode"] == 0.0 and snap["routings_prefill"] == 6
    profile = usage.to_profile("m", source="test")
    assert profile.tokens_decode == 1 and (profile.prefill == usage.prefill).all()


def test_model_records_prefill_and_decode(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    weights = load_model(path)
    model = Model(weights, CpuBackend())
    c = weights.config
    model.usage = ExpertUsage.for_config(c)
    kv = model.new_sequence(64)
    model.forward(Batch([SeqChunk(kv, 0, np.array([3, 17, 42, 5, 99], dtype=np.int64))]))
    for token in (7, 8):
        model.forward(Batch([SeqChunk(kv, kv.length, np.array([token], dtype=np.int64))]))
    usage = model.usage
    assert (usage.tokens_prefill, usage.tokens_decode) == (5, 2)
    K = c.num_experts_per_tok
    assert (usage.prefill.sum(axis=1) == 5 * K).all() and (usage.decode.sum(axis=1) == 2 * K).all()
    assert (usage.coactivation.sum(axis=(1, 2)) == 7 * K * (K - 1)).all()
