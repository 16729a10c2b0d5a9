"""GGUF metadata as a plain dict: key -> str, int, float, bool or list of them."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..errors import ModelError


def gguf_fields_to_dict(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field of `reader` as plain Python values (GGUF.* header fields included)."""
    source = getattr(reader.data, "filename", None) or "GGUF file"
    return {name: _field_value(field, source) for name, field in reader.fields.items()}


def _field_value(field: Any, source: str) -> Any:
    if not field.types:
        return None
    try:
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] not in (GGUFValueType.STRING,
                                                                             GGUFValueType.ARRAY):
            if not field.data:
                return []
            # Numeric array elements are one-element views, back to back: read them in one go.
            return np.concatenate([field.parts[i] for i in field.data]).tolist()
        return field.contents()
    except UnicodeDecodeError as exc:
        raise ModelError(f"{source}: metadata field {field.name} holds a string that is not UTF-8") from exc
