"""The built-in demo model: a small qwen3moe with RANDOM weights and a real BPE tokenizer.

It exists so that `strata generate` / `strata serve` work on a fresh machine
without a download. Its text is gibberish by construction. Generated once and
cached under the cache_dir setting (STRATA_CACHE_DIR, default ~/.cache/strata).
"""
import logging
import os

import numpy as np

from .arch.base import expected_shape
from .arch.qwen3moe import SPEC
from .formats.gguf_writer import write_gguf
from .formats.synthetic import encode_model
from .formats.weights import ModelConfig

log = logging.getLogger(__name__)

DEMO_NAME = "strata-demo-qwen3moe-RANDOM-WEIGHTS"
DEMO_VERSION = 1
DEMO_QTYPE = "Q8_0"


def demo_config(vocab_size):
    return ModelConfig(
        arch="qwen3moe", vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, rope_theta=1e6,
        rms_norm_eps=1e-6, context_length=4096, norm_topk_prob=True, tie_word_embeddings=False,
    )


def default_cache_dir():
    return os.path.join(os.path.expanduser("~"), ".cache", "strata")


def random_float_tensors(config, rng):
    """Every tensor of `config` as random float32: norms near 1, matrices ~N(0, 1/C)."""
    tensors = {}
    for name in SPEC.required_tensor_names(config):
        shape = expected_shape(name, config)
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return tensors


def demo_model_path(cache_dir=None):
    """The cached demo GGUF in `cache_dir` (None: default_cache_dir()), built on first use."""
    path = os.path.join(cache_dir or default_cache_dir(), f"{DEMO_NAME}-v{DEMO_VERSION}-{DEMO_QTYPE}.gguf")
    if os.path.isfile(path):
        return path
    from .demo_tokenizer import build_demo_tokenizer

    log.warning("building the demo model (random weights, not a real language model) at %s", path)
    tokenizer = build_demo_tokenizer()
    config = demo_config(tokenizer.vocab_size)
    rng = np.random.default_rng(DEMO_VERSION)
    tensors = encode_model(random_float_tensors(config, rng), DEMO_QTYPE, rng)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    write_gguf(tmp, config, tensors.values(), tokenizer, name=DEMO_NAME)
    os.replace(tmp, path)
    return path
