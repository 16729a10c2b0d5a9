"""Architecture families, looked up by GGUF `general.architecture` or HF `model_type`."""
from ..errors import ModelError
from . import glm4moe, gpt_oss, qwen3moe, qwen3next
from .base import SPECS

ARCHS = {spec.name: spec for spec in (qwen3moe.SPEC, glm4moe.SPEC, gpt_oss.SPEC, *qwen3next.SPECS)}
SPECS.update(ARCHS)  # a spec made elsewhere (a test's variant of a family) does not replace these


def arch_for_gguf(name, source):
    if name not in ARCHS:
        raise ModelError(f"{source}: unsupported architecture '{name}' (supported: {', '.join(sorted(ARCHS))})")
    return ARCHS[name]


def arch_for_hf(model_type, source):
    for spec in ARCHS.values():
        if model_type in spec.hf_model_types:
            return spec
    known = sorted(t for spec in ARCHS.values() for t in spec.hf_model_types)
    raise ModelError(f"{source}: unsupported model_type '{model_type}' (supported: {', '.join(known)})")
