"""Strata's engine: model formats, forward pass, generation."""
from .config import EngineConfig, apply_isa_floor

apply_isa_floor()  # before the kernel modules are imported: they choose code by the compile target

from .errors import ModelError, RequestError  # noqa: E402
from .llm import LLM, GenerationOutput  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "GenerationOutput", "ModelError", "RequestError", "SamplingParams"]
