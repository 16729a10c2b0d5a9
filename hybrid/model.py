"""The forward pass: embeddings -> layers (the family's layer recipe, through the model's runner) -> head.

Only calls kernels through a backend. Shape legend: T tokens, H hidden, V vocab.
"""
import logging
from dataclasses import dataclass

import numpy as np

from .arch import ARCHS
from .kv_store import KV_DTYPES
from .moe import ExpertSplit
from .runners import choose_runner
from .weight_formats import dequantize

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    num_experts_per_tok: int
    norm_topk_prob: bool
    attn_norm: np.ndarray  # [H]
    ffn_norm: np.ndarray  # [H]
    attn_q: object
    attn_k: object
    attn_v: object
    attn_output: object
    attn_q_norm: np.ndarray  # [D] or None
    attn_k_norm: np.ndarray
    router: object
    gate_exps: object
    up_exps: object
    down_exps: object


def _layer_weights(weights, index):
    c = weights.config

    def t(suffix):
        return weights.get(f"blk.{index}.{suffix}")

    def vec(suffix):
        tensor = t(suffix)
        return None if tensor is None else np.ascontiguousarray(dequantize(tensor))

    return LayerWeights(
        index=index, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        eps=c.rms_norm_eps, rope_theta=c.rope_theta, num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        attn_norm=vec("attn_norm.weight"), ffn_norm=vec("ffn_norm.weight"),
        attn_q=t("attn_q.weight"), attn_k=t("attn_k.weight"), attn_v=t("attn_v.weight"),
        attn_output=t("attn_output.weight"),
        attn_q_norm=vec("attn_q_norm.weight"), attn_k_norm=vec("attn_k_norm.weight"),
        router=t("ffn_gate_inp.weight"),
        gate_exps=t("ffn_gate_exps.weight"), up_exps=t("ffn_up_exps.weight"), down_exps=t("ffn_down_exps.weight"),
    )


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
        self.layers = [_layer_weights(weights, i) for i in range(self.config.num_layers)]
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
        self.kv_pool = backend.new_kv_pool(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype,
                                           kv_tokens or c.context_length)
        self.usage = None  # an ExpertUsage (hybrid/expert_usage.py) to record each layer's routing
        self.residency = None  # a dynamic expert cache (placement/dynamic.py), told after each step's layers
        self.compiled_decode = compiled_decode  # chooses self.runner

    def close(self):
        """Stop the threads of the hybrid MoE step (its host-experts pool and decode relay worker)."""
        if self.split is not None:
            self.split.close()

    def new_sequence(self, max_tokens=None):
        return self.backend.new_kv(self.kv_pool, max_tokens or self.config.context_length)

    @property
    def compiled_decode(self):
        return self._compiled_decode

    @compiled_decode.setter
    def compiled_decode(self, on):
        """Chooses the runner again: compiled layers or op by op."""
        self._compiled_decode = bool(on)
        self.runner = choose_runner(self.spec.recipe, self.backend, self._compiled_decode, self.split)

    def forward(self, batch):
        """Batch -> logits [len(batch.logit_rows), V]; each chunk's K/V is appended to its cache."""
        for chunk in batch.chunks:
            chunk.kv.reserve(chunk.start + len(chunk.token_ids))
        be, eps = self.backend, self.config.rms_norm_eps
        x = be.embed(self.token_embd, batch.token_ids)  # [T, H]
        if self.usage is not None:
            self.usage.begin(batch)
        if self.split is not None:
            self.split.begin_step()
        x = self.runner.run(self, x, batch)  # [T, H]
        if self.split is not None:
            self.split.wait_host()
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
