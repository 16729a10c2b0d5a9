"""Split GGUF models: one model in N files `<prefix>-00001-of-0000N.gguf` ... (llama.cpp's gguf-split,
gguf-py's split writer), found from any one of them.

Each file carries `split.no` (0-based), `split.count` and `split.tensors.count` (the model's tensors in all
files); the first holds the model's metadata, every file its own tensors. Each file stays memory-mapped by its
own reader. A file of another model among them is refused by what the files can tell: its split keys, the
metadata it shares with the first file, tensors named twice, the tensor count, and (in gguf_file) shapes.
"""
import os
import re

from gguf import Keys

from ..errors import ModelError

KEY_NO, KEY_COUNT, KEY_TENSORS = Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, \
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's llama_split_path


def shard_name(prefix, no, count):
    """The path of file `no` (0-based) of a `count`-file split model, as llama.cpp names it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def split_keys(fields, path):
    """(split.no, split.count, split.tensors.count) of a file's metadata; None for a file that is not split."""
    count = fields.get(KEY_COUNT)
    if count is None or count == 1 and fields.get(KEY_NO, 0) == 0:
        return None
    no, tensors = fields.get(KEY_NO), fields.get(KEY_TENSORS)
    if not isinstance(count, int) or not isinstance(no, int) or not isinstance(tensors, int) or not 0 <= no < count:
        raise ModelError(f"{path}: damaged split metadata ({KEY_NO}={no!r}, {KEY_COUNT}={count!r}, "
                         f"{KEY_TENSORS}={tensors!r})")
    return no, count, tensors


def shard_paths(path, no, count):
    """Every file of the split model that `path` (file `no` of `count`) belongs to, in order."""
    directory, name = os.path.split(path)
    match = SPLIT_NAME.match(name)
    if not match or int(match["no"]) != no + 1 or int(match["count"]) != count:
        raise ModelError(f"{path}: file {no + 1} of a {count}-file split model, but its name does not end in "
                         f"-{no + 1:05d}-of-{count:05d}.gguf, so the other files cannot be found (keep "
                         f"llama.cpp's names)")
    return [os.path.join(directory, shard_name(match["prefix"], i, count)) for i in range(count)]


def _check_shard(path, fields, first_path, first_fields, no, count, tensors):
    """ModelError when the file at `path` is not file `no` of the model whose first file gave `first_fields`."""
    theirs = split_keys(fields, path)
    if theirs != (no, count, tensors):
        said = f"file {theirs[0] + 1} of {theirs[1]} of a {theirs[2]}-tensor model" if theirs else "not split"
        raise ModelError(f"{path}: not a file of the split model {first_path} ({said}; expected file {no + 1} of "
                         f"{count} of a {tensors}-tensor model)")
    for key, value in fields.items():
        if key.startswith("GGUF.") or key == KEY_NO or key not in first_fields:
            continue
        if first_fields[key] != value:
            raise ModelError(f"{path}: not a file of the split model {first_path} (its {key} differs from the "
                             f"first file's)")


def open_split(path, reader, fields, open_reader, read_fields):
    """[(path, reader)] of every file of the model `path` belongs to, first file first, and the first file's
    metadata; a file that is not split gives [(path, reader)] and its own metadata."""
    keys = split_keys(fields, path)
    if keys is None:
        return [(path, reader)], fields
    no, count, tensors = keys
    paths = shard_paths(path, no, count)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ModelError(f"{missing[0]}: no such file, and the split model {path} needs all its {count} files "
                         f"({len(missing)} missing)")
    shards = [(p, reader if p == paths[no] else open_reader(p)) for p in paths]
    first_fields = fields if no == 0 else read_fields(shards[0][1])
    _check_shard(paths[0], first_fields, paths[no], fields, 0, count, tensors)
    seen = {}
    for i, (shard_path, shard_reader) in enumerate(shards):
        shard_fields = first_fields if i == 0 else read_fields(shard_reader)
        if i:
            _check_shard(shard_path, shard_fields, paths[0], first_fields, i, count, tensors)
        for t in shard_reader.tensors:
            if t.name in seen:
                raise ModelError(f"{shard_path}: not a file of the split model {paths[0]} (tensor '{t.name}' is "
                                 f"in {seen[t.name]} too)")
            seen[t.name] = shard_path
    if len(seen) != tensors:
        raise ModelError(f"{paths[0]}: the {count} files of this split model hold {len(seen)} tensors, "
                         f"{KEY_TENSORS} says {tensors} (a file of another model among them?)")
    return shards, first_fields
