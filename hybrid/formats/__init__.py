"""Model files: GGUF and HF safetensors directories give the same `ModelWeights`."""
import os

from ..errors import ModelError
from .weights import ModelConfig, ModelWeights, QuantTensor

__all__ = ["load_model", "ModelConfig", "ModelWeights", "QuantTensor"]


def load_model(path):
    """A GGUF file or an HF directory -> ModelWeights (weights stay memory-mapped)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from .safetensors_dir import load_safetensors_dir

        return load_safetensors_dir(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file or directory")
    if path.endswith(".safetensors"):
        raise ModelError(f"{path}: give the model's directory (config.json, tokenizer, shards), not one shard")
    from .gguf_file import load_gguf

    return load_gguf(path)
