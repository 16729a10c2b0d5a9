"""argparse `type=` callables that refuse bad values before anything loads (those of the settings are in
hybrid/config_types.py, and re-exported here for the commands' own arguments).

argparse turns their ArgumentTypeError into one line that names the flag:
"strata serve: error: argument --port: must be in 1..65535, got 99999".
"""
import argparse

from .config_types import existing_file, integer, number, output_file  # noqa: F401

int_at_least = integer  # an int >= low
float_in = number  # a float in [low, high], or (low, high] with low_open
port = integer(1, 65535)


def token_ids(text):
    """Comma-separated token ids (>= 0; the model's vocabulary bounds them once it is loaded)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected token ids >= 0, got {text!r}")
    return ids
