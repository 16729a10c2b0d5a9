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


def test_a_step_held_and_added_at_its_end_counts_as_records_added_at_once():
    """Within step(), decode-sized records are held and the step's layers added in one go (prompt-sized ones at
    once, a layer at a time): the counts equal those of every record added as it came, and nothing is counted
    before the step ends. Random routings of 3 decode tokens and one 40-token prompt chunk, over 6 layers."""
    L, E, K = 6, 16, 4
    rng = np.random.default_rng(5)
    steps = [Batch([SeqChunk(None, start, np.array([t])) for start, t in ((9, 1), (4, 2), (6, 3))]),
             Batch([SeqChunk(None, 0, np.arange(40)), SeqChunk(None, 3, np.array([5]))])]
    routings = [[np.stack([rng.choice(E, K, replace=False) for _ in range(sum(len(c.token_ids) for c in b.chunks))])
                 for _ in range(L)] for b in steps]
    at_once, held = ExpertUsage(L, E, K), ExpertUsage(L, E, K)
    for batch, layers in zip(steps, routings):
        at_once.begin(batch)
        for layer in rng.permutation(L):
            at_once.record(layer, layers[layer])
        with held.step(batch):
            for layer in rng.permutation(L):
                buffer = layers[layer].astype(np.int32)
                held.record(layer, buffer)
                buffer[:] = 0  # a reused buffer: the held record is a copy
            if len(batch.chunks) == 3:
                assert held.decode.sum() == 0  # held until the step ends
    for name in ("decode", "prefill", "coactivation"):
        assert (getattr(held, name) == getattr(at_once, name)).all(), name
    assert at_once.decode.sum() == 4 * L * K and at_once.prefill.sum() == 40 * L * K
    layers = [0, 2, 2, 5]  # a layer may come twice in a step (its adds are one bincount / add.at set)
    ids = rng.integers(0, E, (4, 3, K))
    one, each = ExpertUsage(L, E, K), ExpertUsage(L, E, K)
    each.begin(steps[0])
    with one.step(steps[0]):
        for layer, layer_ids in zip(layers, ids):
            one.record(layer, layer_ids)
    for layer, layer_ids in zip(layers, ids):
        each.record(layer, layer_ids)
    assert (one.decode == each.decode).all() and (one.coactivation == each.coactivation).all()
