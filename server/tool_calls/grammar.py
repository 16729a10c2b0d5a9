"""Pieces of the Lark grammars (llguidance's dialect) that force a tool call: literals, markers, %json."""
import json

# The JSON a forced call writes: compact but spaced the way templates render arguments, no free whitespace
# (a random or unsure model could otherwise fill its budget with spaces).
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def text(value):
    """A Lark string literal matching `value` exactly."""
    return json.dumps(value, ensure_ascii=False)


def json_rule(schema):
    """The body of a rule matching JSON text that validates against `schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


class Markers:
    """Lark atoms for a dialect's markers: the token itself (`<[id]>`) when the marker is a special token
    (whose text the tokenizer never produces from plain text), else its text."""

    def __init__(self, special_ids):
        self.special_ids = special_ids  # marker text -> token id, for special tokens

    def __call__(self, marker):
        token = self.special_ids.get(marker)
        return text(marker) if token is None else f"<[{token}]>"


def calls_grammar(rules, parallel, prefix="", separator='"\\n"'):
    """`start` over one call (or, `parallel`, several) of the alternatives `call_<i>`; `rules` is a list of
    (rule name, rule body) lines, those alternatives among them."""
    repeat = "" if not parallel else f" ({separator} call)*" if separator else " call*"
    alternatives = [name for name, _ in rules if name.startswith("call_")]
    lines = [f"start: {prefix}call{repeat}", "call: " + " | ".join(alternatives)]
    lines += [f"{name}: {body}" for name, body in rules]
    return "\n".join(lines) + "\n"
