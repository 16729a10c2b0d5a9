"""Strata's engine: model formats, forward pass, generation."""
from .config import EngineConfig, apply_isa_floor
from .config_file import file_isa_floor

apply_isa_floor(file_isa_floor())  # before the kernel modules are imported: they choose code by the target

from .errors import ModelError, RequestError  # noqa: E402
from .llm import LLM, GenerationOutput  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "GenerationOutput", "ModelError", "RequestError", "SamplingParams"]
