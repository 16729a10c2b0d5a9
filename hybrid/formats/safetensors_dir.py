"""HF safetensors model directories (config.json + one or more shards), memory-mapped.

The header is parsed here rather than through the safetensors package because
its NumPy frontend has no bfloat16, the dtype of most released MoE checkpoints.
Expert tensors come one per expert in the hub layout; they are stacked into the
canonical [E, R, B] tensors (a copy, made once at load).
"""
import json
import logging
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType

from ..arch import arch_for_hf
from ..arch.base import hf_tensor_sources, validate_tensors
from ..errors import ModelError
from ..tokenizer import Tokenizer
from .weights import ModelWeights, QuantTensor

log = logging.getLogger(__name__)

DTYPES = {
    "F32": (GGMLQuantizationType.F32, 4),
    "F16": (GGMLQuantizationType.F16, 2),
    "BF16": (GGMLQuantizationType.BF16, 2),
}


class Shard:
    """One .safetensors file: its header and a read-only map of its bytes."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise ValueError(f"header length {header_len} exceeds the file")
                self.header = json.loads(f.read(header_len))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ModelError(f"{path}: not a valid safetensors file ({exc})") from None
        if not isinstance(self.header, dict):
            raise ModelError(f"{path}: not a valid safetensors file (its header is not a JSON object)")
        self.header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.map = np.memmap(path, dtype=np.uint8, mode="r") if size > self.data_start else np.empty(0, np.uint8)

    def tensor(self, name):
        entry = self.header[name]
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise ModelError(f"{self.path}: tensor '{name}' lacks its dtype, shape or data offsets")
        dtype = entry.get("dtype")
        if dtype not in DTYPES:
            raise ModelError(f"{self.path}: tensor '{name}' has dtype {dtype}, which Strata does not support "
                             f"(supported: {', '.join(DTYPES)})")
        qtype, itemsize = DTYPES[dtype]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (self.data_start + int(o) for o in entry["data_offsets"])
        if end > self.map.size or end - begin != int(np.prod(shape)) * itemsize:
            raise ModelError(f"{self.path}: tensor '{name}' data [{begin}, {end}) is truncated or inconsistent "
                             f"with its shape {shape}")
        raw = np.asarray(self.map[begin:end]).reshape(*shape[:-1], shape[-1] * itemsize)
        return QuantTensor(name, qtype, shape, raw)


def _shard_files(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted(set(weight_map.values()))
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelError(f"{directory}: no .safetensors files")
    return files


def _read_config(directory):
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ModelError(f"{directory}: not a model directory (no config.json; a GGUF model is given as its file)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: malformed JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object of model settings, got a {type(config).__name__}")
    return config


def _stack_experts(name, parts, source):
    first = parts[0]
    for part in parts[1:]:
        if part.qtype != first.qtype or part.shape != first.shape:
            raise ModelError(f"{source}: expert tensors of '{name}' differ in dtype or shape "
                             f"({part.name}: {part.shape} vs {first.shape})")
    raw = np.stack([p.raw for p in parts])  # [E, R, B]
    return QuantTensor(name, first.qtype, (len(parts), *first.shape), raw)


def load_safetensors_dir(directory):
    directory = str(directory)
    cfg = _read_config(directory)
    source = os.path.join(directory, "config.json")
    spec = arch_for_hf(cfg.get("model_type"), source)
    config = spec.config_from_hf(cfg, source)
    shards = []
    for fname in _shard_files(directory):
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            raise ModelError(f"{path}: shard named in the index is missing")
        shards.append(Shard(path))
    located = {name: shard for shard in shards for name in shard.header}
    if spec.fit_to_tensors is not None:
        config = spec.fit_to_tensors(config, located)

    def fetch(hf_name, canonical):
        if hf_name not in located:
            raise ModelError(f"{directory}: missing tensor '{hf_name}' (needed for '{canonical}')")
        return located[hf_name].tensor(hf_name)

    tensors = {} if spec.hf_tensors is None else spec.hf_tensors(lambda name: fetch(name, name), config, spec,
                                                                 directory)
    for canonical, hf in hf_tensor_sources(spec, config) if spec.hf_tensors is None else ():
        if isinstance(hf, list):
            tensors[canonical] = _stack_experts(canonical, [fetch(n, canonical) for n in hf], directory)
        else:
            tensor = fetch(hf, canonical)
            tensor.name = canonical
            tensors[canonical] = tensor
    validate_tensors(spec, config, tensors, directory)
    tokenizer = Tokenizer.from_hf_dir(directory)
    log.info("loaded %s: %s, %d layers, %d experts (top-%d)", directory, spec.name, config.num_layers,
             config.num_experts, config.num_experts_per_tok)
    return ModelWeights(config=config, tensors=tensors, tokenizer=tokenizer, source=directory,
                        file_handles=[s.map for s in shards])
