"""Compiles the test suite's decode layers into Numba's cache from a second process while the suite runs.

A cold run of the suite spends most of its time compiling, one function at a time in one process (Numba holds a
compiler lock), so a 2-core CI machine leaves a core idle. tests/conftest.py starts this module in a subprocess for
a suite-sized run: it builds the tests' tiny models (the same recipes and formats, so the same compiled instances)
and decodes a few steps of each at one thread (the compiled layer), at all threads (the fused layer) or on the GPU
stand-in (the host experts' layer), in about the order the suite first needs them. The tests then load those
layers from the cache instead of compiling them; what they check is unchanged, and a layer the warmer has not reached
yet the test compiles itself.

Both processes save to one cache, so each save (read the function's index, write its data file and index) runs
under an exclusive lock on a file they share (lock_cache_saves): two processes saving overloads of one function
at once would otherwise both take data file 1 and one index would name the other's code.

Run: python -m tests.cache_warmer WORK_DIR (models go there; WORK_DIR/numba-save.lock is the lock).
"""
import contextlib
import fcntl
import os
import sys
import traceback
from types import SimpleNamespace

import gguf

LOCK_NAME = "numba-save.lock"
# (family, size, file type, what to decode with) in about the order the suite first compiles them: 1 / "all" the CPU
# engine at one / every thread (the compiled / fused layer), "host" the GPU stand-in with half of the experts on
# the host (the host experts' compiled layer, as tests/gpu_kernels/test_backend_wiring.py runs it)
JOBS = [("qwen3moe", "kquant", "Q4_K_M", ("all", 1)), ("qwen3moe", "small", "Q8_0", ("all", 1)),
        ("qwen3moe", "small", "F16", ("host",)), ("qwen3moe", "small", "BF16", ("host",)),
        ("qwen3moe", "small", "F32", ("host",)), ("qwen3moe", "small", "Q4_0", ("host",)),
        ("qwen3moe", "kquant", "Q5_K", ("host",)),
        ("qwen3moe", "small", "F32", (1,)), ("qwen3moe", "small", "F16", (1, "all")),
        ("qwen3moe", "small", "BF16", (1,)), ("qwen3moe", "small", "Q4_0", (1,)),
        ("qwen3moe", "kquant", "Q5_K", (1,)), ("qwen3moe", "kquant", "Q6_K", (1,)),
        ("experts", "read-only", "Q8_0 Q4_K Q6_K", (1,)),
        ("gpt-oss", "small", "MXFP4_MOE", ("all",)), ("qwen3moe", "small", "F32", ("all",)),
        ("glm4moe", "small", "F32", ("all",))]


def lock_cache_saves(lock_path):
    """Make every Numba cache save of this process hold an exclusive lock on `lock_path` (created if missing)."""
    from numba.core import caching

    save = caching.IndexDataCacheFile.save
    if getattr(save, "locked_by", None) == lock_path:
        return

    def locked_save(self, key, data):
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    locked_save.locked_by = lock_path
    caching.IndexDataCacheFile.save = locked_save


def model_file(family, size, target, directory, tokenizer):
    """A GGUF path of the tests' tiny model of `family` (tests/conftest.py, tests/hybrid/*_models.py)."""
    from tests.conftest import float_tensors, make_hf_model, save_tokenizer_files

    path = os.path.join(directory, f"{family}-{size}-{target}.gguf")
    if family == "glm4moe":
        from tests.hybrid.glm4moe_models import save_glm_hf_dir, write_glm_gguf

        hf_dir = os.path.join(directory, "glm-hf")
        if not os.path.isdir(hf_dir):
            save_glm_hf_dir(hf_dir, tokenizer)
        return write_glm_gguf(hf_dir, path, target)
    if family == "gpt-oss":
        from tests.hybrid.gpt_oss_models import make_gpt_oss_hf_model, write_gpt_oss_gguf

        write_gpt_oss_gguf(make_gpt_oss_hf_model(tokenizer.vocab_size), tokenizer, path, target)
        return path
    import numpy as np

    from hybrid.formats import load_model
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model

    hf_dir = os.path.join(directory, f"hf-{size}")
    if not os.path.isdir(hf_dir):
        make_hf_model(size, tokenizer.vocab_size).save_pretrained(hf_dir)
        save_tokenizer_files(tokenizer, hf_dir)
    weights = load_model(hf_dir)
    tensors = encode_model(float_tensors(weights), target, np.random.default_rng(1))
    write_gguf(path, weights.config, tensors.values(), weights.tokenizer)
    return path


def decode_steps(llm, threads):
    """A short prompt, then two one-token decode steps, at `threads` Numba threads ("all": every thread)."""
    import numba
    import numpy as np

    from hybrid.batch import Batch, SeqChunk

    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS if threads == "all" else threads)
    try:
        kv = llm.model.new_sequence(64)
        llm.model.forward(Batch([SeqChunk(kv, 0, np.array([5, 17, 300], np.int64))]))
        for token in (3, 42):
            llm.model.forward(Batch([SeqChunk(kv, kv.length, np.array([token], np.int64))]))
    finally:
        numba.set_num_threads(before)


def host_decode_steps(path):
    """decode_steps on the GPU stand-in (NumPy arrays, reference kernels) with half of the experts resident."""
    import numpy as np

    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.backends import CpuBackend
    from hybrid.backends.gpu import GpuBackend
    from hybrid.formats import load_model
    from hybrid.model import Model
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(path)
    c = weights.config
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2,
                         resident=np.random.default_rng(3).random((c.num_layers, c.num_experts)) < 0.5)
    backend.kernels = ReferenceKernels()
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    try:
        decode_steps(SimpleNamespace(model=model), 1)
    finally:
        model.close()


def read_only_experts(names):
    """The CPU backend's experts on read-only (file-mapped) weights of each format, as tests/hybrid/
    test_cpu_backend.py runs them."""
    import numba

    from cpu_kernels.formats import format_for
    from tests.hybrid.test_cpu_backend import test_experts_match_format_api

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        for name in names.split():
            test_experts_match_format_api(format_for(getattr(gguf.GGMLQuantizationType, name)), 1, 1)
    finally:
        numba.set_num_threads(before)


def run_job(family, size, target, ways, directory, tokenizer):
    import hybrid

    if family == "experts":
        return read_only_experts(target)
    path = model_file(family, size, target, directory, tokenizer)
    llm = None
    for way in ways:
        if way == "host":
            host_decode_steps(path)
        else:
            llm = llm or hybrid.LLM(path, device="cpu")
            decode_steps(llm, way)


def main(directory):
    lock_cache_saves(os.path.join(directory, LOCK_NAME))
    from hybrid.demo_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    for job in JOBS:
        try:
            run_job(*job, directory, tokenizer)
        except Exception:  # the tests compile what the warmer could not: go on with the next job
            traceback.print_exc()
        print("warmed", *job, flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1])
