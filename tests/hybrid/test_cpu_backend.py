"""The CPU backend's direct kernel calls (weights checked once, no per-call checks) against the checked
format API, at decode (1 token) and prefill (16+ tokens) sizes, and its copy of file-mapped weights."""
from types import SimpleNamespace

import numpy as np
import pytest

from cpu_kernels import q4_k, q6_k, q8_0
from cpu_kernels.formats import FORMATS
from cpu_kernels.tiles import kernels_of
from hybrid.backends import cpu
from hybrid.backends.cpu import CpuBackend, expert_work_bytes
from hybrid.formats import load_model
from hybrid.formats.weights import QuantTensor

H, F, E, K = 256, 512, 8, 3  # hidden, expert width, experts, top-k (K-quant rows: multiples of 256)
each_format = pytest.mark.parametrize("fmt", [q8_0, q4_k, q6_k], ids=lambda m: m.__name__.rsplit(".", 1)[-1])


def tensor(fmt, name, shape, seed):
    raw = fmt.random_blocks(np.random.default_rng(seed), shape, 0.05)
    raw.setflags(write=False)  # read-only, as memory-mapped GGUF tensors are
    return QuantTensor(name, fmt.QTYPE, shape, raw)


@pytest.fixture(params=[1, "all"], ids=lambda n: f"threads-{n}")
def numba_threads(request):
    """One thread (small decode ops take the serial twins) or every thread (all ops parallel)."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1 if request.param == 1 else numba.config.NUMBA_NUM_THREADS)
    yield numba.get_num_threads()
    numba.set_num_threads(before)


@each_format
@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("rows", [96, 2048])  # with one thread: a serial and a parallel matvec (SERIAL_MAX_WEIGHT_BYTES)
def test_linear_matches_format_api(fmt, num_tokens, rows, numba_threads):
    weight = tensor(fmt, "blk.0.attn_q.weight", (rows, H), 0)
    x = np.random.default_rng(1).standard_normal((num_tokens, H)).astype(np.float32)
    expected = np.empty((num_tokens, rows), dtype=np.float32)
    if num_tokens == 1:
        fmt.matvec(weight.raw, x[0], expected[0])
    else:
        fmt.matmul(weight.raw, x, expected)
    backend = CpuBackend()
    np.testing.assert_array_equal(backend.linear(weight, x), expected)
    np.testing.assert_array_equal(backend.linear(weight, x), expected)  # the cached kernels again
    with pytest.raises(ValueError, match="attn_q"):
        backend.linear(weight, x[:, :-32])


@each_format
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_experts_match_format_api(fmt, num_tokens, numba_threads):
    rng = np.random.default_rng(2)
    gate, up = (tensor(fmt, f"blk.0.ffn_{n}_exps.weight", (E, F, H), s) for s, n in enumerate(("gate", "up")))
    down = tensor(fmt, "blk.0.ffn_down_exps.weight", (E, H, F), 3)
    x = rng.standard_normal((num_tokens, H)).astype(np.float32)
    ids = np.argsort(rng.random((num_tokens, E)), axis=1)[:, :K].astype(np.int64)  # [T, K], distinct per token
    weights = rng.random((num_tokens, K)).astype(np.float32)
    expected = np.zeros((num_tokens, H), dtype=np.float32)
    for t in range(num_tokens):
        for j in range(K):
            e = ids[t, j]
            g, u, d = (np.empty((1, n), dtype=np.float32) for n in (F, F, H))
            fmt.moe_matmul(gate.raw, x[t:t + 1], np.array([e]), np.array([0, 1]), g)
            fmt.moe_matmul(up.raw, x[t:t + 1], np.array([e]), np.array([0, 1]), u)
            h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            fmt.moe_matmul(down.raw, h, np.array([e]), np.array([0, 1]), d)
            expected[t] += weights[t, j] * d[0]
    got = CpuBackend().experts(x, ids, weights, gate, up, down)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max())


def test_expert_work_arrays_are_reused_per_thread_without_changing_results():
    """grouped_experts keeps its intermediates between calls (one set per thread): calls of other sizes in
    between, and another thread's calls at the same time, leave each result as a fresh backend gives it."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    gate, up = (tensor(q4_k, f"blk.0.ffn_{n}_exps.weight", (E, F, H), s) for s, n in enumerate(("gate", "up")))
    down = tensor(q4_k, "blk.0.ffn_down_exps.weight", (E, H, F), 3)

    def inputs(num_tokens):
        x = rng.standard_normal((num_tokens, H)).astype(np.float32)
        ids = np.argsort(rng.random((num_tokens, E)), axis=1)[:, :K].astype(np.int64)
        return x, ids, rng.random((num_tokens, K)).astype(np.float32)

    cases = [inputs(n) for n in (16, 1, 40, 3, 16)]
    expected = [CpuBackend().experts(*c, gate, up, down) for c in cases]  # a fresh backend (fresh arrays) each
    backend = CpuBackend()
    for case, want in zip(cases, expected):
        np.testing.assert_array_equal(backend.experts(*case, gate, up, down), want)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(lambda: [backend.experts(*c, gate, up, down) for c in cases]) for _ in range(2)]
        for run in runs:
            for got, want in zip(run.result(), expected):
                np.testing.assert_array_equal(got, want)
    held = sum(a.nbytes for a in backend._scratch().arrays.values())
    assert held == expert_work_bytes(40, K, H, F)  # the largest call's, as the start-up budget line says


def test_kernels_of_checks_the_raw_once():
    raw = q8_0.random_blocks(np.random.default_rng(0), (E, 64, H), 0.05)
    parallel, serial, cols = kernels_of(q8_0, raw)
    assert cols == H and parallel is not serial
    with pytest.raises(ValueError, match="q8_0"):
        kernels_of(q8_0, raw[..., :-1])
    with pytest.raises(ValueError, match="q8_0"):
        kernels_of(q8_0, raw[0])
    for fmt in FORMATS.values():  # every format registered its kernels
        assert kernels_of(fmt, np.zeros((1, 1, fmt.BLOCK_BYTES), dtype=np.uint8))[2] == fmt.BLOCK_SIZE


def test_place_copies_mapped_weights_unless_memory_is_short(gguf_models, monkeypatch):
    path = gguf_models("kquant", "Q4_K_M")[0]
    weights = load_model(path)
    before = {name: np.array(t.raw) for name, t in weights.tensors.items()}
    CpuBackend().place(SimpleNamespace(weights=weights))
    for name, t in weights.tensors.items():
        assert t.raw.flags.owndata and t.raw.flags.writeable, name
        np.testing.assert_array_equal(t.raw, before[name])
    mapped = load_model(path)
    monkeypatch.setattr(cpu, "COPY_MAX_FREE_SHARE", 0.0)
    CpuBackend().place(SimpleNamespace(weights=mapped))
    assert not any(t.raw.flags.writeable for t in mapped.tensors.values())
