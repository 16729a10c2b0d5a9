"""Several users' decode tokens in one step graph (hybrid/step_graph.py, hybrid/backends/gpu_step.py) on GpuBackend's
Python side over the NumPy stand-in runtime and reference kernels: the same logits as the same tokens stepped one by
one, one graph per token count and keys bound, each chunk reading its own sequence's table and position; on a GPU
(marked gpu) the same against the CPU engine, and the slot kernels (kv.cu kv_write with slot_table,
paged_attention_1s a slot a grid z) against the reference per slot."""
import numpy as np
import pytest

from hybrid import kv_store
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.expert_usage import ExpertUsage
from hybrid.formats import load_model
from hybrid.model import Model
from tests.gpu_kernels.test_backend_wiring import TOKENS, CpuBackend

TOLERANCE = {"F32": 1e-4, "Q8_0": 2e-3}


def _model(weights, numpy_runtime, reference_kernels, users, step_graphs=True):
    c = weights.config
    backend = GpuBackend(numpy_runtime, max_context=512, kv_sequences=users,
                         resident=np.ones((c.num_layers, c.num_experts), bool), step_graphs=step_graphs)
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    model.usage = ExpertUsage.for_config(c)
    return model


def _prompts(weights, lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, weights.config.vocab_size, n) for n in lengths]


@pytest.mark.parametrize("target", ["F32", "Q8_0"])
def test_users_decoding_at_once_match_one_by_one(gguf_models, numpy_runtime, reference_kernels, target):
    """Four users (prompts of 250, 9, 70 and 40 tokens: the first passes the 256-key bound on the way) decode 8 tokens
    each, all four in one step graph a step, and each alone: the logits agree within the format's tolerance, the
    batched steps are step graphs (one capture per keys bound: 256, then 512), and the usage record is the same."""
    weights = load_model(gguf_models("small", target)[0])
    prompts, steps = _prompts(weights, (250, 9, 70, 40)), 8

    def decode(together):
        model = _model(weights, numpy_runtime, reference_kernels, len(prompts))
        kvs = [model.new_sequence(512) for _ in prompts]
        logits = [[] for _ in prompts]
        for u, kv in enumerate(kvs):
            logits[u].append(model.forward(Batch([SeqChunk(kv, 0, prompts[u], "last")]))[0])
        captures, paths = numpy_runtime.captures, set()
        for t in range(steps):
            tokens = [np.asarray([TOKENS[(t + 3 * u) % len(TOKENS)]]) for u in range(len(kvs))]
            if together:
                out = model.forward(Batch([SeqChunk(kv, kv.length, tokens[u]) for u, kv in enumerate(kvs)]))
                paths.add(model.runner.last_path)
                for u in range(len(kvs)):
                    logits[u].append(out[u])
            else:
                for u, kv in enumerate(kvs):
                    logits[u].append(model.forward(Batch([SeqChunk(kv, kv.length, tokens[u])]))[0])
                    paths.add(model.runner.last_path)
        return np.array(logits), model, numpy_runtime.captures - captures, paths

    ref, alone, _, alone_paths = decode(False)
    got, together, captures, paths = decode(True)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOLERANCE[target] * scale)
    assert paths == {"step graph"} and alone_paths == {"step graph"}
    graphs = [key for key in together.backend.layer_graphs._regions if key[0] == "step"]
    assert captures == 2 and sorted(key[1:3] for key in graphs) == [(4, 256), (4, 512)]
    for name in ("prefill", "decode", "coactivation"):
        np.testing.assert_array_equal(getattr(together.usage, name), getattr(alone.usage, name), err_msg=name)
    assert together.usage.tokens_decode == 4 * steps


def test_one_graph_serves_each_user_count(gguf_models, numpy_runtime, reference_kernels):
    """Steps of 2, 3, then 2 users again (a third request joins, then leaves) and one user's alone: each token count has
    its own graph, kept while the others run (the 2-user graph is launched again, not captured again), and every
    step's logits are those of its tokens stepped one by one."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    prompts = _prompts(weights, (30, 12, 21), seed=4)
    model = _model(weights, numpy_runtime, reference_kernels, 3)
    ref_model = _model(weights, numpy_runtime, reference_kernels, 3, step_graphs=False)
    kvs, ref_kvs = ([m.new_sequence(512) for _ in prompts] for m in (model, ref_model))
    for m, seqs in ((model, kvs), (ref_model, ref_kvs)):
        for u, kv in enumerate(seqs):
            m.forward(Batch([SeqChunk(kv, 0, prompts[u], "last")]))
    for t, users in enumerate((2, 2, 3, 3, 3, 2, 2, 1, 1, 1)):
        tokens = [np.asarray([TOKENS[(t + u) % len(TOKENS)]]) for u in range(users)]
        got = model.forward(Batch([SeqChunk(kv, kv.length, tokens[u]) for u, kv in enumerate(kvs[:users])]))
        assert model.runner.last_path == "step graph"
        ref = np.array([ref_model.forward(Batch([SeqChunk(kv, kv.length, tokens[u])]))[0]
                        for u, kv in enumerate(ref_kvs[:users])])
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max(), err_msg=f"step {t}")
    steps = {key[1]: graph for key, (_, _, graph) in model.backend.layer_graphs._regions.items() if key[0] == "step"}
    assert sorted(steps) == [1, 2, 3]
    assert steps[2].launches == 3 and steps[3].launches == 2 and steps[1].launches == 2


def test_consecutive_tokens_of_one_sequence_in_one_step(gguf_models, numpy_runtime, reference_kernels):
    """A draft's tokens as one-token chunks of one sequence at consecutive positions (the engine's verification
    batch) in one step graph, beside another user's token: each attends the rows the ones before it wrote, as the
    same tokens stepped one by one."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    prompts = _prompts(weights, (20, 33), seed=5)

    def run(together):
        model = _model(weights, numpy_runtime, reference_kernels, 2)
        a, b = (model.new_sequence(512) for _ in prompts)
        for kv, p in ((a, prompts[0]), (b, prompts[1])):
            model.forward(Batch([SeqChunk(kv, 0, p, "last")]))
        out = []
        for t in range(4):
            start_a, start_b = a.length, b.length
            chunks = [SeqChunk(a, start_a, np.asarray([TOKENS[t]])), SeqChunk(a, start_a + 1, np.asarray([TOKENS[t + 4]])),
                      SeqChunk(b, start_b, np.asarray([TOKENS[t + 8]]))]
            if together:
                out.append(model.forward(Batch(chunks)))
                assert model.runner.last_path == "step graph"
            else:
                out.append(np.concatenate([model.forward(Batch([chunk])) for chunk in chunks]))
        return np.array(out)

    ref, got = run(False), run(True)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("target", ["F32", "Q8_0"])
def test_pairs_grouped_by_expert_match_a_pair_a_tile(gguf_models, numpy_runtime, reference_kernels, target):
    """Five users' steps with their pairs grouped by expert on the device (group_tokens 2: the tiled matmuls, an
    expert's rows once for its pairs) and a pair a tile (group_tokens None): the same logits within the format's
    tolerance, both as step graphs."""
    weights = load_model(gguf_models("small", target)[0])
    prompts = _prompts(weights, (11, 30, 7, 19, 25), seed=6)

    def run(group_tokens):
        model = _model(weights, numpy_runtime, reference_kernels, len(prompts))
        model.backend.device_experts.group_tokens = group_tokens
        kvs = [model.new_sequence(512) for _ in prompts]
        for kv, prompt in zip(kvs, prompts):
            model.forward(Batch([SeqChunk(kv, 0, prompt, "last")]))
        out = []
        for t in range(3):
            out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[t + u]]))
                                            for u, kv in enumerate(kvs)])))
            assert model.runner.last_path == "step graph"
        return np.array(out)

    ref, got = run(None), run(2)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOLERANCE[target] * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("num_pairs,num_experts,resident", [(8, 128, 1.0), (32, 128, 1.0), (128, 128, 0.5),
                                                             (256, 16, 0.7), (64, 8, 0.0)])
def test_decode_groups_against_the_reference(runtime, kernels, reference_kernels, num_pairs, num_experts, resident):
    """moe_parts.cu decode_groups on random routing (experts shared by several pairs, some not resident): order and
    tiles equal the reference's (experts in the order of their first pair, tiles of at most 8 rows)."""
    rng = np.random.default_rng(num_pairs + num_experts)
    ids = rng.integers(0, num_experts, (1, num_pairs)).astype(np.int32)
    slot_map = np.where(rng.random(num_experts) < resident, rng.permutation(num_experts), -1).astype(np.int32)
    order, tiles = np.zeros(num_pairs, np.int32), np.zeros((4, num_pairs), np.int32)
    reference_kernels.decode_groups(ids, slot_map, 8, order, tiles)
    d_order, d_tiles = runtime.zeros((num_pairs,), np.int32), runtime.zeros((4, num_pairs), np.int32)
    kernels.decode_groups(runtime.to_device(ids), runtime.to_device(slot_map), 8, d_order, d_tiles)
    np.testing.assert_array_equal(runtime.to_host(d_order), order)
    np.testing.assert_array_equal(runtime.to_host(d_tiles), tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("size,target", [("small", "F32"), ("small", "Q8_0"), ("kquant", "Q4_K_M")])
def test_users_at_once_on_the_gpu_match_one_by_one(runtime, gguf_models, size, target):
    """On a GPU, with the real kernels: four users' tokens (prompts of 250, 9, 70, 40 tokens, the first passing the
    256-key bound) in one step graph a step give each user's one-token steps' logits within 1e-4 (F32) or 2e-3 of
    their largest, and the CPU engine's within 2e-3; a step of 16 users too, with its pairs grouped by expert
    (GpuExperts.group_tokens 8) and not."""
    from hybrid import LLM

    path, _ = gguf_models(size, target)
    tolerance = 1e-4 if target == "F32" else 2e-3
    cpu = LLM(path, device="cpu", max_context=512)
    prompts = [p.tolist() for p in _prompts(cpu.model.weights, (250, 9, 70, 40))]

    def decode(model, together, steps=6):
        kvs = [model.new_sequence(512) for _ in prompts]
        for kv, p in zip(kvs, prompts):
            model.forward(Batch([SeqChunk(kv, 0, np.asarray(p), "last")]))
        out = []
        for t in range(steps):
            tokens = [np.asarray([TOKENS[(t + 3 * u) % len(TOKENS)]]) for u in range(len(kvs))]
            if together:
                out.append(model.forward(Batch([SeqChunk(kv, kv.length, tokens[u]) for u, kv in enumerate(kvs)])))
                assert model.runner.last_path == "step graph"
            else:
                out.append(np.concatenate([model.forward(Batch([SeqChunk(kv, kv.length, tokens[u])]))
                                           for u, kv in enumerate(kvs)]))
        return np.array(out)

    c = cpu.config
    with LLM(path, device="gpu", max_context=512, kv_sequences=16,
             resident=np.ones((c.num_layers, c.num_experts), bool)) as gpu:
        alone, together = decode(gpu.model, False), decode(gpu.model, True)
        scale = np.abs(alone).max()
        assert np.abs(together - alone).max() <= tolerance * scale
        ref = decode(cpu.model, False)
        assert np.abs(together - ref).max() <= 2e-3 * np.abs(ref).max()
        kvs = [gpu.model.new_sequence(64) for _ in range(16)]
        for u, kv in enumerate(kvs):
            gpu.model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[u:u + 1]), "last")]))
        narrow = np.concatenate([gpu.model.forward(Batch([SeqChunk(kv, 1, np.asarray([TOKENS[-1 - u]]))]))
                                 for u, kv in enumerate(kvs)])
        for group_tokens in (None, 8):
            gpu.model.backend.device_experts.group_tokens = group_tokens
            gpu.model.backend.layer_graphs._regions.clear()  # the step graph queues its launches again
            for kv in kvs:
                kv.truncate(1)
            wide = gpu.model.forward(Batch([SeqChunk(kv, 1, np.asarray([TOKENS[-1 - u]]))
                                            for u, kv in enumerate(kvs)]))
            assert gpu.model.runner.last_path == "step graph"
            assert np.abs(wide - narrow).max() <= tolerance * np.abs(narrow).max(), group_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [256, 1024])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("head_dim", [128, 64, 96])
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_slot_kernels_against_the_reference(runtime, kernels, reference_kernels, kv_dtype, head_dim, window, bound):
    """n one-token sequences, each with its own block table (blocks of the pool scattered) and position below the
    keys bound (256: the short kernel; 1024: paged_attention_1 with key splits and their merge), written and
    attended in one launch each (kv_write slot_table, paged_attention_slots): the pool and the outputs and
    log-sum-exps as the reference kernels' slot by slot (random data, 32 query heads over 4 kv heads; 1, 5 and 16
    slots, two of them one sequence's consecutive positions)."""
    from gpu_kernels.kernels import split_scratch_sizes

    rng = np.random.default_rng(head_dim + window + bound)
    hq, hkv, bt = 32, 4, 16
    nb = bound // bt
    for n in (1, 5, 16):
        num_blocks = n * nb
        pool_shape = (num_blocks, bt, hkv, head_dim)
        k_pool, k_scale = kv_store.encode(rng.standard_normal(pool_shape).astype(np.float32), kv_dtype)
        v_pool, v_scale = kv_store.encode(rng.standard_normal(pool_shape).astype(np.float32), kv_dtype)
        tables = rng.permutation(num_blocks).astype(np.int32).reshape(n, nb)
        positions = rng.integers(0, bound, n).astype(np.int64)
        if n > 1:  # slot 1: slot 0's sequence, the next position
            tables[1], positions[0] = tables[0], min(positions[0], bound - 2)
            positions[1] = positions[0] + 1
        q = rng.standard_normal((n, hq, head_dim)).astype(np.float32)
        k = rng.standard_normal((n, hkv, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, hkv, head_dim)).astype(np.float32)
        scale = head_dim ** -0.5

        ref = {name: None if a is None else a.copy() for name, a in
               dict(k=k_pool, v=v_pool, ks=k_scale, vs=v_scale).items()}
        for t in range(n):
            reference_kernels.kv_write(kv_dtype, k[t:t + 1], ref["k"], ref["ks"], tables[t], int(positions[t]),
                                       second=(v[t:t + 1], ref["v"], ref["vs"]))
        ref_out, ref_lse = np.zeros((n, hq, head_dim), np.float32), np.zeros((n, hq), np.float32)
        for t in range(n):
            reference_kernels.paged_attention(kv_dtype, q[t:t + 1], ref["k"], ref["v"], ref["ks"], ref["vs"],
                                              tables[t], int(positions[t]), 0, scale, ref_out[t:t + 1],
                                              ref_lse[t:t + 1], window=window)

        dev = {name: None if a is None else runtime.to_device(a) for name, a in
               dict(k=k_pool, v=v_pool, ks=k_scale, vs=v_scale).items()}
        d_tables, d_positions = runtime.to_device(tables), runtime.to_device(positions)
        kernels.kv_write(kv_dtype, runtime.to_device(k), dev["k"], dev["ks"], d_tables, 0,
                         start_at=(d_positions, None), second=(runtime.to_device(v), dev["v"], dev["vs"]),
                         slot_table=nb)
        out, lse = runtime.zeros((n, hq, head_dim), np.float32), runtime.zeros((n, hq), np.float32)
        values, rows = split_scratch_sizes(1, hq, hkv, head_dim, bound, kernels.warp, kernels.max_splits,
                                           kernels.attention_rows, kernels.short_attention_keys)
        scratch = None if values == 0 else (runtime.zeros((n * values,), np.float32),
                                            runtime.zeros((n * rows,), np.float32))
        assert (values == 0) == (bound == 256)
        kernels.paged_attention_slots(kv_dtype, runtime.to_device(q), dev["k"], dev["v"], dev["ks"], dev["vs"],
                                      d_tables, d_positions, bound, scale, out, lse, window=window, scratch=scratch)
        for name in ("k", "v", "ks", "vs"):
            if ref[name] is not None:
                np.testing.assert_array_equal(runtime.to_host(dev[name]), ref[name], err_msg=f"{name}, {n} slots")
        got = runtime.to_host(out)
        assert np.abs(got - ref_out).max() <= 1e-5 * np.abs(ref_out).max(), f"{n} slots"
        assert np.abs(runtime.to_host(lse) - ref_lse).max() <= 1e-5 * max(1.0, np.abs(ref_lse).max()), f"{n} slots"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_few_token_matmuls_match_the_one_token_kernel(runtime, kernels, reference_kernels, qtype):
    """A dense matmul of 2 to 16 tokens (matmul.cu matmul_n / matmul_nq: the one-token kernel's rows read once for 4
    tokens) gives each token's row of the one-token kernel within 1e-6 (the same products, x rounded the same way)
    and the reference's within the one-token tolerance, at the decode shapes of the 30B-A3B layer (rows past the
    last block's, a small launch)."""
    from gguf import GGMLQuantizationType as Q

    from gpu_kernels.kernels import takes_int16
    from hybrid.formats.synthetic import encode
    from tests.gpu_kernels.conftest import xq_rounded

    q = Q[qtype]
    rng = np.random.default_rng(int(q))
    int16 = takes_int16(kernels.act_quant, q)
    for rows, cols in ((4608, 2048), (131, 2048), (2048, 4096)):
        raw = encode("w", rng.standard_normal((rows, cols)).astype(np.float32), q, rng).raw  # [R, B]
        d_raw = runtime.to_device(raw)
        for num_tokens in (2, 3, 4, 5, 8, 16):
            x = (rng.standard_normal((num_tokens, cols))
                 * rng.uniform(0.01, 10, (num_tokens, cols // 32)).repeat(32, axis=1)).astype(np.float32)
            out = runtime.zeros((num_tokens, rows), np.float32)
            kernels.matmul(d_raw, q, runtime.to_device(x), out)
            got = runtime.to_host(out)
            one = np.empty_like(got)
            for t in range(num_tokens):
                row = runtime.zeros((1, rows), np.float32)
                kernels.matmul(d_raw, q, runtime.to_device(x[t:t + 1]), row)
                one[t] = runtime.to_host(row)[0]
            assert np.abs(got - one).max() <= 1e-6 * np.abs(one).max(), (rows, cols, num_tokens)
            ref = np.empty_like(got)
            reference_kernels.matmul(raw, q, xq_rounded(x) if int16 else x, ref)
            assert np.abs(got - ref).max() <= (1e-4 if int16 else 1e-5) * np.abs(ref).max(), (rows, cols, num_tokens)
