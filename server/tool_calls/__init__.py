"""Tool-call and reasoning dialects: which one a model writes (from its chat template), its output parser
and the grammar that forces a call in it."""
from dataclasses import dataclass
from typing import Callable

from . import glm45, harmony, hermes
from .base import THINK_CLOSE, THINK_OPEN, Parsed, ToolCall, new_call_id
from .blocks import BlockParser
from .grammar import Markers

__all__ = ["Dialect", "Markers", "Parsed", "ToolCall", "dialect_for", "new_call_id"]


@dataclass(frozen=True)
class Dialect:
    """`parser(tools, thinking)`: a fresh output parser (tools: name -> parameters schema; thinking: the
    prompt opened a reasoning block); `grammar(tools, parallel, marker, thinking)`: Lark text forcing a
    call (None: the dialect has no calls); `markers`: the special-token texts its parser must see."""

    name: str
    markers: tuple
    parser: Callable
    grammar: Callable | None = None

    def thinking(self, prompt):
        """Whether the rendered prompt leaves the model inside a reasoning block."""
        return self.name != "harmony" and prompt.rstrip().endswith(THINK_OPEN)


def _plain_parser(tools, thinking):
    return BlockParser({}, thinking, None, None, None)


DIALECTS = {
    "hermes": Dialect("hermes", hermes.MARKERS, hermes.parser, hermes.grammar),
    "glm45": Dialect("glm45", glm45.MARKERS, glm45.parser, glm45.grammar),
    "harmony": Dialect("harmony", harmony.MARKERS, harmony.parser, harmony.grammar),
    "plain": Dialect("plain", (THINK_OPEN, THINK_CLOSE), _plain_parser),
}


def dialect_for(template):
    """The dialect a chat template writes calls in, told by the markers it renders (as llama.cpp does)."""
    template = template or ""
    if "<|channel|>" in template:
        return DIALECTS["harmony"]
    if "<arg_key>" in template:
        return DIALECTS["glm45"]
    if "<tool_call>" in template:
        return DIALECTS["hermes"]
    return DIALECTS["plain"]
