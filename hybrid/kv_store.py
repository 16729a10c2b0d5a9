"""How parked KV is stored: as the live cache holds it (f32), as f16, or as int8 with scales.

Shape legend: L layers, n positions, Hkv kv heads, D head dim.
int8 keeps one float32 scale per (layer, position, kv head): max|x| / 127 over
the head's D values, so each row is rounded to 1/254 of its own range.
"""
import numpy as np

STORES = ("f32", "f16", "int8")
ARRAY_NAMES = {"f32": {"k", "v"}, "f16": {"k", "v"}, "int8": {"k", "k_scale", "v", "v_scale"}}


def pack(k, v, store):
    """k, v: float32 [L, n, Hkv, D] -> dict of arrays to keep."""
    if store == "f32":
        return {"k": k.copy(), "v": v.copy()}
    if store == "f16":
        return {"k": k.astype(np.float16), "v": v.astype(np.float16)}
    if store == "int8":
        kq, ks = _quantize(k)
        vq, vs = _quantize(v)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}
    raise ValueError(f"KV store must be one of {', '.join(STORES)}, got {store!r}")


def unpack_into(arrays, n, k_out, v_out):
    """Write the first n positions of packed arrays into float32 k_out, v_out [L, >=n, Hkv, D]."""
    for name, out in (("k", k_out), ("v", v_out)):
        data = arrays[name][:, :n]
        if data.dtype == np.int8:
            out[:, :n] = data.astype(np.float32) * arrays[f"{name}_scale"][:, :n, :, None]
        else:
            out[:, :n] = data


def bytes_per_token(num_layers, num_kv_heads, head_dim, store):
    per_value = {"f32": 4, "f16": 2, "int8": 1}[store]
    scales = 2 * num_layers * num_kv_heads * 4 if store == "int8" else 0
    return 2 * num_layers * num_kv_heads * head_dim * per_value + scales


def _quantize(x):
    scale = np.abs(x).max(axis=-1) / 127.0  # [L, n, Hkv]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8)  # [L, n, Hkv, D]
    return q, scale
