"""GGUF model files, memory-mapped through gguf-py's reader (nothing is copied at load)."""
import logging
import os
import re

import numpy as np
from gguf import GGUFReader

from ..arch import arch_for_gguf
from ..arch.base import expected_shape, validate_tensors
from ..errors import ModelError
from ..tokenizer import Tokenizer
from .gguf_metadata import gguf_fields_to_dict
from .gguf_split import open_split
from .weights import ModelWeights, QuantTensor

log = logging.getLogger(__name__)

GGUF_VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version, tensor count, metadata count


def _header_problem(path, size):
    """Why the file's fixed header is not a GGUF's we read, in our words; None when it is."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if size == 0:
        return "empty file, not a GGUF model"
    if head[:4] != b"GGUF":
        return f"not a GGUF file (it starts with {head[:4]!r}, a GGUF file with b'GGUF')"
    if size < HEADER_BYTES:
        return f"truncated GGUF file ({size} bytes, shorter than its {HEADER_BYTES}-byte header)"
    version = int.from_bytes(head[4:8], "little")
    if int.from_bytes(head[4:8], "big") in GGUF_VERSIONS:
        return "a big-endian GGUF file; Strata reads little-endian ones"
    if version not in GGUF_VERSIONS:
        return f"GGUF version {version}, Strata reads versions {' and '.join(map(str, GGUF_VERSIONS))}"
    return None


def _reader_problem(exc, size):
    """gguf-py's error on a file whose header was fine, in our words."""
    if isinstance(exc, UnicodeDecodeError):
        return "damaged GGUF metadata: a key or a string is not UTF-8"
    unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
    if unknown:
        return (f"a tensor of unknown GGML type id {unknown[1]} (a type newer than this Strata's gguf package, or a "
                f"damaged file)")
    if "GGUFValueType" in str(exc) or "GGMLQuantizationType" in str(exc):
        return "damaged GGUF metadata: a value or tensor of an unknown type"
    if "alignment" in str(exc):
        return "damaged GGUF metadata: general.alignment is not a uint32 power of two"
    return f"truncated or damaged GGUF file ({size} bytes): its header describes more data than the file holds"


def open_reader(path):
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    size = os.path.getsize(path)
    problem = _header_problem(path, size)
    if problem:
        raise ModelError(f"{path}: {problem}")
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, UnicodeDecodeError) as exc:
        # gguf-py reads past the end of a cut file as short arrays; numpy then fails on them
        raise ModelError(f"{path}: {_reader_problem(exc, size)}") from None


def _quant_tensor(reader_tensor, path):
    qtype = reader_tensor.tensor_type
    shape = tuple(int(d) for d in reversed(reader_tensor.shape.tolist()))
    tensor = QuantTensor(reader_tensor.name, qtype, shape, None)
    raw = np.asarray(reader_tensor.data).view(np.uint8)
    tensor.raw = raw.reshape(*shape[:-1], tensor.row_bytes)
    return tensor


def _tokenizer(fields, path):
    try:
        return Tokenizer.from_gguf_fields(fields, path)
    except ModelError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exceptions on a vocabulary it cannot build
        raise ModelError(f"{path}: damaged tokenizer metadata (the tokenizers library: {exc})") from None


def _check_shapes(config, tensor_files, tensors):
    """A split model's tensor of the wrong shape names its file: a file of another model among the shards."""
    for name, shard_path in tensor_files.items():
        want = expected_shape(name, config)
        if want is not None and tensors[name].shape != want:
            raise ModelError(f"{shard_path}: tensor '{name}' has shape {tensors[name].shape}, expected {want} "
                             f"(a file of another model among the split model's files?)")


def load_gguf(path):
    """A GGUF file, or any file of a split model (every file is read), -> ModelWeights; nothing is copied."""
    path = str(path)
    reader = open_reader(path)
    shards, fields = open_split(path, reader, gguf_fields_to_dict(reader), open_reader, gguf_fields_to_dict)
    path = shards[0][0]
    spec = arch_for_gguf(fields.get("general.architecture"), path)
    tensors, tensor_files = {}, {}
    for shard_path, shard_reader in shards:
        for t in shard_reader.tensors:
            tensors[t.name], tensor_files[t.name] = _quant_tensor(t, shard_path), shard_path
    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path}: missing tensor 'token_embd.weight'")
    config = spec.config_from_gguf(fields, path, vocab_size=tensors["token_embd.weight"].shape[0],
                                   tie_word_embeddings="output.weight" not in tensors, tensor_names=frozenset(tensors))
    if len(shards) > 1:
        _check_shapes(config, tensor_files, tensors)
    validate_tensors(spec, config, tensors, path)
    tokenizer = _tokenizer(fields, path)
    log.info("loaded %s%s: %s, %d layers, %d experts (top-%d), %d tensors, %.1f MiB mapped", path,
             f" (+ {len(shards) - 1} more files)" if len(shards) > 1 else "", spec.name, config.num_layers,
             config.num_experts, config.num_experts_per_tok, len(tensors),
             sum(t.nbytes for t in tensors.values()) / 2**20)
    return ModelWeights(config=config, tensors=tensors, tokenizer=tokenizer, source=path,
                        file_handles=[r for _, r in shards])
