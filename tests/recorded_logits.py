"""Logits recorded before a refactor, and the check that a runner still gives them.

`tests/data/recorded_logits.npz` holds, per case name, the logits [steps, S, V] of a fixed prompt and
decode schedule, as the engine gave them when the file was written, and the compile target they were
computed on. On that target a runner must give them bit for bit. Numba compiles for the host CPU
(fastmath, its vector width), so on another CPU the results round differently: float models' by ~5e-7
of the largest logit, checked to 1e-5; quantized models' by more, 5e-5 to 2.5e-4 (a Rocket Lake target
against the Zen 4 recordings, the same for every runner of a format: the shared quantized kernels), checked
to 1e-3, half their 2e-3 fidelity tolerance.
RECORD_LOGITS=1 (tests only) writes missing cases instead of checking them.
"""
import json
import os

import numpy as np

PATH = os.path.join(os.path.dirname(__file__), "data", "recorded_logits.npz")
OTHER_TARGET_ATOL = {"float": 1e-5, "quantized": 1e-3}  # of the largest logit
FLOAT_FORMATS = ("F32", "F16", "BF16")


def compile_target():
    """What the kernels were compiled for: the host CPU's name and the features kernels choose by."""
    import llvmlite.binding as ll

    from cpu_kernels.target import _target_features

    return json.dumps({"cpu": ll.get_host_cpu_name(), "features": _target_features()}, sort_keys=True)


def _load():
    if not os.path.exists(PATH):
        return {}
    with np.load(PATH) as data:
        return {k: data[k] for k in data.files}


def check(name, logits):
    """Compare logits with the recorded case `name` (or record it under RECORD_LOGITS=1)."""
    recorded = _load()
    if os.environ.get("RECORD_LOGITS") == "1" and name not in recorded:
        recorded[name] = np.asarray(logits, dtype=np.float32)
        recorded["target:" + name] = np.array(compile_target())
        np.savez_compressed(PATH, **recorded)
        return
    assert name in recorded, f"no recorded logits for {name} in {PATH}"
    want = recorded[name]
    assert logits.shape == want.shape, f"{name}: shape {logits.shape}, recorded {want.shape}"
    if str(recorded["target:" + name]) == compile_target():
        np.testing.assert_array_equal(logits, want, err_msg=name)
    else:
        kind = "float" if name.split("-")[1] in FLOAT_FORMATS else "quantized"
        np.testing.assert_allclose(logits, want, rtol=0, atol=OTHER_TARGET_ATOL[kind] * np.abs(want).max(),
                                   err_msg=name)
