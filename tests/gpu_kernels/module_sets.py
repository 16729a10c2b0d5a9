"""Which kernel modules the compile tests build by default: every module but the less common formats' matmuls,
(those without an int16 decode dot), which compile in the slow run (each module costs seconds per chip on a 2-core runner)."""
import pytest

from gpu_kernels.sources import all_modules

SLOW_MODULES = {f"matmul_{name}" for name in ("q2_k", "iq2_xxs", "q4_1", "q5_0", "iq3_xxs", "iq2_xs",
                                              "iq2_s", "iq1_s", "iq1_m")}
MODULES = all_modules()
DEFAULT_MODULES = [m for m in MODULES if m[0] not in SLOW_MODULES]
REST_MODULES = [m for m in MODULES if m[0] in SLOW_MODULES]


def module_params():
    """pytest params (name, kernel names) of every module, the rest marked slow."""
    return [pytest.param(*m, id=m[0], marks=[pytest.mark.slow] if m[0] in SLOW_MODULES else []) for m in MODULES]
