"""Inline-PTX helpers for the tensor-core kernels (on the simulator: kernels/simulated.py).

numba-cuda has no API for the tensor cores' ``mma`` instructions, but an ``@intrinsic``
can emit any PTX through ``llvmlite.ir.InlineAsm``. Two helpers are enough:

    tf32_round(x)   x rounded to TF32 (10 mantissa bits), returned as a float32 value:
                    ``cvt.rna.tf32.f32``.
    tf32_round_finite(x)
                    the same rounding for a finite x, done on the bits (add half of
                    TF32's last place, clear the 13 bits TF32 drops): two integer
                    instructions where sm_90 spends about five on the cvt. A NaN's bits
                    may round to anything, so callers use it only on values that a NaN
                    elsewhere already poisons (forward v6's P~, whose NaNs reach l).
    mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
                    one warp-wide D = A B + C with A 16x8 (row-major), B 8x8 (column-major),
                    C and D 16x8, all accumulated in float32:
                    ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``.
                    Every lane of the warp passes its own fragment registers.

Fragment layout of m16n8k8 (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), for the
lane ``lane``, with ``g = lane // 4`` (the "group", 0..7) and ``t = lane % 4`` (0..3):

    A (16 x 8):  a0 = A[g, t]      a1 = A[g + 8, t]     a2 = A[g, t + 4]   a3 = A[g + 8, t + 4]
    B (8 x 8):   b0 = B[t, g]      b1 = B[t + 4, g]
    C, D (16x8): c0 = C[g, 2t]     c1 = C[g, 2t + 1]    c2 = C[g + 8, 2t]  c3 = C[g + 8, 2t + 1]

For float16 inputs (forward v7) the tensor cores multiply float16 values exactly and add
in float32, 16 products deep:

    mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
                    D = A B + C with A 16x16 (row-major), B 16x8 (column-major), C and D
                    16x8 in float32: ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``.
                    a0..a3 and b0, b1 are 32-bit words, each holding two float16 values
                    (the lower column or row in the low 16 bits).
    pack_f16x2(lo, hi) -> word
                    two float32 values rounded to float16 (to nearest even) and packed
                    into one 32-bit word, ``lo`` in the low half: ``cvt.rn.f16x2.f32``.
    load_b32(A, n)  the 32-bit word holding A[n] and A[n + 1] of a 1D float16 array (a
                    shared tile; or a uint16 array of bfloat16 bits), in one 4-byte load;
                    n must be even and A's data 4-byte aligned. No bounds check.

bfloat16 (8 significant bits, float32's exponent range) has the same fragment layout and
its own instructions; Numba has no bfloat16 type, so its values travel as their 16 bits
(uint16, kernels/halves.py):

    mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
                    as mma_f16, each word two bfloat16 values:
                    ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``.
    pack_bf16x2(lo, hi) -> word
                    as pack_f16x2, to bfloat16 (to nearest even): ``cvt.rn.bf16x2.f32``.
    f32_from_bits(u) -> float32
                    the float32 whose bits are the uint32 u (an LLVM bitcast, no
                    instruction): a bfloat16 widened, its bits shifted up 16.

Fragment layout of m16n8k16 with float16 A and B (PTX ISA, "Matrix Fragments for
mma.m16n8k16", .f16), g and t as above, each word two neighbours of a row of A or of a
column of B:

    A (16 x 16): a0 = A[g, 2t:2t+2]     a1 = A[g + 8, 2t:2t+2]
                 a2 = A[g, 2t+8:2t+10]  a3 = A[g + 8, 2t+8:2t+10]
    B (16 x 8):  b0 = B[2t:2t+2, g]     b1 = B[2t+8:2t+10, g]
    C, D (16x8): as for m16n8k8 above.

Four more helpers, plain LLVM IR rather than PTX (simulated there too):

    flat_load(A, n) the element n places after A's first element in memory, for an
                    array A of any number of dimensions: A.ravel()[n] for a C-contiguous
                    A, without making a view; for a strided view (layout "A", a packed
                    batch's, kernels/sequences.py) the caller computes n from the
                    strides. One address computation, where A[b, r, k] costs Numba's
                    64-bit arithmetic on the shape (about seven multiply-adds a load in
                    forward v6's SASS). No bounds check; the caller keeps n inside.
    flat_load_wide(A, n)
                    the 8 bytes from the element n places after A's first (flat_load's
                    addressing), as a tuple of A's elements: (A[n], A[n + 1]) of a float32
                    array, (A[n], ..., A[n + 3]) of a float16 or uint16 (bfloat16 bits)
                    array, in ONE 8-byte load (``ld.global.v2.f32`` / ``ld.global.v4.u16``
                    in the split-KV kernel's PTX) instead of two or four: that kernel's
                    loads of the caches. n must be a multiple of the tuple's length and A's
                    first element 8-byte aligned (on a GPU a misaligned vector load faults;
                    the simulator's stand-in raises). No bounds check.
    load_pair(A, n) -> (A[n], A[n + 1]), and store_pair(A, n, x, y): A[n], A[n + 1] = x, y
                    for a 1D float32 array (forward v6's shared tiles), as ONE 8-byte
                    access (LDS.64 / STS.64 in SASS) instead of two: n must be even and
                    A's data 8-byte aligned. No bounds check.

Two for asynchronous copies from global to shared memory (sm_80 and later; forward v9):

    cp_async(S, n, A, m)
                    start copying the float32 element m places after A's first (as
                    flat_load: A.ravel()[m] for a C-contiguous A) from global memory into S[n] (a 1D float32 array in shared memory),
                    without waiting for it and without a register: ``cp.async.ca.shared.
                    global`` of 4 bytes. The shared address is S's generic address
                    converted with ``cvta.to.shared``. No bounds check.
    cp_async_wait_all()
                    wait until every copy this thread has started has landed; they are
                    then visible to this thread (to others only after a barrier):
                    ``cp.async.wait_all``.

Six more for forward v10 (sm_80 and later): matrix fragments loaded from shared memory
by ldmatrix, and 16-byte asynchronous copies waited for in groups (double buffering):

    ldmatrix_x4(S, n) -> (r0, r1, r2, r3)
                    four 8 x 8 matrices of 16-bit values from shared memory, one 32-bit
                    register of each per lane: ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``.
                    A warp collective: every lane passes a 1D float16 (or uint16) shared
                    array S and the index n of ONE ROW of 8 values, S[n:n + 8] (16 bytes,
                    16-byte aligned: n a multiple of 8 and S's data 16-byte aligned). Lanes
                    8m to 8m + 7 give the rows 0 to 7 of matrix m (m = 0..3). Register rm
                    of lane ``lane`` (g = lane // 4, t = lane % 4, as above) holds
                    M_m[g, 2t] (low half) and M_m[g, 2t + 1]: row g of matrix m, the pair
                    of columns 2t, 2t + 1. That is an m16n8k16 operand's layout: with M_m
                    = rows of Kj (keys) by 8 head-dim columns, rm is a B word (b0 or b1)
                    of S = Q Kj^T, and four matrices are the b0, b1 of two n-tiles.
    ldmatrix_x4_trans(S, n) -> (r0, r1, r2, r3)
                    the same rows, each matrix transposed on the way:
                    ``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16``. Register rm of lane
                    (g, t) holds M_m[2t, g] (low half) and M_m[2t + 1, g]: column g, rows
                    2t and 2t + 1. With M_m = 8 keys of Vj (row-major, as V is stored) by 8
                    of its columns, rm is a B word of P~ Vj (B[k, n] = Vj[k, n]: two keys,
                    one column), so Vj needs no transposed copy.
    cp_async16(S, n, A, m)
                    start copying the 8 float16 (or uint16) values from the element m
                    places after A's first (flat_load's addressing) into S[n:n + 8] (a 1D
                    shared array), 16 bytes, without a register and bypassing L1:
                    ``cp.async.cg.shared.global`` of 16 bytes. Both addresses must be
                    16-byte aligned (on a GPU a misaligned copy faults; the simulator's
                    stand-in raises). No bounds check.
    cp_async_commit()
                    close the group of this thread's copies started since the last commit:
                    ``cp.async.commit_group``.
    cp_async_wait_group(N)
                    wait until at most N (a constant) of this thread's committed groups
                    are still in flight, the newest ones: ``cp.async.wait_group N``. The
                    copies of the older groups are then visible to this thread (to others
                    after a barrier).
    is_aligned16(A) whether A's first element lies at a 16-byte aligned address (the
                    condition of cp_async16 on a row of A); plain LLVM IR.

Two for the online softmax of the tensor-core forwards (kernels/forward/mma_rows.py), each
one instruction where Numba's own spends several:

    exp2_approx(x)  2^x for a float32 x: ``ex2.approx.ftz.f32``, the hardware's exp2
                    (MUFU.EX2, at most 2 ulp from 2^x). ``math.exp2`` runs the same
                    instruction, wrapped in a test and two multiplies that keep results
                    below 2^-126 as float32 subnormals; here those flush to 0 (a term below
                    2^-126 of a row sum that is at least 1 changes no bit of it), and
                    2^-inf is 0, so masked scores need no test of their own.
    fmax(x, y)      the larger of two float32 values, the other one if either is NaN:
                    ``max.f32``, one FMNMX where ``y if y > x else x`` is a compare and
                    a select.

One for the packed batches (kernels/sequences.py):

    warp_min_i32(x) the smallest of the 32 lanes' int32 values, in every lane:
                    ``redux.sync.min.s32`` over the full warp (sm_80 and later; every
                    lane of the warp must execute it). Its point is not the minimum: a
                    packed-batch kernel passes values that are the same in every lane
                    but read from memory (a K/V tile loop's bounds, from cu_seqlens)
                    through it, and ptxas then knows they are the same in every lane
                    and keeps the loop in Hopper's uniform registers; as a value read
                    from memory it moved the loop and everything computed from its
                    index into per-lane registers, 70 more of them in a build of forward
                    v8 without its per-sequence views
                    (lab/runs/2026-12-05/varlen_registers_probe.txt). Backward v9's packed
                    build uses it.

Three device functions on top of them: ``split_tf32(x)`` -> (big, small), its finite-only
twin ``split_tf32_finite``, and ``mma3_split_b``, forward v3's and backward v5's 3xTF32
product of an A given split and a B split on the way in.

3xTF32: TF32 keeps only 10 of float32's 23 mantissa bits, so a product of TF32 values is
not float32-accurate. Splitting each operand as x = big + small (big = tf32(x),
small = tf32(x - big)) and summing big*big + big*small + small*big (the small*small term
is below float32's precision) recovers float32 accuracy at three tensor-core products per
one; this is what PyTorch's float32 "efficient" attention does on sm80+.
"""

from llvmlite import ir
from numba import cuda, types
from numba.core import cgutils
from numba.cuda.extending import intrinsic

from . import simulating

_F32 = ir.FloatType()
_I32 = ir.IntType(32)


@intrinsic
def exp2_approx(typingctx, x):
    """2^x for a float32 x by the hardware's exp2 alone: ``ex2.approx.ftz.f32`` (module
    docstring)."""
    if x != types.float32:
        return None
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_F32, [_F32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.nvvm.ex2.approx.ftz.f")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def fmax(typingctx, x, y):
    """The larger of two float32 values, the other one if either is NaN: ``max.f32``
    (module docstring)."""
    if x != types.float32 or y != types.float32:
        return None
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_F32, [_F32, _F32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.maxnum.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def warp_min_i32(typingctx, x):
    """The smallest of the warp's 32 int32 values ``x``, in every lane:
    ``redux.sync.min.s32`` with the full mask (module docstring)."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.int32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.int32)
        redux = ir.InlineAsm(ir.FunctionType(_I32, [_I32]),
                             "redux.sync.min.s32 $0, $1, 0xffffffff;", "=r,r")
        return builder.call(redux, [value])

    return sig, codegen


@intrinsic
def tf32_round(typingctx, x):
    """x rounded to the nearest TF32 value (ties away from zero), as a float32."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        cvt = ir.InlineAsm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
        return builder.bitcast(builder.call(cvt, args), _F32)

    return sig, codegen


@intrinsic
def tf32_round_finite(typingctx, x):
    """x rounded to the nearest TF32 value (ties away from zero), for finite x only."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        bits = builder.bitcast(args[0], _I32)
        bits = builder.add(bits, ir.Constant(_I32, 0x1000))         # half of TF32's last place
        bits = builder.and_(bits, ir.Constant(_I32, -0x2000))       # 0xFFFFE000: keep 10 bits
        return builder.bitcast(bits, _F32)

    return sig, codegen


@intrinsic
def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3) = A B + C for one m16n8k8 TF32 tile; see the module docstring."""
    f32 = types.float32
    sig = types.UniTuple(f32, 4)(f32, f32, f32, f32, f32, f32, f32, f32, f32, f32)

    def codegen(context, builder, sig, args):
        ab = [builder.bitcast(a, _I32) for a in args[:6]]       # A and B travel as .b32
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
        mma = ir.InlineAsm(
            fnty,
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        res = builder.call(mma, ab + list(args[6:]))
        vals = [builder.extract_value(res, i) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, vals)

    return sig, codegen


def _mma_m16n8k16(kind):
    """The intrinsic (d0, d1, d2, d3) = A B + C for one m16n8k16 tile of ``kind`` ("f16"
    or "bf16") inputs, float32 accumulators; see the module docstring."""

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        f32, u32 = types.float32, types.uint32
        sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            asm = ir.InlineAsm(
                fnty,
                f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, list(args))
            vals = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return mma


def _pack_x2(kind):
    """The intrinsic word = lo and hi rounded to ``kind`` ("f16" or "bf16", to nearest
    even) and packed into one 32-bit word, lo in the low half."""

    @intrinsic
    def pack(typingctx, lo, hi):
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            # PTX puts its first source operand in the upper half.
            cvt = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                               f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(cvt, [args[1], args[0]])

        return sig, codegen

    return pack


mma_f16 = _mma_m16n8k16("f16")
mma_bf16 = _mma_m16n8k16("bf16")
pack_f16x2 = _pack_x2("f16")
pack_bf16x2 = _pack_x2("bf16")


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose bits are the uint32 u."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


@intrinsic
def load_b32(typingctx, A, n):
    """The word holding A[n] and A[n + 1] of a 1D float16 (or uint16) array (module
    docstring)."""
    if not (isinstance(A, types.Array) and A.dtype in (types.float16, types.uint16)
            and A.ndim == 1
            and isinstance(n, types.Integer)):
        return None
    sig = types.uint32(A, n)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        word = builder.bitcast(builder.gep(data, [args[1]]), _I32.as_pointer())
        return builder.load(word, align=4)

    return sig, codegen


@intrinsic
def flat_load(typingctx, A, n):
    """The element n places after A's first in memory (see the module docstring)."""
    if (not isinstance(A, types.Array) or A.layout not in ("C", "A")
            or not isinstance(n, types.Integer)):
        return None
    sig = A.dtype(A, n)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load(builder.gep(array.data, [args[1]]))

    return sig, codegen


@intrinsic
def flat_load_wide(typingctx, A, n):
    """The 8 bytes from the element n places after A's first, as a tuple of A's elements
    (2 float32, or 4 float16 or uint16), in one load (see the module docstring)."""
    if (not isinstance(A, types.Array) or A.layout not in ("C", "A")
            or A.dtype not in (types.float32, types.float16, types.uint16)
            or not isinstance(n, types.Integer)):
        return None
    count = 64 // A.dtype.bitwidth
    sig = types.UniTuple(A.dtype, count)(A, n)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        vector = ir.VectorType(context.get_value_type(sig.args[0].dtype), count)
        at = builder.bitcast(builder.gep(array.data, [args[1]]), vector.as_pointer())
        loaded = builder.load(at, align=8)
        values = [builder.extract_element(loaded, ir.Constant(_I32, i)) for i in range(count)]
        return context.make_tuple(builder, sig.return_type, values)

    return sig, codegen


_F32x2 = ir.VectorType(_F32, 2)


def _pair_pointer(context, builder, array_type, array, n):
    """A <2 x float>* to A[n] (8-byte aligned by the caller's contract)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [n]), _F32x2.as_pointer())


@intrinsic
def load_pair(typingctx, A, n):
    """(A[n], A[n + 1]) in one 8-byte load (see the module docstring)."""
    if not (isinstance(A, types.Array) and A.dtype == types.float32 and A.ndim == 1
            and isinstance(n, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 2)(A, n)

    def codegen(context, builder, sig, args):
        pair = builder.load(_pair_pointer(context, builder, sig.args[0], *args), align=8)
        x, y = (builder.extract_element(pair, ir.Constant(_I32, i)) for i in (0, 1))
        return context.make_tuple(builder, sig.return_type, [x, y])

    return sig, codegen


@intrinsic
def store_pair(typingctx, A, n, x, y):
    """A[n], A[n + 1] = x, y in one 8-byte store (see the module docstring)."""
    if not (isinstance(A, types.Array) and A.dtype == types.float32 and A.ndim == 1
            and isinstance(n, types.Integer) and x == types.float32 and y == types.float32):
        return None
    sig = types.void(A, n, x, y)

    def codegen(context, builder, sig, args):
        pair = ir.Constant(_F32x2, ir.Undefined)
        pair = builder.insert_element(pair, args[2], ir.Constant(_I32, 0))
        pair = builder.insert_element(pair, args[3], ir.Constant(_I32, 1))
        builder.store(pair, _pair_pointer(context, builder, sig.args[0], args[0], args[1]),
                      align=8)
        return context.get_dummy_value()

    return sig, codegen


# The 3xTF32 splits (every tensor-core kernel) and the product of forward v3 and backward
# v5, which split every operand where they read it (forward v6 and backward v6 have their
# own products, of operands split beforehand).


@cuda.jit(device=True, inline=True)
def split_tf32(x):
    """x = big + small with both TF32 (3xTF32)."""
    big = tf32_round(x)
    return big, tf32_round(x - big)


@cuda.jit(device=True, inline=True)
def split_tf32_finite(x):
    """split_tf32 for a finite x, on the bits (tf32_round_finite): the same parts."""
    big = tf32_round_finite(x)
    return big, tf32_round_finite(x - big)


@cuda.jit(device=True, inline=True)
def mma3_split_b(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0, b1, c0, c1, c2, c3,
                 e0, e1, e2, e3):
    """3xTF32 A B for one m16n8k8 tile, with A given split (big, small) and B split
    here: big*big is added to C, small*big + big*small to E. The small terms need their
    own accumulator: the tensor cores round their float32 sums more coarsely than an FMA
    does, and added into C they were lost (forward v3 had 2.3x the error of a float32
    matmul without this)."""
    b0b, b0s = split_tf32(b0)
    b1b, b1s = split_tf32(b1)
    e0, e1, e2, e3 = mma_tf32(a0s, a1s, a2s, a3s, b0b, b1b, e0, e1, e2, e3)
    e0, e1, e2, e3 = mma_tf32(a0b, a1b, a2b, a3b, b0s, b1s, e0, e1, e2, e3)
    c0, c1, c2, c3 = mma_tf32(a0b, a1b, a2b, a3b, b0b, b1b, c0, c1, c2, c3)
    return c0, c1, c2, c3, e0, e1, e2, e3


def _element(context, builder, array_type, array, index):
    """A pointer to the element ``index`` places after the first of an array argument."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [index])


def _no_operand(text):
    """The intrinsic that emits the PTX ``text``, with no operands, as a memory barrier for
    the compiler (nothing is moved across it): the waits and commits of cp.async."""

    @intrinsic
    def emit(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    return emit


def _cp_async(dtypes, copy):
    """The intrinsic (S, n, A, m) that starts the asynchronous copy ``copy`` (its PTX, with
    [$0] the 32-bit shared address of S[n] and [$1] the global address of A's element m) for S a
    1D shared array and A an array (C-contiguous or a view) of one of ``dtypes``, the same
    for both (module docstring)."""

    @intrinsic
    def start(typingctx, S, n, A, m):
        if not (isinstance(S, types.Array) and S.dtype in dtypes and S.ndim == 1
                and isinstance(A, types.Array) and A.dtype == S.dtype
                and A.layout in ("C", "A")
                and isinstance(n, types.Integer) and isinstance(m, types.Integer)):
            return None
        sig = types.void(S, n, A, m)

        def codegen(context, builder, sig, args):
            dst = _shared_address(context, builder, sig.args[0], args[0], args[1])
            src = _element(context, builder, sig.args[2], args[2], args[3])
            fnty = ir.FunctionType(ir.VoidType(), [dst.type, src.type])
            asm = ir.InlineAsm(fnty, copy, "r,l,~{memory}", side_effect=True)
            builder.call(asm, [dst, src])
            return context.get_dummy_value()

        return sig, codegen

    return start


def _shared_address(context, builder, array_type, array, index):
    """The 32-bit shared-memory address (what ldmatrix and cp.async take) of element
    ``index`` of a 1D shared array: its first element's generic address converted once
    (cvta.to.shared, an inline-PTX block without side effects, so that the compiler
    computes it once for all the calls of a kernel), plus index * itemsize in 32-bit
    arithmetic. Adding the index in 64 bits to the generic address before converting, as
    the first version did, cost each ldmatrix a 64-bit add with carry and a move (forward
    v10's SASS, lab/sweeps/sass_half.py); in 32 bits ptxas folds the constant part of an
    index into the instruction's address offset."""
    data = context.make_array(array_type)(context, builder, array).data
    to_shared = ir.InlineAsm(ir.FunctionType(_I32, [data.type]),
                             "{ .reg .u64 sa; cvta.to.shared.u64 sa, $1; cvt.u32.u64 $0, sa; }",
                             "=r,l")
    base = builder.call(to_shared, [data])
    size = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    offset = builder.mul(builder.trunc(index, _I32) if index.type.width > 32
                         else builder.zext(index, _I32) if index.type.width < 32 else index,
                         ir.Constant(_I32, size))
    return builder.add(base, offset)


# Start copying the float32 element m places after A's first into S[n]: 4 bytes through L1
# (forward v9; module docstring).
cp_async = _cp_async((types.float32,), "cp.async.ca.shared.global [$0], [$1], 4;")
# Wait for every copy this thread has started (module docstring).
cp_async_wait_all = _no_operand("cp.async.wait_all;")


# --- forward v10: ldmatrix and 16-byte asynchronous copies ----------------------------------


def _ldmatrix(trans):
    """The intrinsic (r0, r1, r2, r3) = ldmatrix .x4 (``trans``: .trans) of the 16-byte row
    this lane points to (module docstring)."""
    kind = ".trans" if trans else ""

    @intrinsic
    def ldmatrix(typingctx, S, n):
        if not (isinstance(S, types.Array) and S.dtype in (types.float16, types.uint16)
                and S.ndim == 1 and isinstance(n, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(S, n)

        def codegen(context, builder, sig, args):
            row = _shared_address(context, builder, sig.args[0], args[0], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [row.type])
            asm = ir.InlineAsm(
                fnty,
                f"ldmatrix.sync.aligned.m8n8.x4{kind}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
                "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            res = builder.call(asm, [row])
            vals = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return ldmatrix


ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4_trans = _ldmatrix(True)


@intrinsic
def movmatrix_trans(typingctx, x):
    """One 8 x 8 matrix of 16-bit values, held by a warp in the m16n8 accumulator's
    layout (lane (g, t) holds M[g, 2t] in the low half of ``x`` and M[g, 2t + 1]), returned
    transposed in the same layout: lane (g, t) gets M[2t, g] (low half) and M[2t + 1, g].
    A warp collective: ``movmatrix.sync.aligned.m8n8.trans.b16`` (sm_75 and later). The
    split-KV decode kernel with the group's rows on the mma's N side
    (kernels/decode/split_kv_mma_t.py) turns P~'s (keys x rows) accumulator words into the
    B operand of O^T = V^T P~^T with it."""
    if not isinstance(x, types.Integer) or x.bitwidth != 32:
        return None
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32]),
                           "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
                           side_effect=True)
        return builder.call(asm, [args[0]])

    return sig, codegen


# Start copying 16 bytes (8 16-bit values) from A's element m into S[n:n + 8], bypassing L1
# (module docstring).
cp_async16 = _cp_async((types.float16, types.uint16), "cp.async.cg.shared.global [$0], [$1], 16;")
# The same copy with the hint that L2 may fetch the 256 aligned bytes around it from DRAM
# (``.L2::256B``, sm_80 and later): a lab switch of the tensor-core decode kernels
# (kernels/decode/split_kv_mma.py's L2_PREFETCH).
cp_async16_l2_256 = _cp_async((types.float16, types.uint16),
                              "cp.async.cg.shared.global.L2::256B [$0], [$1], 16;")
# Close this thread's group of asynchronous copies (module docstring).
cp_async_commit = _no_operand("cp.async.commit_group;")


@intrinsic
def cp_async_wait_group(typingctx, N):
    """Wait until at most N (a constant) of this thread's copy groups are in flight
    (module docstring)."""
    if not isinstance(N, types.IntegerLiteral):
        return None
    count = int(N.literal_value)
    sig = types.void(N)

    def codegen(context, builder, sig, args):
        wait = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                            f"cp.async.wait_group {count};", "~{memory}", side_effect=True)
        builder.call(wait, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def is_aligned16(typingctx, A):
    """Whether A's first element lies at a 16-byte aligned address (module docstring)."""
    if not isinstance(A, types.Array):
        return None
    sig = types.boolean(A)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        low = builder.and_(builder.ptrtoint(data, ir.IntType(64)), ir.Constant(ir.IntType(64), 15))
        return builder.icmp_unsigned("==", low, ir.Constant(ir.IntType(64), 0))

    return sig, codegen


if simulating():
    # The simulator has no inline PTX: it runs kernels/simulated.py's stand-ins, with
    # the same names and semantics (the device functions above call them there).
    from .simulated import (  # noqa: E402,F811
        cp_async, cp_async_wait_all, exp2_approx, f32_from_bits, fmax, flat_load, flat_load_wide, load_b32,
        load_pair, mma_bf16, mma_f16, mma_tf32, pack_bf16x2, pack_f16x2, store_pair,
        tf32_round, tf32_round_finite, warp_min_i32)
    from .simulated import (  # noqa: E402,F811
        cp_async16, cp_async16_l2_256, cp_async_commit, cp_async_wait_group, is_aligned16,
        ldmatrix_x4, ldmatrix_x4_trans, movmatrix_trans)
