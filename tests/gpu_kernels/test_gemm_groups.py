"""prompt_groups (gpu_kernels/src/prompt_groups.cu): a prompt chunk's pairs grouped by expert on the device, against
its NumPy reference (the host grouping of ExpertSplit's chunks, hybrid/backends/gpu_experts.py's layout) at decode
and prefill sizes, routing skewed as a trained router's, some experts not resident; and the GPU backend's resident
chunk path against the host-grouped one on the CPU stand-in.
Shape legend: T tokens, K experts a token, E experts, N = T * K pairs, W work tiles."""
import numpy as np
import pytest

from cpu_kernels import routing
from gpu_kernels.gemm import MOE_GEMM_TOKENS, group_tiles_bound
from gpu_kernels.kernels import TILE_TOKENS
from hybrid.backends.gpu_experts import work_tiles


def prompt_groups(ids, slot_map, tile_tokens, order, row_of_pair, tiles):
    """The NumPy reference: each resident expert's pairs in pair order, experts in id order (the host grouping),
    rows past them pair 0; tiles past the last (slot 0, row 0, no rows)."""
    flat = np.asarray(ids).reshape(-1)  # [N]
    pairs = np.flatnonzero(slot_map[flat] >= 0)
    rows = pairs[np.argsort(flat[pairs], kind="stable")]  # [N']
    order[:] = 0
    order[:len(rows)] = rows
    row_of_pair[:] = -1
    row_of_pair[rows] = np.arange(len(rows))
    experts, counts = np.unique(flat[rows], return_counts=True)
    t = work_tiles(np.concatenate([[0], np.cumsum(counts)]), slot_map[experts], tile_tokens)  # [3, W']
    tiles[:] = 0
    tiles[:, :t.shape[1]] = t


def skewed_ids(rng, num_tokens, num_experts, k):
    """int32 [T, K]: k distinct experts a token, drawn with Zipf-like popularity (a few experts take most pairs)."""
    logp = -1.2 * np.log1p(rng.permutation(num_experts))  # [E]
    gumbel = -np.log(-np.log(rng.random((num_tokens, num_experts))))
    return np.argsort(-(logp + gumbel), axis=1)[:, :k].astype(np.int32)


def slot_map_of(rng, num_experts, resident_share):
    """int32 [E]: the slots of a random resident_share of the experts (in expert order), -1 for the rest."""
    resident = rng.random(num_experts) < resident_share
    slots = np.full(num_experts, -1, dtype=np.int32)
    slots[resident] = np.arange(resident.sum(), dtype=np.int32)
    return slots


def reference_arrays(ids, slot_map, tile_tokens):
    num_pairs = ids.size
    order, row_of_pair = np.empty(num_pairs, np.int32), np.empty(num_pairs, np.int32)
    tiles = np.empty((3, group_tiles_bound(num_pairs, len(slot_map), tile_tokens)), np.int32)
    prompt_groups(ids, slot_map, tile_tokens, order, row_of_pair, tiles)
    return order, row_of_pair, tiles


@pytest.mark.parametrize("num_tokens", [1, 17, 512])
def test_reference_is_the_host_grouping(num_tokens):
    """Where every expert is resident, the reference gives the rows and tiles of the host's grouping (group_by_expert
    and work_tiles, as submit_groups lays them out)."""
    rng = np.random.default_rng(num_tokens)
    ids = skewed_ids(rng, num_tokens, 128, 8)
    slot_map = rng.permutation(128).astype(np.int32)
    order, row_of_pair, tiles = reference_arrays(ids, slot_map, MOE_GEMM_TOKENS)
    host_order, experts, row_starts = routing.group_by_expert(ids.astype(np.int64), 128)
    host_tiles = work_tiles(row_starts, slot_map[experts], MOE_GEMM_TOKENS)
    np.testing.assert_array_equal(order, host_order)
    np.testing.assert_array_equal(row_of_pair[host_order], np.arange(ids.size))
    np.testing.assert_array_equal(tiles[:, :host_tiles.shape[1]], host_tiles)
    assert not tiles[2, host_tiles.shape[1]:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,k,share,tile_tokens", [
    (1, 128, 8, 1.0, TILE_TOKENS),  # decode size
    (17, 128, 8, 0.5, TILE_TOKENS),
    (512, 128, 8, 1.0, MOE_GEMM_TOKENS),  # a prompt chunk of the Qwen3-30B-A3B shape
    (512, 128, 8, 0.6, MOE_GEMM_TOKENS),
    (512, 512, 10, 1.0, MOE_GEMM_TOKENS),  # Qwen3-Next's experts
    (4096, 128, 8, 1.0, MOE_GEMM_TOKENS),  # a long chunk read alone
    (4096, 128, 8, 0.9, TILE_TOKENS),
])
def test_prompt_groups_matches_reference(runtime, kernels, num_tokens, num_experts, k, share, tile_tokens):
    rng = np.random.default_rng(num_tokens * 7 + num_experts)
    ids = skewed_ids(rng, num_tokens, num_experts, k)
    slot_map = slot_map_of(rng, num_experts, share)
    want = reference_arrays(ids, slot_map, tile_tokens)
    got = [runtime.to_device(np.full(a.shape, -7, np.int32)) for a in want]  # every entry written
    kernels.prompt_groups(runtime.to_device(ids), runtime.to_device(slot_map), tile_tokens, *got)
    for name, w, g in zip(("order", "row_of_pair", "tiles"), want, got):
        np.testing.assert_array_equal(runtime.to_host(g), w, err_msg=name)


def test_tiles_bound_holds():
    """group_tiles_bound is never below the tiles a grouping needs, at the tile sizes the path takes."""
    rng = np.random.default_rng(3)
    for num_tokens in (1, 5, 64, 700):
        for tile_tokens in (TILE_TOKENS, MOE_GEMM_TOKENS):
            ids = skewed_ids(rng, num_tokens, 64, 6)
            _, counts = np.unique(ids, return_counts=True)
            need = int((-(-counts // tile_tokens)).sum())
            assert need <= group_tiles_bound(ids.size, 64, tile_tokens)


def test_resident_chunks_group_on_the_device(gguf_models, numpy_runtime, reference_kernels, monkeypatch):
    """A 40-token chunk with every expert resident: each layer's pairs go through prompt_groups (no routing read
    back), and the logits are the CPU engine's."""
    from hybrid.backends import CpuBackend
    from hybrid.backends.gpu import GpuBackend
    from hybrid.batch import Batch, SeqChunk
    from hybrid.formats import load_model
    from hybrid.model import Model

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    ids = np.random.default_rng(5).integers(1, c.vocab_size, 40)

    def read(model):
        return model.forward(Batch([SeqChunk(model.new_sequence(64), 0, ids, "all")]))

    ref = read(Model(weights, CpuBackend(act_quant="float")))
    backend = GpuBackend(numpy_runtime, max_context=64, resident=np.ones((c.num_layers, c.num_experts), bool))
    backend.kernels = reference_kernels
    grouped = []
    monkeypatch.setattr(reference_kernels, "prompt_groups", lambda *a: grouped.append(a[2]) or prompt_groups(*a),
                        raising=False)
    monkeypatch.setattr(backend, "fetch_routing", lambda *a: pytest.fail("routing read back"))
    got = read(Model(weights, backend, host=CpuBackend(act_quant="float")))
    assert len(grouped) == c.num_layers  # every layer a MoE layer
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
