"""Strata's engine: model formats, forward pass, generation."""
from .errors import ModelError, RequestError
from .llm import LLM, GenerationOutput
from .sampling import SamplingParams

__all__ = ["LLM", "GenerationOutput", "ModelError", "RequestError", "SamplingParams"]
