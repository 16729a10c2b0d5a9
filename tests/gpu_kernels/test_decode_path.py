"""The one-token expert path's own kernels on the GPU: tiles from the device-held routing, and the
expert matmul that skips the tiles of non-resident pairs."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu_kernels.kernels import takes_int16
from hybrid.formats.synthetic import encode

from .conftest import greedy_reference, xq_rounded

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k,num_experts", [(2, 8), (8, 128)])
def test_decode_tiles(runtime, kernels, reference_kernels, k, num_experts):
    rng = np.random.default_rng(k)
    ids = rng.choice(num_experts, size=(1, k), replace=False).astype(np.int32)  # [1, K]
    slot_map = np.full(num_experts, -1, np.int32)  # [E]
    resident = rng.choice(num_experts, size=num_experts // 2, replace=False)
    slot_map[resident] = rng.permutation(len(resident)).astype(np.int32)
    tiles = runtime.zeros((4, k), np.int32)
    kernels.decode_tiles(runtime.to_device(ids), runtime.to_device(slot_map), tiles)
    ref = np.zeros((4, k), np.int32)
    reference_kernels.decode_tiles(ids, slot_map, ref)
    np.testing.assert_array_equal(runtime.to_host(tiles), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_moe_matmul_skips_tiles_without_rows(runtime, kernels, reference_kernels, qtype):
    """count 0 tiles (non-resident pairs) leave their output rows as they were."""
    rng = np.random.default_rng(int(qtype))
    slots, rows, cols, k = 4, 96, 512, 6
    raw = encode("w", rng.standard_normal((slots, rows, cols)).astype(np.float32), qtype, rng).raw  # [S, R, B]
    x = rng.standard_normal((k, cols)).astype(np.float32)  # [K, C]
    tile_slot = np.array([3, 0, 1, 0, 2, 0], np.int32)
    tile_count = np.array([1, 0, 1, 0, 1, 1], np.int32)
    tile_row = np.arange(k, dtype=np.int32)
    before = rng.standard_normal((k, rows)).astype(np.float32)
    out = runtime.to_device(before)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out, runtime.to_device(tile_slot),
                       runtime.to_device(tile_row), runtime.to_device(tile_count), 1)
    ref = before.copy()
    int16 = takes_int16(kernels.act_quant, qtype)  # x as the kernel takes it: rounded to int16, or float
    reference_kernels.moe_matmul(raw, qtype, xq_rounded(x) if int16 else x, ref, tile_slot, tile_row, tile_count)
    got = runtime.to_host(out)
    np.testing.assert_array_equal(got[tile_count == 0], before[tile_count == 0])
    assert np.abs(got - ref).max() / np.abs(ref).max() < (1e-4 if int16 else 1e-5)


def test_add_into(runtime, kernels):
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((3, 1000)).astype(np.float32) for _ in range(2))
    out = runtime.to_device(a)
    kernels.add_into(out, runtime.to_device(b))
    np.testing.assert_array_equal(runtime.to_host(out), a + b)


def test_relay_publish_and_await_through_mapped_memory(runtime, kernels):
    """The decode relay's kernels: publish_decode posts a token's packed routing and row to mapped host memory,
    then its flag; await_host_add waits until the host posts its flag (a thread, 0.1 s later), then adds the
    host rows; with no post it gives up at its timeout, adds nothing and writes (step, layer) to the error."""
    import threading

    from cpu_kernels.mailbox import WAIT_OK, post, ticks, wait_for
    from cpu_kernels.sync import LINE
    from hybrid.relay import Mailbox

    rng = np.random.default_rng(5)
    num_layers, k, hidden, layer, seq = 3, 8, 300, 1, 7
    mb = Mailbox.allocate(num_layers, k, hidden, empty=runtime.pinned_empty)
    a = {name: np.uint64(runtime.mapped_address(getattr(mb, name)))
         for name in ("inbox", "outbox", "flags_in", "flags_out", "error", "times")}
    flag_at, times_at = np.uint64(layer * LINE * 8), np.uint64(layer * 16)
    packed = rng.standard_normal(2 * k + hidden).astype(np.float32)
    kernels.publish_decode(runtime.to_device(packed), a["inbox"] + np.uint64(layer * mb.inbox[0].nbytes),
                           a["flags_in"] + flag_at, runtime.to_device(np.array([seq], np.int64)), a["times"] + times_at)
    never = np.zeros(LINE, np.int64)
    assert wait_for(mb.flags_in, layer * LINE, seq, never, ticks(10)) == WAIT_OK
    np.testing.assert_array_equal(mb.inbox[layer], packed)
    assert not mb.inbox[[0, 2]].any() and mb.times[layer, 0] > 0

    x = rng.standard_normal((1, hidden)).astype(np.float32)
    rows = rng.standard_normal(hidden).astype(np.float32)

    def host_posts():
        mb.outbox[layer] = rows
        post(mb.flags_out, layer * LINE, seq)

    out = runtime.to_device(x)
    timer = threading.Timer(0.1, host_posts)
    timer.start()
    kernels.await_host_add(out, a["outbox"] + np.uint64(layer * mb.outbox[0].nbytes), a["flags_out"] + flag_at,
                           runtime.to_device(np.array([seq], np.int64)), int(10e9), a["error"], layer,
                           a["times"] + times_at)
    np.testing.assert_array_equal(runtime.to_host(out), x + rows)
    timer.join()
    assert mb.error[0] == 0 and mb.times[layer, 1] - mb.times[layer, 0] > 0.05e9  # it waited for the post

    out = runtime.to_device(x)
    kernels.await_host_add(out, a["outbox"] + np.uint64(layer * mb.outbox[0].nbytes), a["flags_out"] + flag_at,
                           runtime.to_device(np.array([seq + 1], np.int64)), int(0.05e9), a["error"], layer,
                           a["times"] + times_at)
    np.testing.assert_array_equal(runtime.to_host(out), x)  # gave up: nothing added
    assert mb.error[:2].tolist() == [seq + 1, layer]


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_decode_relay_matches_the_cpu_engine(runtime, gguf_models, target):
    """Greedy decode with the host experts through the relay gives the CPU engine's tokens at 0 % and 50 %
    resident, its trace has each hybrid layer's timings, and a failing host part fails that request only."""
    from hybrid import LLM

    path, prompt, ref_tokens, masks = greedy_reference(gguf_models, target)
    for name, mask in masks.items():
        gpu = LLM(path, device="gpu", max_context=256, resident=mask)
        split = gpu.model.split
        split.relay.enabled, split.trace = True, []
        assert gpu.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids == ref_tokens, name
        relayed = [t for t in split.trace if t["tokens"] == 1]
        assert len(relayed) == 7 * int((~mask).any(axis=1).sum()), name  # 7 decode steps (the 8th token's
        assert all(t["cpu_s"] > 0 and t["step_s"] > 0 for t in relayed), name  # logits need no step)
        assert split.relay.worker is not None
    host = gpu.model.split.host
    real = host.relay_decode_experts

    def failing(layer, mailbox, *args):
        if mailbox is split.relay.worker.mailbox:
            raise MemoryError("test: no room")
        return real(layer, mailbox, *args)

    host.relay_decode_experts = failing
    with pytest.raises(RuntimeError, match="decode relay: layer"):
        gpu.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    del host.relay_decode_experts
    assert gpu.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids == ref_tokens


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_a_decode_step_of_several_users_through_the_relay_matches_the_cpu_engine(runtime, gguf_models, target):
    """STRATA_DECODE_RELAY_TOKENS's way on a GPU: decode steps of three sequences' tokens, each layer's routing and
    rows posted once for the three, the host grouping their pairs, the device running its resident pairs from its
    own routing: logits within 2e-3 of the CPU engine's at 0, 50 and 100 % resident, and each hybrid layer's
    step relayed as one."""
    from hybrid import LLM
    from hybrid.batch import Batch, SeqChunk

    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    prompts = [[3, 17, 42, 5, 99], [23, 64, 7, 11, 250, 31], [8, 77, 120, 45]]  # each longer than the relayed 3

    def steps(model):
        kvs = [model.new_sequence(64) for _ in prompts]
        for kv, p in zip(kvs, prompts):
            model.forward(Batch([SeqChunk(kv, 0, np.asarray(p), "last")]))
        return np.concatenate([model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([19 + s + u]))
                                                    for u, kv in enumerate(kvs)])) for s in range(3)])

    cpu = LLM(path, device="cpu", max_context=256)
    ref = steps(cpu.model)
    c = cpu.config
    rng = np.random.default_rng(1)
    for name, mask in {"0%": np.zeros((c.num_layers, c.num_experts), bool),
                       "50%": rng.random((c.num_layers, c.num_experts)) < 0.5,
                       "100%": np.ones((c.num_layers, c.num_experts), bool)}.items():
        with LLM(path, device="gpu", max_context=256, kv_sequences=3, resident=mask) as gpu:
            split = gpu.model.split
            split.relay.enabled, split.relay.tokens, split.trace = True, 3, []
            got = steps(gpu.model)
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= 2e-3, f"{name}: rel err {err:.2e}"
            relayed = [t for t in split.trace if t["tokens"] == 3 and t["cpu_s"] > 0]
            assert len(relayed) == 3 * int((~mask).any(axis=1).sum()), name


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_dense_graphs_match_the_default_launches(runtime, gguf_models, target):
    """dense_graphs=True (a decode layer's dense launches as two captured graphs, the default) gives the logits of
    dense_graphs=False (the launches one by one), bit for bit, at 0, 50 and 100 % resident (the relay on), over two
    sequences decoding in turn, and every region of every layer was captured and replayed; at 100 % the whole step
    is one graph, shared by both sequences (its attention's key splits planned for 256 keys: these few keys fall in
    the first)."""
    from hybrid import LLM
    from hybrid.batch import Batch, SeqChunk

    path, _ = gguf_models("small" if target == "Q8_0" else "kquant", target)
    prompts = ([3, 17, 42, 5, 99, 23], [64, 7, 11, 250])
    c = LLM(path, device="cpu", max_context=64).config
    rng = np.random.default_rng(0)
    for name, mask in {"0%": np.zeros((c.num_layers, c.num_experts), bool),
                       "50%": rng.random((c.num_layers, c.num_experts)) < 0.5,
                       "100%": np.ones((c.num_layers, c.num_experts), bool)}.items():
        logits = {}
        for dense in (False, True):
            model = LLM(path, device="gpu", max_context=64, kv_sequences=2, resident=mask, dense_graphs=dense).model
            kvs = [model.new_sequence(64) for _ in prompts]
            out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(p), "last")])) for kv, p in zip(kvs, prompts)]
            last = list(out)  # each sequence's latest logits [1, V]
            for step in range(4):
                for u, kv in enumerate(kvs):
                    last[u] = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([int(np.argmax(last[u]))]))]))
                    out.append(last[u])
            logits[dense] = np.concatenate(out)
            graphs = model.backend.layer_graphs
            whole = dense and name == "100%"  # every expert resident: each sequence's step is one graph
            assert model.runner.last_path == ("step graph" if whole else "graphs" if dense else "plain"), name
            if whole:
                assert [key[0] for key in graphs._regions] == ["step"], name  # one graph serves both sequences
                assert all(graph is not None for _, _, graph in graphs._regions.values()), name
            elif dense:
                assert model.runner.regions() == [("norm", "project"), ("output", "residual_norm", "route")], name
                assert graphs.enabled and len(graphs._regions) == 2 * c.num_layers, name
                assert all(graph is not None for _, _, graph in graphs._regions.values()), name
            model.close()
        np.testing.assert_array_equal(logits[True], logits[False], err_msg=name)
