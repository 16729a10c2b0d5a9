"""Write Strata models as GGUF files (built on gguf-py's GGUFWriter).

Used by the tests, the benchmarks and the demo model: metadata in llama.cpp's
key names so the file also loads in llama.cpp, tensors streamed one at a time
so a multi-GB model never sits in RAM whole.
"""
import logging

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter

from ..arch import ARCHS
from .gguf_tokenizer import add_tokenizer_to_writer

log = logging.getLogger(__name__)


def _add_hparams(writer, config):
    spec = ARCHS[config.arch]
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.hidden_size)
    if spec.write_gguf_hparams is None:
        writer.add_block_count(config.num_layers)
        writer.add_feed_forward_length(config.moe_intermediate_size)
    else:
        spec.write_gguf_hparams(writer, config)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_weights_norm(config.norm_topk_prob)


def write_gguf(path, config, tensors, tokenizer, name="strata-model", num_files=1):
    """tensors: QuantTensors, or (name, qtype, shape, make_raw) tuples whose raw is built when written.

    num_files > 1: a split model, `<path stem>-00001-of-0000N.gguf` ... beside `path` (gguf-py's split
    writer, as llama.cpp's converter writes them: the metadata in the first file, tensors spread evenly).
    Returns the paths written.
    """
    tensors = list(tensors)
    writer = GGUFWriter(str(path), config.arch, split_max_tensors=-(-len(tensors) // num_files) if num_files > 1 else 0)
    writer.add_name(name)
    _add_hparams(writer, config)
    add_tokenizer_to_writer(writer, tokenizer)
    pending = []
    for t in tensors:
        if hasattr(t, "raw"):
            t = (t.name, t.qtype, t.shape, (lambda raw=t.raw: raw))
        tname, qtype, shape, make_raw = t
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block_size * block_bytes)
        writer.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        pending.append(make_raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for make_raw in pending:
        writer.write_tensor_data(make_raw())
    paths = [str(p) for p in writer.format_shard_names(writer.path)]
    writer.close()
    log.info("wrote %s (%d tensors)", ", ".join(paths), len(pending))
    return paths

