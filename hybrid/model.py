"""The forward pass: embeddings -> layers (attention block, MoE block) -> head.

Only calls kernels through a backend. Shape legend: T tokens, H hidden, V vocab.
"""
import logging
import os
from dataclasses import dataclass

import numpy as np

from .arch import ARCHS
from .backends.cpu_decode import DecodeStep
from .blocks import attention_block
from .kv_store import KV_DTYPES
from .moe import ExpertSplit, moe_block

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
        return None if tensor is None else np.ascontiguousarray(tensor.dequantize())

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


def compiled_decode_from_env():
    """STRATA_COMPILED_DECODE: 1 (default) runs CPU decode layers as one compiled call each, 0 op by op."""
    value = os.environ.get("STRATA_COMPILED_DECODE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"STRATA_COMPILED_DECODE={value!r}: expected 0 or 1")
    return value == "1"


class Model:
    """host: with a device backend, the backend that runs the non-resident experts (hybrid MoE).
    kv_tokens: KV positions the pool is first made for (all sequences together; a host pool grows past it)."""

    def __init__(self, weights, backend, host=None, kv_dtype="f32", kv_tokens=None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        self.weights = weights
        self.kv_dtype = kv_dtype
        self.config = weights.config
        self.spec = ARCHS[self.config.arch]
        self.backend = backend
        self.layers = [_layer_weights(weights, i) for i in range(self.config.num_layers)]
        self.token_embd = weights["token_embd.weight"]
        self.output_norm = np.ascontiguousarray(weights["output_norm.weight"].dequantize())
        tied = self.config.tie_word_embeddings
        self.output = self.token_embd if tied else weights["output.weight"]
        if host is not None:
            host.place(self)  # first: the host's weight copies (CPU experts) are what the device uploads from
        backend.place(self)
        self.split = None if host is None else ExpertSplit(host, backend.resident)
        if self.split is not None:
            log.info("hybrid MoE: %d of %d experts resident; a decode token's CPU experts %s (STRATA_DECODE_RELAY)",
                     self.split.resident.sum(), self.split.resident.size,
                     "handed over through mapped memory" if self.split.decode_relay else "run by the serving thread")
        c = self.config
        self.kv_pool = backend.new_kv_pool(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype,
                                           kv_tokens or c.context_length)
        self.usage = None  # an ExpertUsage (hybrid/expert_usage.py) to record each layer's routing
        self.residency = None  # a dynamic expert cache (placement/dynamic.py), told after each step's layers
        self.compiled_decode = compiled_decode_from_env()  # decode layers as one compiled call each where possible

    def close(self):
        """Stop the threads of the hybrid MoE step (its host-experts pool and decode relay worker)."""
        if self.split is not None:
            self.split.close()

    def new_sequence(self, max_tokens=None):
        return self.backend.new_kv(self.kv_pool, max_tokens or self.config.context_length)

    def _compiled_decode(self, batch):
        """Whether this step's layers run as one compiled call each (hybrid/backends/cpu_decode.py): a
        backend that has them, no expert split, the layer recipe those calls implement, and a batch of
        one-token chunks whose sequences share one float32 KV pool."""
        pools = {id(c.kv.pool) for c in batch.chunks}
        return (self.compiled_decode and hasattr(self.backend, "decode_layer") and self.split is None
                and len(pools) == 1 and batch.chunks[0].kv.pool.dtype == "f32"
                and self.spec.attention.rope == "neox" and self.spec.moe.gating == "softmax"
                and all(len(c.token_ids) == 1 for c in batch.chunks))

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
        if self._compiled_decode(batch):
            step = DecodeStep(batch)
            for layer in self.layers:
                ids = be.decode_layer(layer, x, step)  # [T, K]
                if self.usage is not None:
                    self.usage.record(layer.index, ids)
        elif hasattr(be, "graphs_decode") and be.graphs_decode(batch):
            x = be.begin_graphed_step(x, batch.positions)  # [1, H], the fixed buffer the layers' graphs read
            for layer in self.layers:
                be.graphed_decode_layer(self.spec, layer, x, batch, eps, self.split, self.usage)
        else:
            for layer in self.layers:
                h = be.rmsnorm(x, layer.attn_norm, eps)
                be.add_into(x, attention_block(be, self.spec.attention, layer, h, batch))
                h = be.rmsnorm(x, layer.ffn_norm, eps)
                be.add_into(x, moe_block(be, self.spec.moe, layer, h, self.split, self.usage))
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
