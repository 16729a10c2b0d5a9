"""The in-memory model description that every file format produces."""
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a MoE transformer, independent of the file format."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q, k and v projections
    qk_norm: bool = False  # per-head q/k RMSNorm (where the family makes it optional)
    rotary_dim: int = 0  # dims of each head RoPE rotates (the first ones); 0: the whole head
    first_dense_layers: int = 0  # leading layers with a dense FFN instead of experts
    dense_intermediate_size: int = 0  # their FFN width
    shared_intermediate_size: int = 0  # the shared expert's width; 0: none
    num_expert_groups: int = 1  # group-limited routing: experts in this many groups,
    topk_expert_groups: int = 1  # of which a token's experts come from this many
    routed_scaling_factor: float = 1.0  # routed experts' weights times this
    num_nextn_layers: int = 0  # NextN / MTP layers after the num_layers decoder layers (loaded, not run)
    full_attention_interval: int = 0  # linear-attention models: every this-many-th layer is full attention
    linear_num_key_heads: int = 0  # their linear attention (Gated DeltaNet): q / k heads,
    linear_num_value_heads: int = 0  # v heads,
    linear_key_head_dim: int = 0  # q / k head dim,
    linear_value_head_dim: int = 0  # v head dim,
    linear_conv_kernel: int = 0  # causal conv width
    sliding_window: int = 0  # positions a sliding-window layer attends (gpt-oss: its even layers); 0: none
    rope_scaling: object = None  # hybrid.rope_freqs.YarnScaling, or None: plain RoPE
    layer_types: tuple = ()  # per layer "sliding_attention" / "full_attention" where a file says (HF layer_types)


@dataclass
class QuantTensor:
    """One weight as stored in its file: raw blocks + GGML type + logical shape.

    raw: uint8 [..., R, B], the file's bytes (memory-mapped where the file allows);
    shape: the logical shape [..., R, C] in NumPy order.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple
    raw: np.ndarray

    @property
    def nbytes(self):
        return self.raw.nbytes

    @property
    def row_bytes(self):
        block_size, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block_size * block_bytes


@dataclass
class ModelWeights:
    """A loaded model: config, tensors by canonical (GGUF) name, tokenizer, and where it came from."""

    config: ModelConfig
    tensors: dict
    tokenizer: object
    source: str
    file_handles: list = field(default_factory=list)

    def type_mix(self):
        """The GGML types by their share of the tensor bytes, largest first: 'Q4_K 61 %, Q6_K 38 %, F32 0.4 %'."""
        by_type = {}
        for t in self.tensors.values():
            by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.nbytes
        total = sum(by_type.values()) or 1
        return ", ".join(f"{name} {_percent(100 * nbytes / total)} %"
                         for name, nbytes in sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0])))

    def get(self, name):
        return self.tensors.get(name)

    def __getitem__(self, name):
        return self.tensors[name]


def _percent(value):
    if value >= 1:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 0.1 else "<0.1"
