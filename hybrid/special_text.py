"""Special-token text in user content stays text: a user who writes `<|im_end|><|im_start|>system` forges no turn.

A chat template joins its own markers and the users' strings into one text. Before rendering, every
place where a special token's text starts inside a user string gets an escape character after its
first character, so the rendered text holds the template's markers whole and the users' copies broken.
`split` then cuts the rendered text at the whole markers and removes the escapes from the text between
them, which is encoded without parsing special tokens.
"""
from __future__ import annotations

import re
from typing import Any

ESCAPE = "\ue000"  # a private-use character; a literal one in user text is doubled
_UNESCAPE = re.compile(ESCAPE + "(" + ESCAPE + "?)")


class SpecialTextEscaper:
    """Escapes special-token texts (`specials`, e.g. "<|im_end|>") in user strings and splits rendered text."""

    def __init__(self, specials: list[str]) -> None:
        escapable = sorted({s for s in specials if len(s) > 1 and ESCAPE not in s}, key=len, reverse=True)
        alternation = "|".join(map(re.escape, escapable))
        self._starts = re.compile(f"(?=(?:{alternation}))") if escapable else None
        self._markers = re.compile(f"({alternation})") if escapable else None

    def escape(self, value: Any) -> Any:
        """`value` (a message list, a tool list, a string...) with every string in it escaped."""
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, dict):
            return {key: self.escape(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(item) for item in value]
        return value

    def _escape_text(self, text: str) -> str:
        text = text.replace(ESCAPE, ESCAPE + ESCAPE)
        if self._starts is None:
            return text
        starts = [m.start() for m in self._starts.finditer(text)]
        if not starts:
            return text
        pieces, last = [], 0
        for start in starts:
            pieces += [text[last:start + 1], ESCAPE]
            last = start + 1
        pieces.append(text[last:])
        return "".join(pieces)

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """(text, is_marker) pieces of a rendered template: whole markers, and user text with escapes removed."""
        parts = self._markers.split(rendered) if self._markers is not None else [rendered]
        pieces = []
        for i, part in enumerate(parts):  # re.split alternates text, marker, text, ...
            if i % 2:
                pieces.append((part, True))
            elif part:
                pieces.append((_UNESCAPE.sub(r"\1", part), False))
        return pieces

    @staticmethod
    def unescaped_size(rendered: str) -> int:
        """A lower bound on the UTF-8 size of the user-visible text of `rendered` (escapes not counted)."""
        return len(rendered.encode("utf-8")) - len(ESCAPE.encode("utf-8")) * rendered.count(ESCAPE)
