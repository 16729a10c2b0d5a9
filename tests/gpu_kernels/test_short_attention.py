"""The short-context one-token attention (kv.cu paged_attention_1s: a block a query head, rolled loops) against the
NumPy reference and the one-token kernel it stands in for (paged_attention_1): every KV type, head dims with and
without float4 rows, the host's stage blocks, keys from a prefix on, a sliding window, the log-sum-exp."""
import numpy as np
import pytest

from gpu_kernels.attention_plan import attention_plan
from hybrid import kv_store

from .test_kv_kernels import assert_lse_close, check_paged_attention, make_cache, rel_err

SHORT = 4096  # Kernels.short_attention_keys of these tests: every one-token launch without splits


@pytest.fixture(scope="module")
def short_kernels(runtime):
    from gpu_kernels.kernels import Kernels

    kern = Kernels(runtime)
    kern.short_attention_keys = SHORT
    return kern


def test_the_plan_takes_the_short_kernel_for_one_token_over_few_keys():
    for num_keys in (1, 40, 255):
        plan = attention_plan(1, 8, 4, 128, num_keys, short_keys=256)
        assert plan.kernel == "paged_attention_1s" and plan.num_tiles == 8 and plan.splits == 1
        assert plan.split_keys == num_keys and plan.shared_mem <= 48 << 10
    assert attention_plan(1, 8, 4, 128, 257, short_keys=256).kernel == "paged_attention_1"
    assert attention_plan(2, 8, 4, 128, 40, short_keys=256).kernel == "paged_attention"
    assert attention_plan(1, 8, 4, 256, 40, short_keys=256).kernel == "paged_attention_1s"
    assert attention_plan(1, 8, 4, 130, 40, short_keys=256).kernel != "paged_attention_1s"  # 130: value by value
    assert attention_plan(1, 8, 4, 128, 40, short_keys=0).kernel == "paged_attention_1"  # off


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 30, 256])
@pytest.mark.parametrize("case", [(1, 0, 0, 0, 16), (1, 39, 0, 0, 16), (1, 300, 0, 2, 64), (1, 300, 100, 3, 64)],
                         ids=lambda c: "T{}-s{}-lo{}-st{}-bt{}".format(*c))
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_short_attention_against_the_reference(runtime, short_kernels, reference_kernels, kv_dtype, case, head_dim,
                                               with_lse):
    check_paged_attention(runtime, short_kernels, reference_kernels, kv_dtype, case, head_dim, 4, with_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("start", [7, 40, 500])
def test_short_attention_against_the_one_token_kernel(runtime, kernels, short_kernels, start, window):
    """The 30B-A3B heads (8 a kv head, 4 kv heads, D 128), with and without a sliding window."""
    rng = np.random.default_rng(start + window)
    cache, _, _ = make_cache(rng, "f32", start + 1, 4, 128, 16, 1)
    dev = cache.on(runtime)
    q = runtime.to_device(rng.standard_normal((1, 32, 128)).astype(np.float32))
    outs = []
    for kern in (short_kernels, kernels):
        out, lse = runtime.zeros((1, 32, 128), np.float32), runtime.zeros((1, 32), np.float32)
        kern.paged_attention("f32", q, *dev.args(), start, 0, 128 ** -0.5, out, lse, dev.stage, window=window)
        outs.append((runtime.to_host(out), runtime.to_host(lse)))
    assert rel_err(outs[0][0], outs[1][0]) < 1e-5
    assert_lse_close(outs[0][1], outs[1][1], 1e-6)
