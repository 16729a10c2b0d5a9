"""The value parsers of EngineConfig's settings (hybrid/config.py): each turns text (a flag, a `STRATA_*`
variable) or a given value (a keyword, a config-file value) into the setting's value, or raises
argparse.ArgumentTypeError saying what was expected. argparse uses them as `type=` callables, so a bad flag
is one line naming it; nothing heavy is imported here.
"""
import argparse
import math
import os


def _fail(message):
    raise argparse.ArgumentTypeError(message)


def integer(low, high=None):
    """An int in [low, high] (high None: no bound), from text or an int."""
    def parse(value):
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                _fail(f"expected an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            _fail(f"expected an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            _fail(f"must be >= {low}, got {value}" if high is None else f"must be in {low}..{high}, got {value}")
        return value

    return parse


def checkpoint_interval(value):
    """A positive multiple of 64 (the KV block's positions): a recurrent-state checkpoint interval in tokens."""
    value = integer(64)(value)
    if value % 64:
        _fail(f"must be a multiple of 64, got {value}")
    return value


def number(low, high=None, low_open=False):
    """A finite float in [low, high] or (low, high] with low_open; high None: no upper bound."""
    opening = "(" if low_open else "["
    wanted = (f"{'>' if low_open else '>='} {low:g}" if high is None else f"in {opening}{low:g}, {high:g}]")

    def parse(value):
        text = value
        try:
            value = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            _fail(f"expected a number, got {text!r}")
        if isinstance(text, bool) or not math.isfinite(value):
            _fail(f"expected a finite number, got {text!r}")
        if (value <= low if low_open else value < low) or (high is not None and value > high):
            _fail(f"must be {wanted}, got {text}")
        return value

    return parse


def mib_or_auto(value):
    """MiB >= 0, or "auto" (None)."""
    if value is None or value == "auto":
        return None
    try:
        return number(0)(value)
    except argparse.ArgumentTypeError as exc:
        if "expected" in str(exc):
            _fail(f"expected a number of MiB or 'auto', got {value!r}")
        raise


def switch(value):
    """A bool, from 1 / 0 (the environment) or True / False."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return value.strip() == "1"
    _fail(f"expected 0 or 1, got {value!r}")


class choice:
    """One of `choices`; fold: case and surrounding blanks do not matter."""

    def __init__(self, *choices, fold=False):
        self.choices, self.fold = choices, fold

    def __call__(self, value):
        key = value.strip().lower() if self.fold and isinstance(value, str) else value
        if key not in self.choices:
            _fail(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return key


def text(value):
    if not isinstance(value, str):
        _fail(f"expected text, got {value!r}")
    return value


def existing_file(value):
    if not os.path.isfile(text(value)):
        _fail(f"{value}: no such file")
    return value


def output_file(value):
    """A file to write: its folder must exist (checked before hours of work produce it)."""
    folder = os.path.dirname(text(value)) or "."
    if not os.path.isdir(folder):
        _fail(f"{value}: no folder {folder} to write it in")
    if os.path.isdir(value):
        _fail(f"{value}: a folder, not a file name")
    return value


def _items(value):
    """The items of comma-separated text, a list or one number."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def gpu_mib(value):
    """MiB per GPU: "24000,24000", [24000, 24000] or 24000 -> a tuple of floats > 0."""
    try:
        values = tuple(float(v) for v in _items(value) if not isinstance(v, bool))
    except (TypeError, ValueError):
        values = ()
    if not values or len(values) != len(_items(value)):
        _fail(f"expected MiB per GPU, comma-separated (e.g. 24000,24000), got {value!r}")
    if any(not (v > 0 and math.isfinite(v)) for v in values):
        _fail(f"every GPU needs a positive size, got {value!r}")
    return values


def layer_split(value):
    """"auto", or the first layer of each GPU after the first: "24", [24] or 24 -> (24,)."""
    if value == "auto":
        return "auto"
    items = _items(value)
    try:
        split = tuple(integer(1)(v) for v in items)
    except argparse.ArgumentTypeError:
        split = ()
    if not split:
        _fail(f"expected auto or layer indices (e.g. 24), got {value!r}")
    return split


def gpu_list(value):
    """GPU indices: "0,1", [0, 1] or 0 -> a tuple of ints >= 0; an index given twice is one GPU presented as two
    logical devices (hybrid/devices.py)."""
    items = _items(value)
    try:
        gpus = tuple(integer(0)(v) for v in items)
    except argparse.ArgumentTypeError:
        gpus = ()
    if not gpus:
        _fail(f"expected GPU indices, comma-separated (e.g. 0,1), got {value!r}")
    return gpus


def count_or_auto(value):
    """An int >= 1, or "auto" (kept as "auto")."""
    if value == "auto":
        return "auto"
    try:
        return integer(1)(value)
    except argparse.ArgumentTypeError:
        _fail(f"expected a number >= 1 or 'auto', got {value!r}")
