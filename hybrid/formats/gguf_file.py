"""GGUF model files, memory-mapped through gguf-py's reader (nothing is copied at load)."""
import logging
import os

import numpy as np
from gguf import GGUFReader

from ..arch import arch_for_gguf
from ..arch.base import validate_tensors
from ..errors import ModelError
from ..tokenizer import Tokenizer
from .gguf_metadata import gguf_fields_to_dict
from .weights import ModelWeights, QuantTensor

log = logging.getLogger(__name__)


def open_reader(path):
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    try:
        return GGUFReader(path, "r")
    except ValueError as exc:
        if "reshape" in str(exc) or "buffer" in str(exc):
            size = os.path.getsize(path)
            raise ModelError(f"{path}: truncated GGUF file ({size} bytes; tensor data runs past the end)") from None
        raise ModelError(f"{path}: not a valid GGUF file ({exc})") from None
    except (OSError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from None


def _quant_tensor(reader_tensor, path):
    import cpu_kernels

    qtype = reader_tensor.tensor_type
    if not cpu_kernels.is_supported(qtype):
        supported = ", ".join(sorted(q.name for q in cpu_kernels.FORMATS))
        raise ModelError(f"{path}: tensor '{reader_tensor.name}' has type {qtype.name}, "
                         f"which Strata does not support (supported: {supported})")
    shape = tuple(int(d) for d in reversed(reader_tensor.shape.tolist()))
    tensor = QuantTensor(reader_tensor.name, qtype, shape, None)
    raw = np.asarray(reader_tensor.data).view(np.uint8)
    tensor.raw = raw.reshape(*shape[:-1], tensor.row_bytes)
    return tensor


def load_gguf(path):
    path = str(path)
    reader = open_reader(path)
    fields = gguf_fields_to_dict(reader)
    spec = arch_for_gguf(fields.get("general.architecture"), path)
    tensors = {t.name: _quant_tensor(t, path) for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path}: missing tensor 'token_embd.weight'")
    config = spec.config_from_gguf(fields, path, vocab_size=tensors["token_embd.weight"].shape[0],
                                   tie_word_embeddings="output.weight" not in tensors)
    validate_tensors(spec, config, tensors, path)
    tokenizer = Tokenizer.from_gguf_fields(fields, path)
    log.info("loaded %s: %s, %d layers, %d experts (top-%d), %d tensors, %.1f MiB mapped",
             path, spec.name, config.num_layers, config.num_experts, config.num_experts_per_tok,
             len(tensors), sum(t.nbytes for t in tensors.values()) / 2**20)
    return ModelWeights(config=config, tensors=tensors, tokenizer=tokenizer, source=path,
                        file_handles=[reader])
