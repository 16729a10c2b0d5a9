"""KV encodings: how the live cache and the conversation cache hold K and V rows.

Shape legend: L layers, n positions, Hkv kv heads, D head dim.
f16 and bf16 are kept as their 16-bit patterns (Numba has no 16-bit floats; bf16
goes in an int16 array so that kernels can tell it from f16 by type); int8 keeps
one float32 scale per (layer, position, kv head): max|x| / 127 over the head's D
values, so each row is rounded to 1/254 of its own range.
"""
import numpy as np

KV_DTYPES = ("f32", "f16", "bf16", "int8")  # the live cache
STORES = ("f32", "f16", "int8")  # parked conversations
STORAGE = {"f32": np.float32, "f16": np.uint16, "bf16": np.int16, "int8": np.int8}
ARRAY_NAMES = {"f32": {"k", "v"}, "f16": {"k", "v"}, "int8": {"k", "k_scale", "v", "v_scale"}}


def encode(x, dtype):
    """x float32 [..., D] -> (data in STORAGE[dtype], scales [...] float32 for int8 else None)."""
    if dtype == "f32":
        return x, None  # float32 already (a device array stays on its device)
    if dtype == "f16":
        return x.astype(np.float16).view(np.uint16), None
    if dtype == "bf16":
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return rounded.astype(np.uint16).view(np.int16), None
    if dtype == "int8":
        scale = np.abs(x).max(axis=-1) / 127.0  # [...]
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        return np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8), scale
    raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")


def decode(data, scale=None):
    """The float32 values of encoded rows."""
    if data.dtype == np.float32:
        return data
    if data.dtype == np.uint16:
        return data.view(np.float16).astype(np.float32)
    if data.dtype == np.int16:
        return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return data.astype(np.float32) * scale[..., None]


def pack(k, v, store, owned=False):
    """k, v: float32 [L, n, Hkv, D] -> dict of arrays to keep. owned: k and v are the caller's own fresh copies
    (a sequence's export), kept as they are where the store is float32 instead of copied again."""
    if store not in STORES:
        raise ValueError(f"KV store must be one of {', '.join(STORES)}, got {store!r}")
    arrays = {}
    for name, x in (("k", k), ("v", v)):
        data, scale = encode(x, store)
        arrays[name] = data.copy() if data is x and not owned else data
        if scale is not None:
            arrays[f"{name}_scale"] = scale
    return arrays


def unpack(arrays, n):
    """The first n positions of packed arrays as float32 (k, v) [L, n, Hkv, D]."""
    return tuple(decode(arrays[name][:, :n], arrays[f"{name}_scale"][:, :n] if f"{name}_scale" in arrays else None)
                 for name in ("k", "v"))


def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype):
    per_value = {"f32": 4, "f16": 2, "bf16": 2, "int8": 1}[dtype]
    scales = 2 * num_layers * num_kv_heads * 4 if dtype == "int8" else 0
    return 2 * num_layers * num_kv_heads * head_dim * per_value + scales
