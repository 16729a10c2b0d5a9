"""Per-GPU memory budgets: what is left for experts after dense weights, KV, scratch and reserve.

With several GPUs, GPU g holds a contiguous range of layers (their dense weights, KV and
experts); the token embedding counts on the first GPU, the output head on the last.
"""
from dataclasses import dataclass

import numpy as np

MIB = 1 << 20
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0}  # per K or V element; int8 adds a f16 scale per head row
PREFILL_CHUNK = 512  # tokens of activations the scratch must hold (hybrid.llm.PREFILL_CHUNK)
WORKSPACE_BYTES = 64 * MIB  # kernel workspaces and the expert staging buffers


class BudgetError(ValueError):
    """A GPU cannot hold what the plan needs; the message gives the numbers."""


@dataclass(frozen=True)
class ModelSizes:
    """The byte sizes the planner needs (one entry per layer)."""

    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    expert_bytes: tuple  # bytes of one expert (gate + up + down) per layer
    layer_dense_bytes: tuple  # attention, norms, router, shared expert and dense FFN per layer (resident)
    embed_bytes: int
    head_bytes: int  # output norm + output projection (0 extra when tied: it reads the embedding)
    kv_heads: int
    head_dim: int
    hidden_size: int
    moe_intermediate_size: int
    vocab_size: int
    layer_kv: tuple = ()  # per layer: whether it keeps KV (linear-attention layers keep a fixed state); (): all
    layer_state_bytes: tuple = ()  # per layer: a sequence's recurrent state and its snapshot (linear attention), else 0

    def kv_layers(self, layers):
        """How many of `layers` (indices) keep KV."""
        return sum(self.layer_kv[i] for i in layers) if self.layer_kv else len(layers)

    def state_bytes(self, layers):
        """One sequence's recurrent state in `layers` (indices)."""
        return sum(self.layer_state_bytes[i] for i in layers) if self.layer_state_bytes else 0

    @classmethod
    def from_weights(cls, weights):
        c = weights.config
        expert, dense = np.zeros(c.num_layers, np.int64), np.zeros(c.num_layers, np.int64)
        for name, tensor in weights.tensors.items():
            if not name.startswith("blk."):
                continue
            index = int(name.split(".")[1])
            if index >= c.num_layers:  # NextN (MTP) layers: kept, not run
                continue
            if "_exps." in name:
                expert[index] += tensor.nbytes // c.num_experts
            else:
                dense[index] += tensor.nbytes
        head = weights["output_norm.weight"].nbytes
        if not c.tie_word_embeddings:
            head += weights["output.weight"].nbytes
        return cls(c.num_layers, c.num_experts, c.num_experts_per_tok, tuple(int(b) for b in expert),
                   tuple(int(b) for b in dense), int(weights["token_embd.weight"].nbytes), int(head),
                   c.num_kv_heads, c.head_dim, c.hidden_size, c.moe_intermediate_size, c.vocab_size,
                   *_layer_memory(c))

    def kv_bytes_per_token(self, kv_dtype):
        """K and V of one token in one layer."""
        if kv_dtype not in KV_BYTES:
            raise ValueError(f"--kv: unknown KV cache type {kv_dtype!r} (choose from {', '.join(KV_BYTES)})")
        scale = 2 if kv_dtype == "int8" else 0
        return int(2 * self.kv_heads * (self.head_dim * KV_BYTES[kv_dtype] + scale))

    def scratch_bytes(self, num_slots):
        """Activations of one prefill chunk (float32) + logits of every slot + workspaces."""
        per_token = 8 * self.hidden_size + 3 * self.num_experts_per_tok * self.moe_intermediate_size + self.num_experts
        return int(4 * (PREFILL_CHUNK * per_token + num_slots * self.vocab_size) + WORKSPACE_BYTES)


@dataclass(frozen=True)
class GpuBudget:
    """The plan's memory budget of one GPU, in bytes, for layers [first_layer, last_layer)."""

    gpu: int
    total: int
    reserve: int
    dense: int
    kv: int
    scratch: int
    first_layer: int
    last_layer: int
    slot_bytes: int  # one expert-cache slot: the largest expert among its layers

    @property
    def free(self):
        return self.total - self.reserve - self.dense - self.kv - self.scratch

    @property
    def expert_slots(self):
        return max(self.free, 0) // self.slot_bytes if self.slot_bytes else 0

    def describe(self):
        def mib(b):
            return f"{b / MIB:.0f} MiB"

        return (f"GPU {self.gpu} (layers {self.first_layer}-{self.last_layer - 1}): {mib(self.total)} = dense "
                f"{mib(self.dense)} + KV {mib(self.kv)} + scratch {mib(self.scratch)} + reserve {mib(self.reserve)}"
                f" + experts {mib(self.expert_slots * self.slot_bytes)} ({self.expert_slots} slots of "
                f"{mib(self.slot_bytes)})")

    def to_json(self):
        return {"total_mib": self.total / MIB, "reserve_mib": self.reserve / MIB, "dense_mib": self.dense / MIB,
                "kv_mib": self.kv / MIB, "scratch_mib": self.scratch / MIB, "expert_slots": self.expert_slots,
                "slot_mib": self.slot_bytes / MIB}


def _layer_memory(config):
    """(layer_kv, layer_state_bytes) of a model's layers: linear-attention layers keep a recurrent state, no KV."""
    from hybrid.arch import ARCHS
    from hybrid.recurrent_state import RecurrentShape

    recipes = [ARCHS[config.arch].layer_recipe(config, i) for i in range(config.num_layers)]
    shape = RecurrentShape.of(recipes)
    if shape is None:
        return (), ()
    per_layer = shape.slot_bytes // len(shape.layers)
    return (tuple(i not in shape.layers for i in range(config.num_layers)),
            tuple(per_layer if i in shape.layers else 0 for i in range(config.num_layers)))


def gpu_budget(sizes, gpu, num_gpus, total_bytes, layers, num_slots, max_context, kv_dtype, reserve_bytes,
               kv_resident=None):
    """The budget of GPU `gpu` of `num_gpus` holding `layers` (a range); with kv_resident, each slot keeps
    only that window of its KV in VRAM (the engine's --kv-resident)."""
    from hybrid.kv_cache import BLOCK_TOKENS, vram_blocks

    dense = sum(sizes.layer_dense_bytes[i] for i in layers)
    dense += sizes.embed_bytes if gpu == 0 else 0
    dense += sizes.head_bytes if gpu == num_gpus - 1 else 0
    kv_tokens = max_context if kv_resident is None else vram_blocks(max_context, kv_resident) * BLOCK_TOKENS
    kv = num_slots * (kv_tokens * sizes.kv_layers(layers) * sizes.kv_bytes_per_token(kv_dtype)
                      + sizes.state_bytes(layers))
    slot = max((sizes.expert_bytes[i] for i in layers), default=0)
    return GpuBudget(gpu, int(total_bytes), int(reserve_bytes), int(dense), int(kv), sizes.scratch_bytes(num_slots),
                     layers.start, layers.stop, int(slot))


def check_fits(budget, num_slots, max_context, kv_dtype):
    """Raises BudgetError with the numbers when the GPU cannot hold its dense weights, KV and scratch."""
    if budget.free >= 0:
        return
    need = budget.total - budget.free
    raise BudgetError(
        f"GPU {budget.gpu}: {budget.total / MIB:.0f} MiB cannot hold layers {budget.first_layer}-"
        f"{budget.last_layer - 1}: dense weights {budget.dense / MIB:.0f} MiB + KV {budget.kv / MIB:.0f} MiB "
        f"({num_slots} slots x {max_context} tokens, {kv_dtype}) + scratch {budget.scratch / MIB:.0f} MiB + reserve "
        f"{budget.reserve / MIB:.0f} MiB = {need / MIB:.0f} MiB; lower --parallel or --max-context, use --kv int8, "
        f"lower --vram-reserve-mib, or add a GPU")
