"""Start-up: warm_up compiles what the loaded model needs and everything a first request reaches; a second
start compiles nothing (every kernel comes from Numba's cache)."""
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba.core import sigutils
from numba.core.dispatcher import Dispatcher

import hybrid
from cpu_kernels.formats import FORMATS, format_for
from hybrid.backends.cpu import SERIAL_MAX_ELEMENTS, TINY_MAX_ELEMENTS
from hybrid.batch import Batch, SeqChunk
from hybrid.warm_up import long_chunk_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMAT_MODULES = {m.__name__ for m in FORMATS.values()} | {"cpu_kernels.kquant"}


@pytest.fixture
def new_signatures(monkeypatch):
    """(module, function) of every signature a Numba dispatcher adds while the test runs, compiled or loaded
    from the cache."""
    added = []
    compile_signature = Dispatcher.compile

    def spy(self, sig):
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) not in self.overloads:
            added.append((self.py_func.__module__, self.py_func.__qualname__))
        return compile_signature(self, sig)

    monkeypatch.setattr(Dispatcher, "compile", spy)
    return added


def test_warm_up_takes_the_model_formats_only_and_leaves_nothing_to_a_request(gguf_models, new_signatures):
    path, _ = gguf_models("small", "Q8_0")
    llm = hybrid.LLM(path, device="cpu")
    llm.warm_up(progress=False)
    model_formats = {format_for(t.qtype).__name__ for t in llm.weights.tensors.values()}
    assert model_formats == {"cpu_kernels.q8_0", "cpu_kernels.f32"}
    assert {module for module, _ in new_signatures} & FORMAT_MODULES <= model_formats
    new_signatures.clear()
    llm.generate(list(range(1, 38)), max_tokens=4, temperature=0.0)  # the 37-token prompt of issue 31
    model = llm.model
    first, second = model.new_sequence(64), model.new_sequence(64)
    model.forward(Batch([SeqChunk(first, 0, np.arange(24, dtype=np.int64))]))
    model.forward(Batch([SeqChunk(first, 24, np.ones(1, dtype=np.int64)),
                         SeqChunk(second, 0, np.arange(30, dtype=np.int64))]))  # a decode beside a prompt chunk
    model.forward(Batch([SeqChunk(first, 25, np.ones(1, dtype=np.int64)),
                         SeqChunk(second, 30, np.ones(1, dtype=np.int64))]))  # two sequences decoding
    assert new_signatures == []


def test_long_chunk_makes_every_op_parallel_within_a_step(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    llm = hybrid.LLM(path, device="cpu")
    backend, config = llm.model.backend, llm.config
    wanted = backend.parallel_min_tokens(config)
    elementwise = SERIAL_MAX_ELEMENTS if numba.get_num_threads() == 1 else TINY_MAX_ELEMENTS
    assert wanted == elementwise // config.num_experts + 1  # the routing logits [T, E] are the smallest op a token
    assert long_chunk_tokens(backend, config, 4096, 8192) == wanted
    assert long_chunk_tokens(backend, config, 512, 8192) == 512  # never past a step's budget
    assert long_chunk_tokens(backend, config, 512, 100) == 50  # nor half the context


WARM_UP = "import logging, sys, hybrid; logging.basicConfig(level=logging.INFO); " \
          "hybrid.LLM(sys.argv[1], device='cpu').warm_up(progress=False)"


def _cache_files():
    roots = [os.environ["NUMBA_CACHE_DIR"]] if os.environ.get("NUMBA_CACHE_DIR") else \
        [os.path.join(ROOT, d) for d in ("cpu_kernels", "hybrid")]
    return sorted(os.path.join(d, f) for root in roots for d, _, files in os.walk(root) for f in files
                  if f.endswith((".nbi", ".nbc")))


def test_a_second_start_compiles_nothing(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    subprocess.run([sys.executable, "-c", WARM_UP, path], cwd=ROOT, check=True, capture_output=True)
    before = _cache_files()
    second = subprocess.run([sys.executable, "-c", WARM_UP, path], cwd=ROOT, check=True, capture_output=True,
                            text=True)
    assert re.search(r"warm-up: 0 kernels compiled", second.stderr), second.stderr[-2000:]
    assert _cache_files() == before  # a kernel missed in the cache would be saved again as a new file
