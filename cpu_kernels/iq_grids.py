"""The lattice grids and sign tables of the IQ formats, decoded from gguf-py's constants at import.

gguf-py stores each grid (llama.cpp's iq2xxs_grid, iq3s_grid, iq1s_grid, ...) as hex text of packed
indices into a short list of values (`grid_hex`, `grid_map`); `grid` decodes one to a [N, W] int8
table of the values themselves (IQ2: 8, 25, 43; IQ3_XXS: 4..62; IQ3_S: 1..15; IQ1: -1, 0, 1).
The IQ2_XXS / IQ2_XS / IQ3_XXS sign bytes (`ksigns`) are 7 stored bits plus an eighth that makes
the byte's parity even: `sign_byte` computes them, and tests compare both against gguf-py.

`lookup` builds the LLVM code that reads grid rows for a vector of indices: a table is an internal
constant of the module that uses it, one row an i32 (4 values) or an i64 (8 values).

Shape legend: N grid rows, W values per row (4 or 8).
"""
import numpy as np
from gguf import quants
from llvmlite import ir

from . import simd
from .simd import I32, I64

I1 = ir.IntType(1)


def grid(quant):
    """gguf.quants' class `quant` (IQ2_XXS, ...) -> its grid as int8 [N, W]: grid_hex holds each row's W
    indices into grid_map, packed from the low bits up, 4 bits per index for 8 values, 2 for 3 values."""
    rows, width = quant.grid_shape
    packed = np.frombuffer(bytes.fromhex(quant.grid_hex.decode()), dtype=np.uint8)
    bits = 4 if len(quant.grid_map) > 4 else 2
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    indices = (packed[:, None] >> shifts) & ((1 << bits) - 1)  # [bytes, 8 // bits]
    values = np.array(quant.grid_map, dtype=np.int8)
    return values[indices.reshape(rows, width)]


def sign_byte(index):
    """The ksigns byte of a 7-bit sign index: the index with bit 7 set where its popcount is odd."""
    index = np.asarray(index, dtype=np.uint8)
    parity = np.unpackbits(index[..., None], axis=-1).sum(axis=-1) & 1
    return index | (parity << 7).astype(np.uint8)


IQ2_XXS = grid(quants.IQ2_XXS)  # [256, 8]
IQ2_XS = grid(quants.IQ2_XS)  # [512, 8]
IQ2_S = grid(quants.IQ2_S)  # [1024, 8]
IQ3_XXS = grid(quants.IQ3_XXS)  # [256, 4]
IQ3_S = grid(quants.IQ3_S)  # [512, 4]
IQ1 = grid(quants.IQ1_S)  # [2048, 8]: IQ1_S and IQ1_M share it
KSIGNS = sign_byte(np.arange(128))  # [128]


def lookup(builder, name, table, indices):
    """<n x i32 or i64> of the rows of int8 table [N, 4 or 8] at <n x i32> indices (each < N), one row a lane:
    a masked gather, which the target lowers to gather instructions or to loads, whichever it prefers."""
    count = indices.type.count
    row_ty = ir.IntType(8 * table.shape[1])
    base = builder.ptrtoint(_table_global(builder.module, name, table, row_ty), I64)
    offsets = builder.mul(builder.zext(indices, simd.vec(I64, count)), simd.splat_const(I64, count, table.shape[1]))
    addresses = builder.add(int_splat(builder, base, count), offsets)
    pointers = builder.inttoptr(addresses, ir.VectorType(row_ty.as_pointer(), count))
    fn_ty = ir.FunctionType(simd.vec(row_ty, count), [pointers.type, I32, simd.vec(I1, count), simd.vec(row_ty, count)])
    fn = builder.module.globals.get(f"llvm.masked.gather.v{count}i{row_ty.width}.v{count}p0") or ir.Function(
        builder.module, fn_ty, f"llvm.masked.gather.v{count}i{row_ty.width}.v{count}p0")
    mask = ir.Constant(simd.vec(I1, count), [1] * count)
    passthru = ir.Constant(simd.vec(row_ty, count), None)
    return builder.call(fn, [pointers, ir.Constant(I32, table.shape[1]), mask, passthru])


def int_splat(builder, value, n):
    """An integer scalar broadcast to <n x T>."""
    v = builder.insert_element(ir.Constant(simd.vec(value.type, 1), None), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(simd.vec(I32, n), [0] * n))


def _table_global(module, name, table, row_ty):
    """The module's internal constant [N x row_ty] holding int8 table [N, W] row by row (little-endian lanes)."""
    existing = module.globals.get(name)
    if existing is not None:
        return existing.bitcast(row_ty.as_pointer())
    rows = table.astype(np.int8).view(np.uint8).reshape(table.shape[0], -1)
    words = [int.from_bytes(bytes(row), "little") for row in rows]
    array_ty = ir.ArrayType(row_ty, len(words))
    var = ir.GlobalVariable(module, array_ty, name)
    var.linkage = "internal"
    var.global_constant = True
    var.initializer = ir.Constant(array_ty, words)
    var.align = 64
    return var.bitcast(row_ty.as_pointer())  # the first row's address, a constant expression
