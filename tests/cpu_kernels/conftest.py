"""What the integer dots may add to a float32 dot's error: the rounding of x to int16 or int8 per 32 values
(act_quant module for decode, prefill_i16 for prefill)."""
import numpy as np
import pytest

LEVELS = {"int16": 32767, "int8": 127}  # largest quantized |x| of each integer mode


def _act_rounding_bound(x, w_abs, act_quant, levels=None):
    """[T, R] bound on |x @ W.T - xq @ W.T| for x f32 [T, C] rounded per 32-value block, |W| f64 [R, C]: each value
    moves by at most half a step, max|x over its block| / levels / 2 (0 for the float path). The integer dots
    themselves are exact (int32 sums far from overflow), so this is all the integer paths add. Formats without
    an int8 dot run int16 under "int8", which the looser int8 bound covers. `levels` overrides the mode's."""
    num_tokens, cols = x.shape
    if act_quant == "float":
        return np.zeros((num_tokens, w_abs.shape[0]))
    block_max = np.abs(x.astype(np.float64)).reshape(num_tokens, cols // 32, 32).max(axis=2)  # [T, C/32]
    half_step = np.repeat(block_max / (levels or LEVELS[act_quant]) / 2, 32, axis=1)  # [T, C]
    return 1.001 * (half_step @ w_abs.T)


@pytest.fixture(params=["float", "int16", "int8"])
def act_quant(request):
    """How decode dots multiply (STRATA_ACT_QUANT's values); the int16 kernels run where the target has AVX2,
    the int8 ones where it has VNNI (else int16)."""
    return request.param


@pytest.fixture
def act_rounding_bound():
    return _act_rounding_bound


def _prefill_rounding_bound(fmt, x, w_abs, act_quant):
    """The bound of a prefill (several tokens): x rounded to the format's integer-prefill levels wherever the
    decode dots are integer (any act_quant but float; 0 for float formats, which have no integer prefill)."""
    levels = getattr(fmt, "_X_LEVELS", None)
    if levels is None or act_quant == "float":
        return np.zeros((x.shape[0], w_abs.shape[0]))
    return _act_rounding_bound(x, w_abs, "int16", float(levels))


@pytest.fixture
def prefill_rounding_bound():
    return _prefill_rounding_bound
