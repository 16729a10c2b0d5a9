"""The kernel module of each GGML quant type Strata runs."""
from gguf import GGMLQuantizationType as _Q

from . import (bf16, f16, f32, iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs, iq4_nl, iq4_xs, mxfp4, q2_k,
               q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0, tq2_0)

FORMATS = {m.QTYPE: m for m in (f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, iq4_xs, q3_k, q2_k,
                                mxfp4, q4_1, q5_0, q5_1, iq4_nl, tq2_0, iq3_s, iq2_xxs, iq3_xxs,
                                iq2_xs, iq2_s, iq1_s, iq1_m)}


def format_for(qtype):
    """The kernel module of a GGML quant type; KeyError if Strata has none."""
    return FORMATS[_Q(qtype)]


def is_supported(qtype):
    try:
        return _Q(qtype) in FORMATS
    except ValueError:
        return False
