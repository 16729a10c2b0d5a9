"""The forward pass: embeddings -> layers (the family's layer recipe, through the model's runner) -> head.

Only calls kernels through a backend. Shape legend: T tokens, H hidden, V vocab.
"""
import contextlib
import functools
import logging
from dataclasses import dataclass

import numpy as np

from .arch import ARCHS
from .arch.recipe import ClampedSwiGLU, MoE
from .backends.base import ExpertGLU
from .kv_store import KV_DTYPES
from .moe import ExpertSplit
from .rope_freqs import rope_freqs
from .recurrent_state import RecurrentShape, RecurrentState
from .runners import choose_runner
from .weight_formats import dequantize

log = logging.getLogger(__name__)


def solo_chunk_tokens(model):
    """The prompt tokens a step may read while no slot decodes: the model's backend's solo_chunk_tokens where it has
    them (GpuBackend holding every expert), else None (the step budget)."""
    return getattr(getattr(model, "backend", None), "solo_chunk_tokens", None)


@dataclass
class LayerWeights:
    """One decoder layer's weights (each field filled from the tensor its family declares for it: hybrid/arch/base.py
    LayerTensor.field; None where the layer's recipe has no such part) and the few numbers its parts need."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    num_experts_per_tok: int
    norm_topk_prob: bool
    attn_norm: np.ndarray = None  # [H]
    ffn_norm: np.ndarray = None  # [H]
    attn_q: object = None
    attn_k: object = None
    attn_v: object = None
    attn_output: object = None
    attn_q_norm: np.ndarray = None  # [D] or None
    attn_k_norm: np.ndarray = None
    router: object = None
    gate_exps: object = None
    up_exps: object = None
    down_exps: object = None
    rotary_dim: int = 0  # dims of a head RoPE rotates (the first ones)
    attn_q_bias: np.ndarray = None  # [Hq*D]
    attn_k_bias: np.ndarray = None  # [Hkv*D]
    attn_v_bias: np.ndarray = None  # [Hkv*D]
    router_choice_bias: np.ndarray = None  # [E]: added to the router's scores for the choice only (SigmoidTopK)
    gate_shexp: object = None  # the shared expert [S, H], [S, H], [H, S]
    up_shexp: object = None
    down_shexp: object = None
    ffn_gate: object = None  # a dense FFN [F, H], [F, H], [H, F]
    ffn_up: object = None
    ffn_down: object = None
    shexp_gate: object = None  # the shared expert's gate [1, H] (SharedExpert(gated=True))
    ssm_qkv: object = None  # linear attention (LinearAttention): q, k, v projection [2 Hk Dk + Hv Dv, H]
    ssm_z: object = None  # its output gate's projection [Hv Dv, H]
    ssm_ba: object = None  # beta's and the decay's inputs [2 Hv, H] (joint_ba), else ssm_beta, ssm_alpha [Hv, H]
    ssm_beta: object = None
    ssm_alpha: object = None
    ssm_conv1d: object = None  # the conv's weights [C, W]
    ssm_a: np.ndarray = None  # [Hv]: -exp(A_log)
    ssm_dt_bias: np.ndarray = None  # [Hv]
    ssm_norm: np.ndarray = None  # the gated RMSNorm's weight [Dv]
    ssm_out: object = None  # output projection [H, Hv Dv]
    kv_index: int = None  # the layer's layer in the KV pool (layers with a recurrent state have none), set by Model
    rope_freqs: np.ndarray = None  # RoPE inverse frequencies [R/2] of the rotated dims R (hybrid/rope_freqs.py)
    rope_scale: float = 1.0  # cos / sin times this (YaRN's attention factor)
    attn_output_bias: np.ndarray = None  # [H] (FullAttention(o_bias=True))
    attn_sinks: np.ndarray = None  # [Hq] each head's sink logit (FullAttention(sinks=True))
    router_bias: np.ndarray = None  # [E] added to the router's logits (TopKSoftmax)
    gate_exps_bias: np.ndarray = None  # [E, F] the experts' biases (ClampedSwiGLU)
    up_exps_bias: np.ndarray = None  # [E, F]
    down_exps_bias: np.ndarray = None  # [E, H]
    expert_glu: object = None  # the experts' ExpertGLU (hybrid/backends/base.py) for ClampedSwiGLU, else None

    def dense_weights(self):
        """Every weight but the routed experts' (what a device holds for the layer)."""
        experts = {id(self.gate_exps), id(self.up_exps), id(self.down_exps)}
        return [value for name, value in vars(self).items()
                if name not in LAYER_NUMBERS and value is not None and id(value) not in experts]


LAYER_NUMBERS = frozenset(("index", "num_heads", "num_kv_heads", "head_dim", "eps", "rope_theta",
                           "num_experts_per_tok", "norm_topk_prob", "rotary_dim", "rope_scale",
                           "expert_glu", "kv_index"))


def _layer_weights(weights, index, spec):
    """Layer `index`'s LayerWeights: its tensors `blk.{index}.*` as its recipe declares them, vectors (norms,
    biases) as float32 arrays."""
    c = weights.config
    fields = {}
    for t in spec.layer_tensors(c, index):
        tensor = weights.get(f"blk.{index}.{t.gguf}")
        if tensor is not None and (len(tensor.shape) == 1 or t.gguf.endswith(".bias")):
            tensor = np.ascontiguousarray(dequantize(tensor))
        fields[t.field] = tensor
    ffn = spec.layer_recipe(c, index).ffn.part
    if isinstance(ffn, MoE) and isinstance(ffn.experts, ClampedSwiGLU):
        fields["expert_glu"] = ExpertGLU(ffn.experts.alpha, ffn.experts.limit, fields["gate_exps_bias"],
                                         fields["up_exps_bias"], fields["down_exps_bias"])
    return LayerWeights(
        index=index, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        eps=c.rms_norm_eps, rope_theta=c.rope_theta, num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob, rotary_dim=c.rotary_dim or c.head_dim,
        rope_freqs=rope_table(c)[0], rope_scale=rope_table(c)[1], **fields)


@functools.lru_cache(maxsize=8)
def rope_table(config):
    """(inv_freq float32 [R/2], scale) of a model's RoPE, one array for all its layers."""
    return rope_freqs(config.rope_theta, config.head_dim, config.rotary_dim or None, config.rope_scaling)


def _nextn(weights, spec):
    """The NextN (MTP) layers after the decoder layers, kept for the MTP drafter (speculative/mtp.py): ([LayerWeights]
    of their decoder layer, [{suffix after "nextn.": QuantTensor}] of their own tensors: eh_proj, enorm, hnorm, ...)."""
    c = weights.config
    indices = range(c.num_layers, c.num_layers + c.num_nextn_layers)
    own = [{name.split(".nextn.", 1)[1]: t for name, t in weights.tensors.items() if name.startswith(f"blk.{i}.nextn.")}
           for i in indices]
    return [_layer_weights(weights, i, spec) for i in indices], own


class Model:
    """host: with a device backend, the backend that runs the non-resident experts (hybrid MoE).
    kv_tokens: KV positions the pool is first made for (all sequences together; a host pool grows past it).
    compiled_decode: decode layers as one compiled call each where the backend has them (the CPU's).
    split: the hybrid MoE's SplitSettings (None: the defaults).
    runner: how the layers run (hybrid/runners.py), chosen here."""

    def __init__(self, weights, backend, host=None, kv_dtype="f32", kv_tokens=None, compiled_decode=True,
                 split=None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        self.weights = weights
        self.kv_dtype = kv_dtype
        self.config = weights.config
        self.spec = ARCHS[self.config.arch]
        self.backend = backend
        self.host = host
        self.recurrent_shape = RecurrentShape.of(self.recipes)  # linear-attention layers' state per sequence, or None
        if self.recurrent_shape is not None:
            log.info("recurrent state: %d linear-attention layers, %.1f MiB per sequence (float32, any context; twice "
                     "that with its snapshot)", len(self.recurrent_shape.layers), self.recurrent_shape.nbytes / 2**20)
        self.layers = [_layer_weights(weights, i, self.spec) for i in range(self.config.num_layers)]
        kv_layers = [i for i in range(self.config.num_layers) if self.recurrent_shape is None
                     or i not in self.recurrent_shape.layers]
        for kv_index, i in enumerate(kv_layers):  # the KV pool holds only the layers that attend
            self.layers[i].kv_index = kv_index
        self.num_kv_layers = len(kv_layers)
        self.nextn_layers, self.nextn_tensors = _nextn(weights, self.spec)
        self.token_embd = weights["token_embd.weight"]
        self.output_norm = np.ascontiguousarray(dequantize(weights["output_norm.weight"]))
        tied = self.config.tie_word_embeddings
        self.output = self.token_embd if tied else weights["output.weight"]
        if host is not None:
            host.place(self)  # first: the host's weight copies (CPU experts) are what the device uploads from
        backend.place(self, host)
        self.split = None if host is None else ExpertSplit(host, backend.resident, split)
        if self.split is not None:
            log.info("hybrid MoE: %d of %d experts resident; a decode token's CPU experts %s (decode_relay)",
                     self.split.resident.sum(), self.split.resident.size,
                     "handed over through mapped memory" if self.split.decode_relay else "run by the serving thread")
        c = self.config
        self.kv_pool = backend.new_kv_pool(self.num_kv_layers, c.num_kv_heads, c.head_dim, kv_dtype,
                                           kv_tokens or c.context_length)
        self.usage = None  # an ExpertUsage (hybrid/expert_usage.py) to record each layer's routing
        self.residency = None  # a dynamic expert cache (placement/dynamic.py), told after each step's layers
        self.compiled_decode = compiled_decode  # chooses self.runner

    def close(self):
        """Stop the threads of the hybrid MoE step (its host-experts pool and decode relay worker)."""
        if self.split is not None:
            self.split.close()

    def new_sequence(self, max_tokens=None):
        kv = self.backend.new_kv(self.kv_pool, max_tokens or self.config.context_length)
        if self.recurrent_shape is not None:
            kv.recurrent = RecurrentState(self.recurrent_shape, self.backend)
        return kv

    @property
    def recipes(self):
        """Each layer's LayerRecipe (the family's, read again where a test swaps the spec)."""
        return tuple(self.spec.layer_recipe(self.config, i) for i in range(self.config.num_layers))

    @property
    def compiled_decode(self):
        return self._compiled_decode

    @compiled_decode.setter
    def compiled_decode(self, on):
        """Chooses the runner again: compiled layers or op by op."""
        self._compiled_decode = bool(on)
        self.runner = choose_runner(self.recipes, self.backend, self._compiled_decode, self.split)

    def forward(self, batch):
        """Batch -> logits [len(batch.logit_rows), V]; each chunk's K/V is appended to its cache. Where chunks ask
        for them (SeqChunk.hidden), batch.hidden gets the last layer's output rows (before output_norm) of all
        their positions, float32 [len(batch.hidden_rows), H] on the host."""
        with self.usage.step(batch) if self.usage is not None else contextlib.nullcontext():
            return self._forward_step(batch)

    def _forward_step(self, batch):
        for chunk in batch.chunks:
            chunk.kv.reserve(chunk.start + len(chunk.token_ids))
        be, eps = self.backend, self.config.rms_norm_eps
        x = be.embed(self.token_embd, batch.token_ids)  # [T, H]
        if self.split is not None:
            self.split.begin_step()
        x = self.runner.run(self, x, batch)  # [T, H]
        if self.split is not None:
            self.split.wait_host()
        if len(batch.hidden_rows):
            batch.hidden = be.to_host(be.take_rows(x, batch.hidden_rows))  # [T_hidden, H]
        if len(batch.logit_rows) == 0:
            logits = np.empty((0, self.config.vocab_size), dtype=np.float32)
        else:
            x = be.take_rows(x, batch.logit_rows)  # [T_out, H]
            logits = be.to_host(be.linear(self.output, be.rmsnorm(x, self.output_norm, eps)))  # [T_out, V]
        if self.split is not None:  # after the logits: a relayed step is only done, or known failed, then
            self.split.finish_step(be, self.usage)
        if self.residency is not None:
            self.residency.after_step(self.usage)
        for chunk in batch.chunks:
            chunk.kv.commit(chunk.start + len(chunk.token_ids))
        return logits
