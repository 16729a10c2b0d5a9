"""Quant-block dots with x as explicit LLVM vector code (Numba intrinsics).

Written as plain loops, a block dot nests a 32-step loop in the loop over blocks;
LLVM unrolls the inner loop and then vectorizes the block loop with gathers, ~10x
slower than memory speed. Here a block is loaded as <32 x ...> vectors, so every
block runs as a few wide instructions on any x86 level (SSE to AVX-512 legalize the
same IR). The formats build from these pieces: `rows_dot_intrinsic`, whole-row dot
loops over several rows at once with vector accumulators (one horizontal reduction
per row; float x, int16 x through `madd_i16`, or int8 x through `dot_u8i8`), and
`unpack_row_intrinsic`, a row dequantized to float32 for prefill.

Shape legend: C columns; `q` uint8 raw bytes, `x` float32, int16 or int8 [C]; offsets are in elements.
"""
import ctypes

from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from .target import has_f16c, vnni_width

FAST = ("fast",)

F32 = ir.FloatType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def vec(elem, n):
    return ir.VectorType(elem, n)


def const_vec(elem, values):
    return ir.Constant(vec(elem, len(values)), list(values))


def splat_const(elem, n, value):
    return ir.Constant(vec(elem, n), [value] * n)


def data_ptr(context, builder, aryty, ary):
    """The first element's address of a contiguous array argument."""
    return context.make_array(aryty)(context, builder, value=ary).data


def load_at(builder, base, offset, ty):
    """Unaligned load of ty from the element pointer `base` advanced by `offset` elements."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1, typ=ty)


def half_to_f32(builder, bits):
    """An i16 IEEE half -> float, exact: one vcvtph2ps where the target has F16C, else integer ops only
    (no float32 subnormals made; ~10 instructions, which Q4_0 and Q8_0 pay once per 32 weights)."""
    if has_f16c():
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)
    h = builder.zext(bits, I32)
    mag = builder.and_(h, ir.Constant(I32, 0x7FFF))
    normal = builder.add(builder.shl(mag, ir.Constant(I32, 13)), ir.Constant(I32, 112 << 23))
    tiny = builder.bitcast(builder.fmul(builder.uitofp(mag, F32), ir.Constant(F32, 2.0**-24)), I32)
    out = builder.select(builder.icmp_unsigned("<", mag, ir.Constant(I32, 0x400)), tiny, normal)
    out = builder.or_(out, builder.shl(builder.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16)))
    return builder.bitcast(out, F32)


def load_half(builder, byte_base, offset):
    """The little-endian half at byte `offset` of an i8 pointer, as float."""
    return half_to_f32(builder, load_at(builder, byte_base, offset, I16))


def load_halves(builder, byte_base, offsets):
    """<len(offsets) x float> of the little-endian halves at byte `offsets` (i64 values) of an i8 pointer:
    one vcvtph2ps for all of them where the target has F16C."""
    if not has_f16c():
        return _gather(builder, [load_half(builder, byte_base, o) for o in offsets], F32)
    bits = _gather(builder, [load_at(builder, byte_base, o, I16) for o in offsets], I16)
    return builder.fpext(builder.bitcast(bits, vec(ir.HalfType(), len(offsets))), vec(F32, len(offsets)))


def _gather(builder, scalars, elem):
    v = ir.Constant(vec(elem, len(scalars)), None)
    for i, s in enumerate(scalars):
        v = builder.insert_element(v, s, ir.Constant(I32, i))
    return v


def splat(builder, value, n):
    """A scalar float broadcast to <n x float>."""
    v = builder.insert_element(ir.Constant(vec(F32, 1), [0.0]), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, n), [0] * n))


def lanes(builder, v, indices):
    """<len(indices) x T> of v's lanes `indices`."""
    return builder.shuffle_vector(v, v, const_vec(I32, indices))


def concat(builder, a, b):
    """The vector a followed by b (same type)."""
    return builder.shuffle_vector(a, b, const_vec(I32, range(2 * a.type.count)))


def hsum(builder, v):
    """The sum of a float vector's lanes, as a tree of halvings."""
    width = v.type.count
    while width > 1:
        width //= 2
        v = builder.fadd(lanes(builder, v, range(width)), lanes(builder, v, range(width, 2 * width)), flags=FAST)
    return builder.extract_element(v, ir.Constant(I32, 0))


def fma(builder, a, b, acc):
    """acc + a * b with fast-math flags (LLVM fuses them where the target has FMA)."""
    return builder.fadd(acc, builder.fmul(a, b, flags=FAST), flags=FAST)


def row_loop(builder, count, body, init):
    """Run body(index i64, accs) -> accs for index in range(count) with accumulator values `init`; returns the last accs."""
    from numba.core import cgutils

    slots = [cgutils.alloca_once_value(builder, value) for value in init]
    with cgutils.for_range(builder, count) as loop:
        accs = body(loop.index, [builder.load(s) for s in slots])
        for slot, value in zip(slots, accs):
            builder.store(value, slot)
    return [builder.load(s) for s in slots]


def contiguous(*arys):
    """True if every argument is a C-contiguous 1-d array (what the row intrinsics read directly)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arys)


ROWS_IN_FLIGHT = 4  # rows one dot loop reads side by side (row_streams says which)
STREAM_MIN_ROWS = 16  # a work item's rows are read as ROWS_IN_FLIGHT streams when each gets at least this many
# While a dot loop reads its rows it prefetches the same bytes n loop steps on, n = PREFETCH_ROWS: the row n on
# in each stream, or for neighbouring rows the rows 4n on: the hardware prefetchers alone leave one thread's
# dot loop well short of DRAM bandwidth (bench/row_dot.py; bench/results/cpu_prefetch.md). The best n differs
# by host, so it is a process-wide value the compiled loops load at run time, through an external symbol that
# cached code resolves again in every process; cpu_kernels.prefetch.calibrate sets it per host, or takes a
# fixed distance.
PREFETCH_ROWS = ctypes.c_int64(2)
llvm.add_symbol("strata_prefetch_rows", ctypes.addressof(PREFETCH_ROWS))
CACHE_LINE = 64


@njit(inline="always", nogil=True, cache=True)
def row_streams(r0, r1):
    """(loop steps, row step, stride) of a dot loop over rows r0:r1 reading ROWS_IN_FLIGHT rows a step: step i
    reads rows r0 + i * row step + k * stride. Long items run as streams a quarter item apart, which the
    prefetchers follow; short ones as neighbouring rows, where a quarter of 16-32 rows is too short a stream
    (bench/results/cpu_kernels.md). The rows past the last step's are left to the caller."""
    groups = (r1 - r0) // ROWS_IN_FLIGHT
    if groups >= STREAM_MIN_ROWS:
        return groups, 1, groups
    return groups, ROWS_IN_FLIGHT, 1


def load_prefetch_rows(builder):
    """The current PREFETCH_ROWS, as an i64 loaded in the generated code."""
    module = builder.module
    symbol = module.globals.get("strata_prefetch_rows")
    if symbol is None:
        symbol = ir.GlobalVariable(module, I64, "strata_prefetch_rows")
        symbol.linkage = "external"
    return builder.load(symbol)


@intrinsic
def num_threads(typingctx):
    """The calling thread's Numba thread count (numba.get_num_threads) in compiled code, cacheable: it calls
    the threading layer's `get_num_threads` symbol, which the layer registers when it launches (cpu_kernels
    launches it at import), where Numba's own overload holds a ctypes pointer that keeps callers uncached."""
    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, []), "get_num_threads")
        # Declared as the parfor lowering declares it (intp) since both may land in one module; the C function
        # returns int, so only the low 32 bits count.
        return builder.sext(builder.trunc(builder.call(fn, []), I32), I64)

    return types.int64(), codegen


def prefetch(builder, ptr):
    """A read prefetch of the line at i8 pointer `ptr` into all cache levels (never faults)."""
    from numba.core import cgutils

    fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), I32, I32, I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def rows_dot_intrinsic(block_fn, block_bytes, num_rows):
    """An intrinsic writing out[r_k] = W[r_k] @ x for num_rows rows r_k: for one row f(w uint8 [R, B], r,
    x f32 [C], aux f32 [A], out f32 [R]) reads row r; for more f(w, r, stride, x, aux, out) reads rows
    r + k * stride, k < num_rows. The caller keeps every r_k < R.

    block_fn(builder, q, o, b, xs, aux, acc) -> acc adds block b (at byte o of row pointer q) to
    the row's vector accumulator; xs and aux are float pointers (aux: per-format side data, such
    as sub-block sums of x; formats without it ignore it). A block_fn with `blocks_per_step` = n adds
    blocks b .. b + n - 1 per call; its `tail` adds the row's last (num_blocks % n) blocks one at a time.
    Reading num_rows rows per loop keeps that many memory streams going at once: one row at a time, a dot
    loop consumes its stream too slowly for the prefetchers and reaches less than half the DRAM bandwidth
    (bench/results/cpu_kernels.md). The rows lie `stride` apart (row_streams): in a long work item each stream
    runs on through the next rows of its own quarter, where four neighbouring rows (576 bytes each in Q4_K at
    C = 1024) are one short window the prefetchers lose. Where the hardware prefetchers still fall behind, the
    loop also prefetches PREFETCH_ROWS loop steps on (the row that many on in each stream; for neighbouring
    rows, stride 1, four times as many rows), clamped to W's last row so it never reads another tensor.
    """
    from numba.core import cgutils

    def typed(w, r, extra, x, aux, out):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and contiguous(x, aux, out)):
            return None
        return types.void(w, r, *extra, x, aux, out), codegen

    strided = num_rows > 1
    if strided:
        def impl(typingctx, w, r, stride, x, aux, out):
            return typed(w, r, (stride,), x, aux, out)
    else:
        def impl(typingctx, w, r, x, aux, out):
            return typed(w, r, (), x, aux, out)

    if True:  # the code both signatures share
        def codegen(context, builder, signature, args):
            w_ty, x_ty, aux_ty, out_ty = signature.args[0], *signature.args[-3:]
            wa = context.make_array(w_ty)(context, builder, value=args[0])
            row_bytes = cgutils.unpack_tuple(builder, wa.shape)[1]
            first = context.cast(builder, args[1], signature.args[1], types.int64)
            step_rows = context.cast(builder, args[2], signature.args[2], types.int64) if strided \
                else ir.Constant(I64, 1)
            xs = data_ptr(context, builder, x_ty, args[-3])
            aux_ptr = data_ptr(context, builder, aux_ty, args[-2])
            outp = data_ptr(context, builder, out_ty, args[-1])
            row_ids = [builder.add(first, builder.mul(step_rows, ir.Constant(I64, k))) for k in range(num_rows)]
            rows = [builder.gep(wa.data, [builder.mul(row, row_bytes)]) for row in row_ids]
            num_blocks = builder.udiv(row_bytes, ir.Constant(I64, block_bytes))
            acc_ty = block_fn.acc_type

            num_w_rows = cgutils.unpack_tuple(builder, wa.shape)[0]
            last_row = builder.sub(num_w_rows, ir.Constant(I64, 1))
            later = []  # the rows PREFETCH_ROWS on, clamped to W's last row (never another tensor's)
            ahead = load_prefetch_rows(builder)  # loop steps: rows in each stream, 4 rows each for neighbours
            if strided:
                neighbours = builder.icmp_signed("==", step_rows, ir.Constant(I64, 1))
                ahead = builder.select(neighbours, builder.mul(ahead, ir.Constant(I64, num_rows)), ahead)
            for k in range(num_rows):
                row = builder.add(row_ids[k], ahead)
                row = builder.select(builder.icmp_signed(">", row, last_row), last_row, row)
                later.append(builder.gep(wa.data, [builder.mul(row, row_bytes)]))

            step_bytes = block_bytes * getattr(block_fn, "blocks_per_step", 1)
            lines = [ir.Constant(I64, k) for k in range(0, step_bytes, CACHE_LINE)]  # every line a step reads

            def step(b, accs):
                o = builder.mul(b, ir.Constant(I64, block_bytes))
                for q in later:
                    for line in lines:
                        prefetch(builder, builder.gep(q, [builder.add(o, line)]))
                return [block_fn(builder, q, o, b, xs, aux_ptr, acc) for q, acc in zip(rows, accs)]

            per_step = ir.Constant(I64, getattr(block_fn, "blocks_per_step", 1))
            num_steps = builder.udiv(num_blocks, per_step)
            accs = row_loop(builder, num_steps, lambda i, accs: step(builder.mul(i, per_step), accs),
                            [ir.Constant(acc_ty, None)] * num_rows)
            if hasattr(block_fn, "tail"):  # the last num_blocks % blocks_per_step blocks, one at a time
                done = builder.mul(num_steps, per_step)

                def tail(i, accs):
                    b = builder.add(done, i)
                    o = builder.mul(b, ir.Constant(I64, block_bytes))
                    return [block_fn.tail(builder, q, o, b, xs, aux_ptr, acc) for q, acc in zip(rows, accs)]

                accs = row_loop(builder, builder.sub(num_blocks, done), tail, accs)
            for k, acc in enumerate(accs):
                total = block_fn.finish(builder, acc) if hasattr(block_fn, "finish") else hsum(builder, acc)
                builder.store(total, builder.gep(outp, [row_ids[k]]))
            return context.get_dummy_value()

    impl.__name__ = f"{block_fn.__name__}_rows{num_rows}"
    return intrinsic(impl)


def unpack_row_intrinsic(weights_fn, block_bytes, block_size):
    """An intrinsic f(w uint8 [R, B], r, dst f32 [C]) -> None writing row r of W, dequantized, to dst.

    weights_fn(builder, q, o) -> [(first weight, <n x float>), ...] gives the weights of the block at
    byte o of row pointer q as vectors. Used by prefill, which unpacks a tile of rows once for many
    tokens; the scalar dequantizers stay the bit-exact reference (fast-math may fuse a scale and a min).
    """
    from numba.core import cgutils

    def impl(typingctx, w, r, dst):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and contiguous(dst)):
            return None
        sig = types.void(w, r, dst)

        def codegen(context, builder, signature, args):
            wa = context.make_array(signature.args[0])(context, builder, value=args[0])
            row_bytes = cgutils.unpack_tuple(builder, wa.shape)[1]
            first = context.cast(builder, args[1], signature.args[1], types.int64)
            q = builder.gep(wa.data, [builder.mul(first, row_bytes)])
            out = data_ptr(context, builder, signature.args[2], args[2])
            num_blocks = builder.udiv(row_bytes, ir.Constant(I64, block_bytes))

            def step(b, accs):
                o = builder.mul(b, ir.Constant(I64, block_bytes))
                base = builder.gep(out, [builder.mul(b, ir.Constant(I64, block_size))])
                for offset, values in weights_fn(builder, q, o):
                    ptr = builder.bitcast(builder.gep(base, [ir.Constant(I64, offset)]), values.type.as_pointer())
                    builder.store(values, ptr, align=4)
                return accs

            row_loop(builder, num_blocks, step, [])
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"{weights_fn.__name__}_unpack_row"
    return intrinsic(impl)


_PMADDWD = {32: "llvm.x86.avx512.pmaddw.d.512", 16: "llvm.x86.avx2.pmadd.wd", 8: "llvm.x86.sse2.pmadd.wd"}


def madd_i16(builder, a, b, width):
    """<n x i16> a, b -> <n/2 x i32> of a[2i] * b[2i] + a[2i + 1] * b[2i + 1], as pmaddwd instructions of
    `width` i16 lanes (32: AVX-512BW, 16: AVX2, 8: SSE2). LLVM does not form pmaddwd from the plain
    sext-mul-add pattern (it emits vpmulld and shuffles), so the instruction is called by name."""
    from numba.core import cgutils

    n = a.type.count
    fnty = ir.FunctionType(vec(I32, width // 2), [vec(I16, width)] * 2)
    fn = cgutils.get_or_insert_function(builder.module, fnty, _PMADDWD[width])
    parts = [builder.call(fn, [lanes(builder, a, range(k, k + width)), lanes(builder, b, range(k, k + width))])
             for k in range(0, n, width)]
    while len(parts) > 1:
        m = parts[0].type.count
        parts = [builder.shuffle_vector(parts[i], parts[i + 1], const_vec(I32, range(2 * m)))
                 for i in range(0, len(parts), 2)]
    return parts[0]


_VPDPBUSD = {64: "llvm.x86.avx512.vpdpbusd.512", 32: "llvm.x86.avx512.vpdpbusd.256"}


def dot_u8i8(builder, acc, a, b):
    """<n x i32> acc + the sums of 4 products a[4i + k] * b[4i + k], a <4n x i8> read as unsigned, b as signed:
    vpdpbusd instructions of vnni_width() bytes (AVX-512 VNNI: 64, AVX-VNNI: 32; LLVM does not form them from
    the plain pattern). Targets without VNNI get that plain pattern (correct, slow; act_quant sends them to
    the int16 dot, so it only has to compile)."""
    from numba.core import cgutils

    n = acc.type.count
    width = vnni_width()
    if not width:
        i32x = vec(I32, 4 * n)
        prods = builder.mul(builder.zext(a, i32x), builder.sext(b, i32x))
        for k in range(4):
            acc = builder.add(acc, lanes(builder, prods, range(k, 4 * n, 4)))
        return acc
    lanes_per_call = width // 4
    fnty = ir.FunctionType(vec(I32, lanes_per_call), [vec(I32, lanes_per_call)] * 3)
    fn = cgutils.get_or_insert_function(builder.module, fnty, _VPDPBUSD[width])
    a32, b32 = (builder.bitcast(v, vec(I32, n)) for v in (a, b))
    parts = [builder.call(fn, [lanes(builder, v, range(k, k + lanes_per_call)) for v in (acc, a32, b32)])
             for k in range(0, n, lanes_per_call)]
    while len(parts) > 1:
        parts = [concat(builder, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def dot_offset_u8i8(builder, a, b, offset):
    """<n/4 x i32> sums of 4 products (a[4i + k] - offset) * b[4i + k] for a <n x i8> read as unsigned and b
    as signed: two dot_u8i8, the first (-offset * b, the second's start) the same for every row of a dot loop
    (LLVM computes it once per block for all rows)."""
    zeros = ir.Constant(vec(I32, a.type.count // 4), None)
    shift = dot_u8i8(builder, zeros, splat_const(I8, a.type.count, offset), b)
    return dot_u8i8(builder, builder.sub(zeros, shift), a, b)


def word_lshr(builder, v, shifts):
    """<n x i8> v shifted right as n/2 16-bit words by `shifts` (one per word, < 8): one vpsrlvw (x86 has no
    byte shifts). Bits s..7 of each byte land in bits 0..7 - s; the top s bits of a word's low byte come from
    its high byte, so the caller keeps at most 8 - s bits."""
    words = builder.bitcast(v, vec(I16, v.type.count // 2))
    return builder.bitcast(builder.lshr(words, const_vec(I16, shifts)), v.type)
