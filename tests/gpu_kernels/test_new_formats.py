"""The GPU kernels of the formats of issue 35 (gpu_kernels/src: one .cuh per format of NEW_FORMATS).

Without a GPU: each format's unit_dequant and slice_dot, compiled for the CPU with g++ as
test_slice_emulation.py does (the same module source the GPU compiles, grid tables included), bit-exact against
gguf.quants.dequantize and against NumPy on the dequantized weights. With a GPU (marked `gpu`): the real
dequant_rows, matmul and moe_matmul kernels against the same references, at decode and prefill sizes.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gpu_kernels.sources import INT_DECODE, module_name, module_source

from .test_slice_emulation import HARNESS, PRELUDE

NEW_FORMATS = [Q.IQ4_XS, Q.MXFP4, Q.Q3_K, Q.Q2_K, Q.IQ3_S, Q.IQ2_XXS, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ3_XXS,
               Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M]
DEFAULT_FORMATS = NEW_FORMATS[:6]  # emulated by default (a g++ build each); the others' emulation is slow


def emulation_params():
    return [pytest.param(q, id=q.name, marks=() if q in DEFAULT_FORMATS else pytest.mark.slow) for q in NEW_FORMATS]
ROWS, COLS = 6, 768

DEQUANT_HARNESS = r"""
extern "C" void dequant(const u8* row, int C, float* out) {
    float w[UNIT_WEIGHTS];
    for (int u = 0; u < C / UNIT_WEIGHTS; ++u) {
        unit_dequant(row, u, w);
        for (int i = 0; i < UNIT_WEIGHTS; ++i) out[u * UNIT_WEIGHTS + i] = w[i];
    }
}
"""

# Random valid blocks without the CPU formats: random bytes, then the block scales set to values of about unit
# size (f16 fields: byte offsets in a block; MXFP4: its e8m0 byte).
F16_SCALES = {Q.IQ4_XS: (0,), Q.Q3_K: (108,), Q.Q2_K: (80, 82), Q.IQ3_S: (0,), Q.IQ2_XXS: (0,), Q.Q4_1: (0, 2),
              Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,), Q.IQ3_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,),
              Q.IQ1_S: (0,)}


def random_rows(rng, qtype, num_rows, num_cols):
    """uint8 [R, B]: random valid blocks of qtype for rows of num_cols weights."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * num_cols // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)  # [blocks, bytes]
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(118, 130, size=num_blocks)
    if qtype == Q.IQ1_M:  # its f16 d: the top nibbles of the four scale words at bytes 48 ..
        d = (rng.uniform(0.5, 1.5, num_blocks) / 64).astype(np.float16).view(np.uint16)
        words = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)  # [blocks, 4]
        words |= ((d[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & np.uint16(15)) << np.uint16(12)
        blocks[:, 48:56] = words.view(np.uint8)
    for offset in F16_SCALES.get(qtype, ()):
        d = (rng.uniform(0.5, 1.5, num_blocks) * rng.choice([-1, 1], num_blocks) / 64).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(num_rows, -1)


def dequant(raw, qtype):
    return np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """qtype -> the format's header (as the GPU module has it, up to matmul.cu) compiled for the CPU, loaded."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    libs = {}

    def get(qtype):
        if qtype not in libs:
            source = module_source(module_name(qtype)).split("// ---- matmul.cu")[0]
            path = tmp_path_factory.mktemp(qtype.name.lower())
            (path / "fmt.cpp").write_text(PRELUDE + source + HARNESS + DEQUANT_HARNESS)
            subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(path / "fmt.so"),
                            str(path / "fmt.cpp")], check=True, capture_output=True)
            libs[qtype] = ctypes.CDLL(str(path / "fmt.so"))
        return libs[qtype]

    return get


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("qtype", emulation_params())
def test_emulated_unit_dequant_bit_exact_with_gguf(emulated, qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_rows(rng, qtype, ROWS, COLS)
    got = np.empty((ROWS, COLS), np.float32)
    for r in range(ROWS):
        emulated(qtype).dequant(_ptr(raw[r]), ctypes.c_int(COLS), _ptr(got[r]))
    assert np.array_equal(got, dequant(raw, qtype))


@pytest.mark.parametrize("qtype", emulation_params())
def test_emulated_slice_dot(emulated, qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    raw = random_rows(rng, qtype, ROWS, COLS)
    x = (rng.standard_normal(COLS) * rng.uniform(0.01, 10, COLS // 32).repeat(32)).astype(np.float32)  # [C]
    got, pair = np.empty(ROWS, np.float32), np.empty(2, np.float32)
    for r in range(0, ROWS, 2):
        emulated(qtype).dot_float(_ptr(raw[r]), _ptr(raw[r + 1]), _ptr(x), ctypes.c_int(COLS), _ptr(pair))
        got[r:r + 2] = pair
    ref = dequant(raw, qtype).astype(np.float64) @ x.astype(np.float64)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 1e-5


def test_grid_tables_are_the_cpus():
    """The device grid constants are cpu_kernels.iq_grids' tables, which tests/cpu_kernels hold to gguf-py."""
    from cpu_kernels import iq_grids

    source = module_source(module_name(Q.IQ3_S))
    body = source.split("IQ3S_GRID[512] = {")[1].split("}")[0]
    words = np.array([int(w.rstrip("u"), 16) for w in body.split(",")], dtype=np.uint32)
    assert np.array_equal(words.view(np.int8).reshape(512, 4), iq_grids.IQ3_S)


def test_iq3_s_grid_copies_and_x_fit_a_blocks_shared_memory(monkeypatch):
    """IQ3_S's `_1q` kernels hold its grid (32 KiB of signed copies by default; IQ3S_GRID_COPIES copies of the 2 KiB
    grid without IQ3S_SIGNED_GRID) besides x in shared memory: where both would not fit a block's 48 KiB, the
    one-token kernels take x as float."""
    from gpu_kernels import sources
    from gpu_kernels.kernels import xq_fits

    assert sources.table_shared_bytes(Q.IQ3_S) == 32768 and sources.table_shared_bytes(Q.IQ4_XS) == 0
    assert xq_fits(Q.IQ3_S, 7168) and not xq_fits(Q.IQ3_S, 8192) and xq_fits(Q.IQ4_XS, 8192)
    monkeypatch.setitem(sources.FORMAT_DEFINES, Q.IQ3_S, {"IQ3S_SIGNED_GRID": "0"})
    assert sources.table_shared_bytes(Q.IQ3_S) == 2048 and xq_fits(Q.IQ3_S, 8192)
    monkeypatch.setitem(sources.FORMAT_DEFINES, Q.IQ3_S, {"IQ3S_SIGNED_GRID": "0", "IQ3S_GRID_COPIES": "16"})
    assert sources.table_shared_bytes(Q.IQ3_S) == 32768
    assert xq_fits(Q.IQ3_S, 7168) and not xq_fits(Q.IQ3_S, 8192)


# IQ3_S's compile-time alternatives of its int16 slice dot (iq3_s.cuh; bench/gpu_kernels.py --variants sweeps them)
IQ3S_VARIANTS = ["IQ3S_SIGNED_GRID=0", "IQ3S_SIGNED_GRID=0+IQ3S_PRMT_MASKS", "IQ3S_SIGNED_GRID=0+IQ3S_XOR_SIGNS",
                 "IQ3S_SIGNED_GRID=0+IQ3S_PRMT_MASKS+IQ3S_XOR_SIGNS", "IQ3S_PAIR_SLICES", "IQ3S_SLICE_SUBS=4",
                 "IQ3S_SIGNED_GRID=0+IQ3S_PAIR_SLICES", "IQ3S_SKIP_ALIGNED"]


def variant_defines(variant):
    """bench/gpu_kernels.py's: `#define NAME VALUE` (NAME=VALUE, or NAME: 1) a macro of `variant` (joined by +)."""
    pairs = [name.partition("=") for name in variant.split("+") if name]
    return "".join(f"#define {key} {value or 1}\n" for key, _, value in pairs)


def test_emulated_iq3_s_variants_dot_as_the_plain_source(tmp_path):
    """Each IQ3_S variant's float and int16 slice dots (emulated as test_slice_emulation does, with its HIP paths, one
    slice after another) give the plain source's sums bit for bit (the same integer dots, the same float sums in the
    same order), within rounding of NumPy's."""
    from .conftest import xq_arrays
    from .test_slice_emulation import HARNESS as SLICE_HARNESS

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    rng = np.random.default_rng(35)
    raw = random_rows(rng, Q.IQ3_S, ROWS, COLS)
    x = (rng.standard_normal(COLS) * rng.uniform(0.01, 10, COLS // 32).repeat(32)).astype(np.float32)  # [C]
    hi, lo, scale, total = xq_arrays(x)
    x_hat = (256 * hi.astype(np.float64) + lo) * np.repeat(scale.astype(np.float64), 32)
    source = module_source(module_name(Q.IQ3_S)).split("// ---- matmul.cu")[0]
    results = {}
    for variant in [""] + IQ3S_VARIANTS:
        path = tmp_path / ("".join(c if c.isalnum() else "_" for c in variant) or "plain")
        path.mkdir()
        (path / "fmt.cpp").write_text(variant_defines(variant) + PRELUDE + source + SLICE_HARNESS)
        subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(path / "fmt.so"),
                        str(path / "fmt.cpp")], check=True, capture_output=True)
        lib = ctypes.CDLL(str(path / "fmt.so"))
        got, pair = np.empty((2, ROWS), np.float32), np.empty(2, np.float32)
        for r in range(0, ROWS, 2):
            lib.dot_int(_ptr(raw[r]), _ptr(raw[r + 1]), _ptr(hi), _ptr(lo), _ptr(scale), _ptr(total),
                        ctypes.c_int(COLS), _ptr(pair))
            got[0, r:r + 2] = pair
            lib.dot_float(_ptr(raw[r]), _ptr(raw[r + 1]), _ptr(x), ctypes.c_int(COLS), _ptr(pair))
            got[1, r:r + 2] = pair
        results[variant] = got
    w = dequant(raw, Q.IQ3_S).astype(np.float64)
    assert rel_err(results[""][0], w @ x_hat) < 1e-5 and rel_err(results[""][1], w @ x) < 1e-5
    for variant in IQ3S_VARIANTS:
        assert np.array_equal(results[variant], results[""]), variant


@pytest.mark.parametrize("variant", IQ3S_VARIANTS + ["XQ_HALVES"])  # not emulated: x in its own layout
def test_iq3_s_variants_compile_for_sm90(variant):
    """Each IQ3_S variant's module (its `_1q` kernels' inline PTX included) compiles with NVRTC for sm_90."""
    from gpu_kernels.nvrtc import Nvrtc, find_library

    if find_library() is None:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc)")
    source = variant_defines(variant) + module_source(module_name(Q.IQ3_S))
    assert b"moe_matmul_1q" in Nvrtc().compile(f"iq3_s_{variant}", source, "sm_90", ("--std=c++14",))


def test_kernel_sass_finds_the_slice_loop():
    """bench/kernel_sass.py's reading of nvdisasm output: a kernel's instructions and labels, and its slice loop (the
    longest backward branch's span with a global load and no shuffle or barrier)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "kernel_sass.py"
    spec = importlib.util.spec_from_file_location("kernel_sass", path)
    kernel_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_sass)
    ops = ["S2R R0, SR_TID.X", "LDG.E R1, desc[UR4][R2.64]", "IDP.4A.S8.S8 R3, R1, R1, R3", "@P0 BRA `(.L_x_1)",
           "SHFL.BFLY PT, R4, R3, 0x1, 0x1f", "BRA `(.L_x_2)", "EXIT"]
    lines = [".text.other:", "        /*0000*/                   NOP ;", ".text.moe_matmul_1q:"]
    for i, op in enumerate(ops):
        if i == 1:
            lines.append(".L_x_1:")
        if i == 4:
            lines.append(".L_x_2:")
        lines.append(f"        /*{16 * i:04x}*/                   {op} ;")
    instructions, labels = kernel_sass.kernel_instructions("\n".join(lines), "moe_matmul_1q")
    assert instructions == ops and labels == {".L_x_1": 1, ".L_x_2": 4}
    assert kernel_sass.slice_loop(instructions, labels) == ops[1:4]  # the shuffle's loop is not it
    assert kernel_sass.opcode("@!P0 IDP.4A.S8.S8 R3, R1, R1, R3") == "IDP"


# ---- on a GPU


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", NEW_FORMATS, ids=lambda q: q.name)
def test_dequant_rows_bit_exact_with_gguf(runtime, kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_rows(rng, qtype, 41, 512)  # [R, B]
    row_ids = np.array([0, 40, 7, 7, 23], dtype=np.int64)
    out = runtime.empty((len(row_ids), 512), np.float32)
    kernels.dequant_rows(runtime.to_device(raw), qtype, runtime.to_device(row_ids), out)
    assert np.array_equal(runtime.to_host(out), dequant(raw[row_ids], qtype))


@pytest.fixture(scope="module")
def float_kernels(runtime):
    """Kernels with x as float in every matmul (the int16 decode has its own test below)."""
    from gpu_kernels.kernels import Kernels

    return Kernels(runtime, act_quant="float")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 19])
@pytest.mark.parametrize("qtype", NEW_FORMATS, ids=lambda q: q.name)
def test_matmul(runtime, float_kernels, qtype, num_tokens):
    rng = np.random.default_rng(int(qtype) * 10 + num_tokens)
    raw = random_rows(rng, qtype, 67, 2048)  # [R, B]
    x = rng.standard_normal((num_tokens, 2048)).astype(np.float32)  # [T, C]
    out = runtime.empty((num_tokens, 67), np.float32)
    float_kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    ref = x.astype(np.float64) @ dequant(raw, qtype).astype(np.float64).T
    assert rel_err(runtime.to_host(out), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", sorted(set(NEW_FORMATS) & INT_DECODE), ids=lambda q: Q(q).name)
def test_int16_matvec(runtime, qtype):
    """The `_1q` kernels of the new INT_DECODE formats: x rounded to int16 once per block, integer dots."""
    from gpu_kernels.kernels import Kernels

    from .conftest import xq_rounded

    rng = np.random.default_rng(int(qtype) + 5)
    raw = random_rows(rng, qtype, 67, 2048)  # [R, B]
    x = (rng.standard_normal((1, 2048)) * rng.uniform(0.01, 10, (1, 64)).repeat(32, axis=1)).astype(np.float32)
    out = runtime.empty((1, 67), np.float32)
    Kernels(runtime, act_quant="int16").matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    ref = xq_rounded(x) @ dequant(raw, qtype).astype(np.float64).T
    assert rel_err(runtime.to_host(out), ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slices,chunks", [(1, 1, 1), (2, 3, 3), (4, 4, 2), (4, 8, 1)])
@pytest.mark.parametrize("qtype", sorted(set(NEW_FORMATS) & INT_DECODE), ids=lambda q: Q(q).name)
def test_int16_moe_matvec_tunings(runtime, qtype, rows, slices, chunks):
    """The one-token expert kernel with x as int16 at several tunings: an odd or even count of slices a lane (the
    unrolled slice loop's tail), lanes of unequal counts (rows 1, slices 1: 48 slices over 32 lanes), one or several
    runs of rows a block (the loads carried from one run into the next), the tables a block stages."""
    from gpu_kernels.kernels import Kernels

    from .conftest import xq_rounded

    rng = np.random.default_rng(int(qtype) * 10 + rows)
    num_slots, num_rows, num_cols = 3, 150, 1536
    raw = random_rows(rng, qtype, num_slots * num_rows, num_cols).reshape(num_slots, num_rows, -1)  # [S, R, B]
    x = (rng.standard_normal((4, num_cols)) * rng.uniform(0.01, 10, (4, num_cols // 32)).repeat(32, axis=1))
    x = x.astype(np.float32)  # [N, C]: one pair row a tile
    tile_slot, tile_row = np.array([2, 0, 1, 0], dtype=np.int32), np.arange(4, dtype=np.int32)
    kernels = Kernels(runtime, decode_rows=rows, lane_slices=slices, act_quant="int16", row_chunks=chunks)
    out = runtime.empty((4, num_rows), np.float32)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out, runtime.to_device(tile_slot),
                       runtime.to_device(tile_row), runtime.to_device(np.ones(4, dtype=np.int32)), tile_tokens=1)
    ref = np.concatenate([xq_rounded(x[i:i + 1]) @ dequant(raw[s], qtype).astype(np.float64).T
                          for i, s in enumerate(tile_slot)])
    assert rel_err(runtime.to_host(out), ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rows,slices,chunks", [(1, 1, 1), (2, 3, 3), (3, 4, 2), (4, 4, 2), (4, 8, 1)])
@pytest.mark.parametrize("variant", ["", "IQ3S_SKIP_ALIGNED", "PEEL_LAST_SLICE", "XQ_HALVES"])
def test_iq3_s_variants_int16_moe_matvec(runtime, monkeypatch, variant, rows, slices, chunks):
    """test_int16_moe_matvec_tunings on IQ3_S compiled with each of its variants, as the bench compiles them ("": the
    default source; 3 rows a lane group as the bench sweeps them)."""
    from gpu_kernels import kernels as kernels_module

    source, name = kernels_module.tuned_source, kernels_module.tuned_module_name
    monkeypatch.setattr(kernels_module, "tuned_source", lambda q, r, b, defines="": source(
        q, r, b, variant_defines(variant) + defines))
    suffix = "".join(c if c.isalnum() else "_" for c in variant.lower())
    monkeypatch.setattr(kernels_module, "tuned_module_name", lambda q, r, b: f"{name(q, r, b)}_{suffix}")
    test_int16_moe_matvec_tunings(runtime, Q.IQ3_S, rows, slices, chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [1, 8])
@pytest.mark.parametrize("qtype", NEW_FORMATS, ids=lambda q: q.name)
def test_moe_matmul(runtime, float_kernels, qtype, tile_tokens):
    """Expert slots [S, R, B], work tiles of pair rows each on one slot (tiles of one row: the decode kernel)."""
    rng = np.random.default_rng(int(qtype) + tile_tokens)
    num_slots, num_rows, num_cols = 3, 40, 1024
    raw = random_rows(rng, qtype, num_slots * num_rows, num_cols).reshape(num_slots, num_rows, -1)  # [S, R, B]
    counts = [1, 3, 8, 2] if tile_tokens == 8 else [1, 1, 1, 1]
    tile_slot = np.array([2, 0, 1, 0], dtype=np.int32)
    tile_row = np.cumsum([0] + counts[:-1]).astype(np.int32)
    x = rng.standard_normal((sum(counts), num_cols)).astype(np.float32)  # [N, C]
    out = runtime.empty((sum(counts), num_rows), np.float32)
    float_kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out, runtime.to_device(tile_slot),
                       runtime.to_device(tile_row), runtime.to_device(np.array(counts, dtype=np.int32)),
                       tile_tokens=tile_tokens)
    ref = np.concatenate([x[r:r + c].astype(np.float64) @ dequant(raw[s], qtype).astype(np.float64).T
                          for s, r, c in zip(tile_slot, tile_row, counts)])
    assert rel_err(runtime.to_host(out), ref) < 1e-5


# ---- the GPU backend's Python side on the NumPy stand-in runtime


@pytest.mark.slow
@pytest.mark.parametrize("size,target", [("small", "MXFP4_MOE"), ("kquant", "UD_MIX")])
def test_gpu_backend_wiring_on_new_formats(gguf_models, numpy_runtime, reference_kernels, size, target):
    """test_backend_wiring's check on files of the new types: GpuBackend's uploads, expert slots and work tiles
    with NumPy kernels against the CPU engine, at 0, 50 and 100 % of the experts resident."""
    from cpu_kernels.formats import is_supported
    from hybrid.backends.gpu import GpuBackend
    from hybrid.formats import load_model
    from hybrid.formats.synthetic import mix_types
    from hybrid.model import Model

    from .test_backend_wiring import CpuBackend, score

    missing = sorted(q.name for q in mix_types(target) if not is_supported(q))
    if missing:
        pytest.skip(f"no CPU kernels yet for {', '.join(missing)}")
    weights = load_model(gguf_models(size, target)[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend()))
    rng = np.random.default_rng(0)
    for fraction in (0.0, 0.5, 1.0):
        backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2,
                             resident=rng.random((c.num_layers, c.num_experts)) < fraction)
        backend.kernels = reference_kernels
        got = score(Model(weights, backend, host=CpuBackend()))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max(), err_msg=f"{fraction:.0%}")


def test_a_type_without_gpu_kernels_is_named_before_upload(gguf_models, numpy_runtime):
    """A file of a type the CPU runs but the GPU kernels do not (TQ2_0): a ModelError naming the tensor, not a
    KeyError at the first launch."""
    from hybrid.backends.gpu import GpuBackend
    from hybrid.errors import ModelError
    from hybrid.formats import load_model
    from hybrid.formats.weights import QuantTensor
    from hybrid.model import Model

    weights = load_model(gguf_models("kquant", "Q4_K_M")[0])
    name = "blk.1.ffn_up_exps.weight"
    shape = weights.tensors[name].shape
    raw = np.random.default_rng(0).integers(0, 256, (*shape[:-1], shape[-1] // 256 * 66), dtype=np.uint8)  # never read
    weights.tensors[name] = QuantTensor(name, Q.TQ2_0, shape, raw)
    with pytest.raises(ModelError, match=f"^tensor '{name}' has type TQ2_0, which has no GPU kernels yet .*--device "
                                         "cpu$"):
        Model(weights, GpuBackend(numpy_runtime, max_context=256))


# ---- the engine on a GPU with files of the new types

GPU_MODELS = [("kquant", "UD_MIX"), ("kquant", "MXFP4_MOE"), ("kquant", "Q3_K_M"), ("small", "Q4_1"), ("small", "Q5_0"),
              ("small", "Q5_1"), ("small", "IQ4_NL"), ("kquant", "IQ3_XXS"), ("kquant", "IQ2_XS"), ("kquant", "IQ2_S"),
              ("kquant", "IQ1_S"), ("kquant", "IQ1_M")]  # with UD_MIX's and the mixes' types: every new format


@pytest.mark.gpu
@pytest.mark.parametrize("size,target", GPU_MODELS, ids=[f"{s}-{t}" for s, t in GPU_MODELS])
def test_gpu_engine_matches_cpu(runtime, gguf_models, size, target):
    """test_gpu_model's check on the new types: device="gpu" at 0, 50 and 100 % of the experts resident against
    the CPU engine, logits within 2e-3 and 8 greedy tokens equal. The CPU engine runs op by op: its compiled and
    fused layers give the same logits (tests/hybrid/test_compiled_decode.py) but compile for minutes a format on a
    cold many-core host."""
    from hybrid import LLM

    from .test_gpu_model import PROMPT, masks

    path, _ = gguf_models(size, target)
    cpu = LLM(path, device="cpu", max_context=256, compiled_decode=False)
    ref = cpu.score(PROMPT)
    ref_tokens = cpu.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids
    for name, mask in masks(cpu.config.num_layers, cpu.config.num_experts).items():
        gpu = LLM(path, device="gpu", max_context=256, resident=mask)
        assert gpu.device == "gpu"
        assert rel_err(gpu.score(PROMPT), ref) <= 2e-3, name
        assert gpu.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids == ref_tokens, name
