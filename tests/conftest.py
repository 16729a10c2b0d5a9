"""Tiny random qwen3moe models for the tests, in real file formats.

A model is made once per session with `transformers` (float32, random weights),
saved as an HF safetensors directory, and turned into GGUF files of each type
with the project's own writer. The reference for a quantized file is
transformers running on the weights that gguf-py dequantizes from that file.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

# a run of this many tests (the suite) starts tests/cache_warmer.py; STRATA_TEST_WARMER=1: any run, 0: none
WARMER_MIN_TESTS = 500
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WARMER = pytest.StashKey()  # the warmer's (process, work directory)


def pytest_collection_finish(session):
    """A suite-sized run compiles the decode layers in a second process too (tests/cache_warmer.py)."""
    wanted = os.environ.get("STRATA_TEST_WARMER")
    if wanted == "0" or (wanted != "1" and len(session.items) < WARMER_MIN_TESTS):
        return
    from tests.cache_warmer import LOCK_NAME, lock_cache_saves

    work = tempfile.mkdtemp(prefix="strata-cache-warmer-")
    lock_cache_saves(os.path.join(work, LOCK_NAME))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    with open(os.path.join(work, "warmer.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.cache_warmer", work], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    session.config.stash[_WARMER] = proc, work


def pytest_sessionfinish(session):
    proc, work = session.config.stash.get(_WARMER, (None, None))
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    elif proc.returncode:  # a warmer that failed only leaves the tests their own compiles: say so
        with open(os.path.join(work, "warmer.log")) as log:
            sys.stderr.write(f"tests/cache_warmer.py exited {proc.returncode}:\n{log.read()[-3000:]}\n")
    proc.wait()
    shutil.rmtree(work, ignore_errors=True)


TINY = {  # not powers of two where the formats allow
    "small": dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  moe_intermediate_size=64, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2),
    # K-quants need rows of whole 256-weight super-blocks
    "kquant": dict(hidden_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   moe_intermediate_size=256, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2),
}


DEMO_MAX_CONTEXT = 256


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory):
    """The built-in demo model (random weights), built into a temporary cache."""
    from hybrid.demo import demo_model_path

    return demo_model_path(str(tmp_path_factory.mktemp("strata-cache")))


@pytest.fixture(scope="session")
def demo_llm(demo_path):
    import hybrid

    return hybrid.LLM(demo_path, max_context=DEMO_MAX_CONTEXT)


@pytest.fixture(scope="session")
def demo_tokenizer():
    from hybrid.demo_tokenizer import build_demo_tokenizer

    return build_demo_tokenizer()


def save_tokenizer_files(tokenizer, directory):
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    config = {"chat_template": tokenizer.chat_template, "add_bos_token": False,
              "eos_token": tokenizer.token_text(tokenizer.eos_id)}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def make_hf_model(size, vocab_size, seed=0, **overrides):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = dict(vocab_size=vocab_size, intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True, max_position_embeddings=1024, rope_theta=10000.0,
                    tie_word_embeddings=False, initializer_range=0.1, rms_norm_eps=1e-6, **TINY[size])
    cfg = Qwen3MoeConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1 so that they are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_dir_factory(tmp_path_factory, demo_tokenizer):
    """(size, **config overrides) -> a fresh HF safetensors directory of that model."""
    def make(size, **overrides):
        directory = str(tmp_path_factory.mktemp(f"hf-{size}"))
        make_hf_model(size, demo_tokenizer.vocab_size, **overrides).save_pretrained(directory)
        save_tokenizer_files(demo_tokenizer, directory)
        return directory

    return make


@pytest.fixture(scope="session")
def hf_dirs(hf_dir_factory):
    """size -> an HF safetensors directory (float32, hub layout, tokenizer files)."""
    return {size: hf_dir_factory(size) for size in TINY}


def float_tensors(weights):
    from hybrid.weight_formats import dequantize

    return {name: dequantize(t) for name, t in weights.tensors.items()}


def write_hf_dir_from_gguf(gguf_path, template_dir, out_dir):
    """The reference model directory: every tensor of the GGUF dequantized by gguf-py, in HF names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    from hybrid.arch import ARCHS
    from hybrid.arch.base import hf_tensor_sources
    from hybrid.formats import load_model

    config = load_model(gguf_path).config
    reader = GGUFReader(gguf_path)
    canonical = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}
    hf = {}
    for name, source in hf_tensor_sources(ARCHS[config.arch], config):
        if isinstance(source, list):
            for e, hf_name in enumerate(source):
                hf[hf_name] = np.ascontiguousarray(canonical[name][e])
        else:
            hf[source] = np.ascontiguousarray(canonical[name])
    os.makedirs(out_dir, exist_ok=True)
    save_file(hf, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for fname in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(template_dir, fname), out_dir)
    return out_dir


@pytest.fixture(scope="session")
def gguf_models(tmp_path_factory, hf_dirs):
    """(size, target type) -> (gguf path, reference HF dir); built on first use."""
    from hybrid.formats import load_model
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model

    cache = {}

    def get(size, target):
        if (size, target) not in cache:
            weights = load_model(hf_dirs[size])
            directory = tmp_path_factory.mktemp(f"gguf-{size}-{target}")
            path = str(directory / f"tiny-{target}.gguf")
            tensors = encode_model(float_tensors(weights), target, np.random.default_rng(1))
            write_gguf(path, weights.config, tensors.values(), weights.tokenizer, name=f"tiny-{size}-{target}")
            cache[size, target] = (path, write_hf_dir_from_gguf(path, hf_dirs[size], str(directory / "ref")))
        return cache[size, target]

    return get


def hf_logits(model_dir, token_ids):
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.fixture
def reference_logits():
    return hf_logits


@pytest.fixture
def reference_greedy():
    def run(model_dir, token_ids, num_tokens):
        import torch
        from transformers import Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=num_tokens,
                                 min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
        return out[0, len(token_ids):].tolist()

    return run


@pytest.fixture(scope="session")
def glm_hf_dir(tmp_path_factory, demo_tokenizer):
    """A tiny random glm4moe HF directory (tests/hybrid/glm4moe_models.py)."""
    from tests.hybrid.glm4moe_models import save_glm_hf_dir

    return save_glm_hf_dir(str(tmp_path_factory.mktemp("glm-hf")), demo_tokenizer)


@pytest.fixture(scope="session")
def glm_files(tmp_path_factory, glm_hf_dir, demo_tokenizer):
    """(target, K-quant sizes?) -> (glm4moe GGUF path with a NextN layer, reference HF directory on its dequantized
    weights); built on first use."""
    from tests.hybrid.glm4moe_models import GLM_KQUANT, reference_dir, save_glm_hf_dir, write_glm_gguf

    cache = {}

    def get(target, kquant=False):
        if (target, kquant) not in cache:
            directory = tmp_path_factory.mktemp(f"glm-{target}")
            hf_dir = save_glm_hf_dir(str(directory / "hf"), demo_tokenizer, **GLM_KQUANT) if kquant else glm_hf_dir
            path = write_glm_gguf(hf_dir, str(directory / f"glm-{target}.gguf"), target)
            cache[target, kquant] = (path, reference_dir(path, hf_dir, str(directory)))
        return cache[target, kquant]

    return get
