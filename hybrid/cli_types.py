"""argparse `type=` callables that refuse bad values before anything loads.

argparse turns their ArgumentTypeError into one line that names the flag:
"strata serve: error: argument --port: must be in 1..65535, got 99999".
"""
import argparse
import os

from .config import integer, number

int_at_least = integer  # an int >= low
float_in = number  # a float in [low, high], or (low, high] with low_open
port = integer(1, 65535)


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
