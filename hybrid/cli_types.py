"""argparse `type=` callables that refuse bad values before anything loads.

argparse turns their ArgumentTypeError into one line that names the flag:
"strata serve: error: argument --port: must be in 1..65535, got 99999".
"""
import argparse
import math
import os


def _number(kind, text):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low):
    """An int >= low."""
    def parse(text):
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def float_in(low, high=None, low_open=False):
    """A float in [low, high], or (low, high] with low_open; high None: no upper bound."""
    opening = "(" if low_open else "["
    wanted = (f"{'>' if low_open else '>='} {low:g}" if high is None else f"in {opening}{low:g}, {high:g}]")

    def parse(text):
        value = _number(float, text)
        if (value <= low if low_open else value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse


def port(text):
    value = _number(int, text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return value


def existing_file(text):
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def output_file(text):
    """A file to write: its folder must exist (checked before hours of work produce it)."""
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: no folder {folder} to write it in")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: a folder, not a file name")
    return text


def token_ids(text):
    """Comma-separated token ids (>= 0; the model's vocabulary bounds them once it is loaded)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected token ids >= 0, got {text!r}")
    return ids
