"""Random JSON schemas for the structured-output tests, small enough that any valid document fits in a few
hundred tokens (strings, arrays and numbers are bounded), so a random-weights model always finishes one."""
import numpy as np

NAMES = ["id", "name", "city", "qty", "price", "tags", "note", "ok", "items", "kind", "when", "level"]


def random_schema(rng, depth=0):
    """One random schema; containers only down to depth 2."""
    kinds = ["string", "pattern", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 2:
        kinds += ["array", "object", "object", "any_of"]
    kind = kinds[rng.integers(len(kinds))]
    return _MAKERS[kind](rng, depth)


def _string(rng, depth):
    low = int(rng.integers(0, 3))
    return {"type": "string", "minLength": low, "maxLength": low + int(rng.integers(1, 8))}


def _pattern(rng, depth):
    return {"type": "string", "pattern": ["^[a-z]{1,6}$", "^[A-Z][0-9]{2}$", "^(red|green|blue)$"][rng.integers(3)]}


def _integer(rng, depth):
    low = int(rng.integers(-50, 50))
    return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 500))}


def _number(rng, depth):
    low = float(rng.integers(-20, 20))
    return {"type": "number", "minimum": low, "maximum": low + float(rng.integers(1, 100))}


def _enum(rng, depth):
    pool = ["a", "bc", "def", 1, 22, True, None, "x y"]
    picks = rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)
    return {"enum": [pool[i] for i in picks]}


def _array(rng, depth):
    low = int(rng.integers(0, 2))
    return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
            "maxItems": low + int(rng.integers(1, 3))}


def _object(rng, depth):
    names = [str(n) for n in rng.choice(NAMES, size=int(rng.integers(1, 4)), replace=False)]
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": required, "additionalProperties": False}


def _any_of(rng, depth):
    return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}


_MAKERS = {
    "string": _string, "pattern": _pattern, "integer": _integer, "number": _number,
    "boolean": lambda rng, depth: {"type": "boolean"}, "null": lambda rng, depth: {"type": "null"},
    "enum": _enum, "const": lambda rng, depth: {"const": ["fixed", 7, False][rng.integers(3)]},
    "array": _array, "object": _object, "any_of": _any_of,
}


def random_schemas(count, seed=0):
    """`count` schemas, each an object at the top (as OpenAI's json_schema response format asks)."""
    rng = np.random.default_rng(seed)
    return [_object(rng, 0) for _ in range(count)]
