"""What the decode dots may add to a float32 dot's error: the rounding of x to int16 (act_quant module)."""
import numpy as np
import pytest

def _int16_rounding_bound(x, w_abs, act_quant):
    """[T, R] bound on |x @ W.T - xq @ W.T| for x f32 [T, C] rounded to int16 per 32-value block, |W| f64 [R, C]:
    each value moves by at most half a step, max|x over its block| / 32767 / 2 (0 for the float path)."""
    num_tokens, cols = x.shape
    if act_quant == "float":
        return np.zeros((num_tokens, w_abs.shape[0]))
    block_max = np.abs(x.astype(np.float64)).reshape(num_tokens, cols // 32, 32).max(axis=2)  # [T, C/32]
    half_step = np.repeat(block_max / 32767 / 2, 32, axis=1)  # [T, C]
    return 1.001 * (half_step @ w_abs.T)


@pytest.fixture(params=["float", "int16"])
def act_quant(request):
    """How decode dots multiply (STRATA_ACT_QUANT's values); the int16 kernels run where the target has AVX2."""
    return request.param


@pytest.fixture
def int16_rounding_bound():
    return _int16_rounding_bound
