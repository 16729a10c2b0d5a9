"""The MTP / NextN drafter (hybrid/speculative/mtp.py) on tiny random glm4moe (NextN), qwen3next and qwen35moe (MTP)
files: the layer against transformers' decoder layer of the family (one-layer model fed the published input
projection, computed here in NumPy), the drafter's incremental KV against one built at once, and greedy decoding
with MTP drafts equal to plain greedy decoding (1 and 4 slots, CPU and the stand-in GPU backend)."""
import dataclasses

import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.speculative import SpecSettings
from hybrid.speculative.mtp import MtpDrafter, MtpHead
from hybrid.weight_formats import dequantize
from tests.hybrid.test_speculative import serve_ids

MTP = SpecSettings(k=4, ngram=3, min_p=0.0, mtp=True)
PROMPTS = [[3, 17, 42, 5, 3, 17, 42, 5, 3, 17], [99, 23, 64, 99, 23, 64, 99], [7, 11, 250, 31, 8, 7, 11], [2, 45, 2]]
FAMILIES = ["glm4moe", "qwen3next", "qwen35moe"]
SLOW = pytest.mark.slow
# the default suite runs glm4moe (its file is built for other tests too) at 4 slots; the rest is slow
FAMILY_CASES = ["glm4moe", pytest.param("qwen3next", marks=SLOW), pytest.param("qwen35moe", marks=SLOW)]
SLOT_CASES = [pytest.param(1, marks=SLOW), 4]


@pytest.fixture(scope="module")
def mtp_files(glm_files, tmp_path_factory, demo_tokenizer):
    """family -> an F32 GGUF path with one random NextN / MTP layer; built on first use."""
    from tests.conftest import save_tokenizer_files
    from tests.hybrid.qwen3next_models import make_hf_model, save_hf_dir, write_qwen3next_gguf

    cache = {}

    def get(family):
        if family not in cache:
            if family == "glm4moe":
                cache[family] = glm_files("F32")[0]
            else:
                directory = tmp_path_factory.mktemp(family)
                hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, qwen35=family == "qwen35moe"),
                                     str(directory / "hf"), save_tokenizer_files, demo_tokenizer)
                cache[family] = str(directory / f"{family}.gguf")
                write_qwen3next_gguf(hf_dir, cache[family], "F32", demo_tokenizer, mtp=True)
        return cache[family]

    return get


def _rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _floats(weights):
    return {name: dequantize(t).astype(np.float32) for name, t in weights.tensors.items()}


def one_layer_reference(weights, vocab_size):
    """transformers' model of one decoder layer holding the MTP layer's weights, its final norm shared_head_norm and
    its head the model's: fed the MTP input projection as inputs_embeds, it runs the layer over its positions."""
    import torch

    c, floats = weights.config, _floats(weights)
    mtp = f"blk.{c.num_layers}."
    canonical = {name.replace(mtp, "blk.0.", 1): x for name, x in floats.items() if name.startswith(mtp)}
    canonical.update({"token_embd.weight": floats["token_embd.weight"], "output.weight": floats["output.weight"],
                      "output_norm.weight": floats[mtp + "nextn.shared_head_norm.weight"]})
    if c.arch == "glm4moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        from hybrid.arch import ARCHS
        from hybrid.arch.base import hf_tensor_sources
        from tests.hybrid.glm4moe_models import GLM_TINY

        one = dataclasses.replace(c, num_layers=1, first_dense_layers=0, num_nextn_layers=0)
        state = {source: canonical[name] for name, source in hf_tensor_sources(ARCHS[c.arch], one)
                 if not isinstance(source, list)}  # the experts stacked as transformers holds them:
        state["model.layers.0.mlp.experts.gate_up_proj"] = np.concatenate(
            [canonical["blk.0.ffn_gate_exps.weight"], canonical["blk.0.ffn_up_exps.weight"]], axis=1)
        state["model.layers.0.mlp.experts.down_proj"] = canonical["blk.0.ffn_down_exps.weight"]
        model = Glm4MoeForCausalLM(Glm4MoeConfig(vocab_size=vocab_size, **{**GLM_TINY, "num_hidden_layers": 1,
                                                                          "first_k_dense_replace": 0}))
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    else:
        from tests.hybrid.qwen3next_models import TINY, _classes, hf_state_dict

        one = dataclasses.replace(c, num_layers=1, layer_types=("full_attention",), num_nextn_layers=0)
        config_class, model_class = _classes(c.arch == "qwen35moe")
        model = model_class(config_class(vocab_size=vocab_size, **{**TINY, "num_hidden_layers": 1,
                                                                   "layer_types": ["full_attention"]}))
        state = hf_state_dict(canonical, one)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def reference_logits(weights, vocab_size, token_ids, hidden):
    """Logits [n, V] and the layer's output before / after shared_head_norm [n, H] of the MTP layer over positions
    0..n-1 with inputs x_{p+1} = token_ids[p], h_p = hidden[p], in transformers float32."""
    import torch

    c, floats = weights.config, _floats(weights)
    own = {k.split(".nextn.", 1)[1]: v for k, v in floats.items() if k.startswith(f"blk.{c.num_layers}.nextn.")}
    e = _rmsnorm(floats["token_embd.weight"][token_ids], own["enorm.weight"], c.rms_norm_eps)
    h = _rmsnorm(hidden, own["hnorm.weight"], c.rms_norm_eps)
    z = np.concatenate([e, h], axis=1) @ own["eh_proj.weight"].T  # [n, H]
    model, seen = one_layer_reference(weights, vocab_size), {}
    model.model.layers[0].register_forward_hook(lambda m, i, o: seen.update(pre=o[0] if isinstance(o, tuple) else o))
    model.model.norm.register_forward_hook(lambda m, i, o: seen.update(post=o))
    with torch.no_grad():
        logits = model(inputs_embeds=torch.from_numpy(z[None].astype(np.float32))).logits[0].numpy()
    return logits, seen["pre"][0].numpy(), seen["post"][0].numpy()


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_mtp_layer_matches_transformers(mtp_files, family):
    """Five positions read as one chunk, then one chained draft position (the drafted token, the layer's own output
    as its hidden row: pre-norm for glm4moe, normed for qwen3next / qwen35moe) attending over them."""
    weights = load_model(mtp_files(family))
    model = Model(weights, CpuBackend(act_quant="float"))
    head, rng = MtpHead(model), np.random.default_rng(0)
    tokens, hidden = rng.integers(3, 900, 5), rng.standard_normal((5, weights.config.hidden_size)).astype(np.float32)
    kv = head.new_sequence(64)
    first, g = head.run(kv, 0, tokens, hidden)
    draft = int(np.argmax(first))
    chained, _ = head.run(kv, 5, [draft], g)
    ref, pre, post = reference_logits(weights, weights.config.vocab_size, list(tokens), hidden)
    np.testing.assert_allclose(first, ref[-1], rtol=0, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(g[0], (post if head.chain_normed else pre)[-1], rtol=0, atol=1e-4 * np.abs(pre).max())
    ref2, _, _ = reference_logits(weights, weights.config.vocab_size, list(tokens) + [draft],
                                  np.concatenate([hidden, g]))
    np.testing.assert_allclose(chained, ref2[-1], rtol=0, atol=1e-4 * np.abs(ref2).max())


@SLOW
def test_drafter_fed_step_by_step_drafts_as_one_fed_at_once(mtp_files):
    """A drafter that sees a prompt, then verification steps (hidden rows of rejected drafts included, rewritten
    later), drafts what one that reads the verified text at once drafts: its KV holds each verified position once."""
    weights = load_model(mtp_files("glm4moe"))
    model = Model(weights, CpuBackend(act_quant="float"))
    head, rng = MtpHead(model), np.random.default_rng(1)
    tokens, h = rng.integers(3, 900, 16).tolist(), rng.standard_normal((16, weights.config.hidden_size), np.float32)
    stepwise = MtpDrafter(head)
    stepwise.extend(tokens[:7])
    stepwise.add_hidden(0, h[:6])
    stepwise.draft(3)
    at = 6
    for accepted in (2, 0, 3):  # a verification chunk of 4 positions [at - 1 ... ): `accepted` drafts kept
        stale = rng.standard_normal((4, h.shape[1])).astype(np.float32)
        stale[:accepted + 1] = h[at:at + accepted + 1]
        stepwise.add_hidden(at, stale)
        stepwise.extend(tokens[at + 1:at + accepted + 2])
        got = stepwise.draft(3)
        at += accepted + 1
        fresh = MtpDrafter(head)
        fresh.extend(tokens[:at + 1])
        fresh.add_hidden(0, h[:at])
        assert got == fresh.draft(3) and len(got) == 3
        assert stepwise.kv.length == fresh.kv.length == at
    restored = MtpDrafter(head)  # a prompt prefix of 5 positions restored from a cache: no hidden rows for them
    restored.extend(tokens[:at + 1])
    restored.add_hidden(5, h[5:at])
    shifted = MtpDrafter(head)  # the same text without that prefix: RoPE attention sees the same distances
    shifted.extend(tokens[5:at + 1])
    shifted.add_hidden(0, h[5:at])
    assert restored.draft(3) == shifted.draft(3) and restored.kv.length == at - 5


def _engine_ids(model, tokenizer, num_slots):
    plain, _ = serve_ids(model, tokenizer, PROMPTS, num_slots, None, max_tokens=16)
    drafted, stats = serve_ids(model, tokenizer, PROMPTS, num_slots, MTP, max_tokens=16)
    return plain, drafted, stats


@pytest.mark.parametrize("num_slots", SLOT_CASES)
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_greedy_with_mtp_drafts_equals_plain_greedy(mtp_files, family, num_slots):
    weights = load_model(mtp_files(family))
    model = Model(weights, CpuBackend(act_quant="float"))
    plain, drafted, stats = _engine_ids(model, weights.tokenizer, num_slots)
    assert drafted == plain and stats.draft_n > 0


@pytest.mark.parametrize("num_slots", SLOT_CASES)
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_greedy_with_mtp_drafts_on_the_stand_in_gpu_equals_plain_greedy(mtp_files, family, num_slots):
    """Half of the experts resident: the hidden rows come from the device, the MTP layer runs on the host backend."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.backends.gpu import GpuBackend
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(mtp_files(family))
    c = weights.config
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=4,
                         resident=np.random.default_rng(0).random((c.num_layers, c.num_experts)) < 0.5)
    backend.kernels = ReferenceKernels()
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    try:
        plain, drafted, stats = _engine_ids(model, weights.tokenizer, num_slots)
    finally:
        model.close()
    assert drafted == plain and stats.draft_n > 0


def test_hidden_rows_are_the_last_layer_output_before_the_norm(mtp_files):
    """Model.forward's hidden rows: rmsnorm(rows) @ output.T gives the chunk's logits."""
    weights = load_model(mtp_files("glm4moe"))
    model = Model(weights, CpuBackend(act_quant="float"))
    batch = Batch([SeqChunk(model.new_sequence(64), 0, np.array([5, 6, 7, 8]), "all", hidden=True)])
    logits = model.forward(batch)
    floats = _floats(weights)
    ref = _rmsnorm(batch.hidden, floats["output_norm.weight"], weights.config.rms_norm_eps) @ floats["output.weight"].T
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


@SLOW
def test_qwen3moe_file_with_a_nextn_layer(tmp_path, hf_dirs):
    """A qwen3moe GGUF may carry a NextN layer (as bench/train_mtp.py writes one for tiny-code-moe): block_count
    counts it, the decoder layers score as without it, the MTP layer (DeepSeek form: chains on its pre-norm output)
    drafts, and greedy decoding with its drafts is plain greedy decoding."""
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model
    from tests.conftest import float_tensors

    weights = load_model(hf_dirs["small"])
    c = dataclasses.replace(weights.config, num_nextn_layers=1)
    last, rng = c.num_layers - 1, np.random.default_rng(4)
    floats = float_tensors(weights)
    extra = {k.replace(f"blk.{last}.", f"blk.{c.num_layers}.", 1): v for k, v in floats.items()
             if k.startswith(f"blk.{last}.")}
    extra[f"blk.{c.num_layers}.nextn.eh_proj.weight"] = 0.1 * rng.standard_normal((c.hidden_size, 2 * c.hidden_size))
    extra.update({f"blk.{c.num_layers}.nextn.{n}.weight": 1 + 0.1 * rng.standard_normal(c.hidden_size)
                  for n in ("enorm", "hnorm", "shared_head_norm")})
    tensors = encode_model({**floats, **{k: v.astype(np.float32) for k, v in extra.items()}}, "F32", rng)
    path = str(tmp_path / "qwen3moe-nextn.gguf")
    write_gguf(path, c, tensors.values(), weights.tokenizer)
    loaded = load_model(path)
    assert loaded.config.num_layers == weights.config.num_layers and loaded.config.num_nextn_layers == 1
    model = Model(loaded, CpuBackend(act_quant="float"))
    plain = Model(weights, CpuBackend(act_quant="float"))
    batch = [Batch([SeqChunk(m.new_sequence(64), 0, np.array(PROMPTS[0]), "all")]) for m in (model, plain)]
    np.testing.assert_allclose(model.forward(batch[0]), plain.forward(batch[1]), rtol=0, atol=1e-5)
    assert not MtpHead(model).chain_normed
    drafted, plain_ids, stats = _engine_ids(model, loaded.tokenizer, 2)
    assert drafted == plain_ids and stats.draft_n > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_mtp_drafts_on_the_gpu_equals_plain_greedy(mtp_files, family):
    """Real kernels, half of the experts resident, 4 slots; float x (a verification chunk multiplies as a prompt
    chunk does, a plain int16-x decode step would differ from it by rounding alone)."""
    from gpu_kernels.runtime import probe
    from hybrid import LLM

    if probe().runtime is None:
        pytest.skip("no GPU")
    path = mtp_files(family)
    c = load_model(path).config
    llm = LLM(path, device="gpu", max_context=256, act_quant="float", kv_sequences=4,
              resident=np.random.default_rng(0).random((c.num_layers, c.num_experts)) < 0.5)
    plain, drafted, stats = _engine_ids(llm.model, llm.tokenizer, 4)
    assert drafted == plain and stats.draft_n > 0


def test_mtp_setting_on_a_model_without_an_mtp_layer_drafts_ngrams(demo_llm, caplog):
    """--mtp with a file that has no NextN / MTP layer: a warning, and the slots draft by n-gram lookup."""
    from hybrid.engine import Engine

    with caplog.at_level("WARNING"):
        engine = Engine(demo_llm, num_slots=1, speculation=MTP)
    assert engine.mtp is None and "no MTP / NextN layer" in caplog.text
    engine.stop()
