"""Can numba-cuda compile inline PTX that only sm_90a (Hopper's arch-specific target) accepts?

Hopper's fastest instructions are "architecture-specific": ``wgmma.mma_async`` (warpgroup
matrix multiply from shared memory descriptors) and ``setmaxnreg`` (move registers between
warpgroups) assemble only for the target ``sm_90a``, not for ``sm_90``. The bulk copies
(``cp.async.bulk``, TMA's ``cp.async.bulk.tensor``) and ``mbarrier`` transaction counts are
plain sm_90. This script checks, on a CPU-only machine, which of them numba-cuda can emit
and get through ptxas:

  1. how numba-cuda picks the target: ``nvrtc.get_arch_option`` (NVVM's ``-arch``),
     ``_Linker`` (nvJitLink's ``-arch``), ``CUDACodeLibrary._ensure_cc`` (what a launch on
     a GPU uses), and the NUMBA_FORCE_CUDA_CC / NUMBA_CUDA_DEFAULT_PTX_CC parser;
  2. compiles small kernels with ``cuda.compile_ptx`` for cc=(9, 0) and cc=(9, 0, "a"),
     also the sm_90 PTX with its ``.target`` line edited to sm_90a, and NVVM's LTOIR
     (``cuda.compile(output="ltoir")``, what ``cuda.jit(lto=True)`` links) for both;
  3. links each with nvJitLink (its built-in ptxas; the wheels ship no ptxas binary)
     for -arch=sm_90 and -arch=sm_90a and prints what worked, ptxas's exact messages and
     its notes on setmaxnreg (C7504 / C7508: "setmaxnreg ignored");
  4. builds the warp-specialised skeleton through the @cuda.jit dispatcher's own code
     (with and without lto=True) for a stand-in H100/H200 device, to show what a launch
     on a real GPU would compile and link for.

Run (no GPU needed):

    NUMBA_ENABLE_CUDASIM=0 .venv/bin/python scripts/sm90a_probe.py

The kernels are never launched; the operands (descriptors, addresses) are only made well
formed enough for ptxas to type-check them.
"""

import inspect
import os
import re
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("sm90a_probe.py needs NUMBA_ENABLE_CUDASIM=0: the simulator cannot compile")

import numba  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import cuda, types  # noqa: E402
from numba.core.extending import intrinsic  # noqa: E402
from numba.types import float16  # noqa: E402  (numba's own module has no float16)

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
VOID = ir.VoidType()


# --------------------------------------------------------------------------------------
# A small helper: call one block of inline PTX.
# --------------------------------------------------------------------------------------

def call_asm(builder, text, constraints, out_types, args):
    """Emit ``text`` as inline PTX. ``out_types`` lists the LLVM types of the outputs
    (none: a void asm with side effects). Returns the list of output values."""
    if not out_types:
        ret = VOID
    elif len(out_types) == 1:
        ret = out_types[0]
    else:
        ret = ir.LiteralStructType(out_types)
    fnty = ir.FunctionType(ret, [a.type for a in args])
    res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)
    if not out_types:
        return []
    if len(out_types) == 1:
        return [res]
    return [builder.extract_value(res, i) for i in range(len(out_types))]


def void_asm(text):
    """An intrinsic with no operands that emits ``text`` (a fence, a wait, setmaxnreg)."""
    @intrinsic
    def emit(typingctx):
        def codegen(context, builder, sig, args):
            call_asm(builder, text, "~{memory}", [], [])
            return context.get_dummy_value()
        return types.void(), codegen
    return emit


# Warpgroup register reallocation (sm_90a only). The count is an immediate in 24..256, a
# multiple of 8; every thread of the warpgroup executes it.
setmaxnreg_inc_232 = void_asm("setmaxnreg.inc.sync.aligned.u32 232;")
setmaxnreg_dec_40 = void_asm("setmaxnreg.dec.sync.aligned.u32 40;")

# wgmma bookkeeping (sm_90a only): fence before the first wgmma that reads registers
# written by other instructions, commit the issued wgmma into a group, wait for groups.
wgmma_fence = void_asm("wgmma.fence.sync.aligned;")
wgmma_commit = void_asm("wgmma.commit_group.sync.aligned;")
wgmma_wait0 = void_asm("wgmma.wait_group.sync.aligned 0;")

# Make mbarrier.init visible to the async proxy (the bulk copies) before they use it.
fence_barrier_init = void_asm("fence.mbarrier_init.release.cluster;")


@intrinsic
def shared_address(typingctx, arr):
    """The 32-bit shared-window address of a shared array's first element
    (``cvta.to.shared`` of its generic address)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ptr = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.ptrtoint(ptr, I64)
        return call_asm(builder, "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }",
                        "=r,l", [I32], [ptr])[0]
    return types.uint32(arr), codegen


@intrinsic
def global_address(typingctx, arr):
    """The 64-bit generic address of an array's first element (for a TMA tensor map held
    in global memory, or a bulk copy's source)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ptr = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(ptr, I64)
    return types.uint64(arr), codegen


# --------------------------------------------------------------------------------------
# wgmma.mma_async: D (64 x N, float32, spread over the 128 threads of a warpgroup) += A B.
# A and B are read from shared memory through 64-bit matrix descriptors (the "SS" form),
# or A from registers (the "RS" form). With N = 64 each thread holds 32 accumulators,
# passed in and out as a UniTuple(float32, 32): the outputs are tied to the inputs
# ("0", "1", ... constraints), so ptxas sees one register per accumulator.
# --------------------------------------------------------------------------------------

N_ACC = 32
ACC = types.UniTuple(types.float32, N_ACC)


def accumulator_operands(count=N_ACC):
    regs = ", ".join(f"${i}" for i in range(count))
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)])
    return "{" + regs + "}", constraints


def wgmma_ss(kind, n=64):
    """An intrinsic (acc, desc_a, desc_b, scale_d) -> acc for one SS wgmma of ``kind``:
    "f16" (m64nNk16, float16 inputs) or "tf32" (m64nNk8), N = ``n``; acc is a
    UniTuple(float32, n // 2). scale_d = 0 ignores acc."""
    count = n // 2
    acc_t = types.UniTuple(types.float32, count)
    regs, constraints = accumulator_operands(count)
    a, b, s = f"${2 * count}", f"${2 * count + 1}", f"${2 * count + 2}"
    if kind == "f16":   # imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b
        tail, shape = "1, 1, 0, 0", f"m64n{n}k16.f32.f16.f16"
    else:               # tf32 takes no transpose immediates (K-major only)
        tail, shape = "1, 1", f"m64n{n}k8.f32.tf32.tf32"
    text = ("{ .reg .pred p; setp.ne.b32 p, " + s + ", 0;\n\t"
            f"wgmma.mma_async.sync.aligned.{shape} {regs}, {a}, {b}, p, {tail}; }}")
    constraints += ",l,l,r,~{memory}"

    @intrinsic
    def mma(typingctx, acc, desc_a, desc_b, scale_d):
        sig = acc_t(acc_t, types.uint64, types.uint64, types.uint32)

        def codegen(context, builder, sig, args):
            accs = [builder.extract_value(args[0], i) for i in range(count)]
            outs = call_asm(builder, text, constraints, [F32] * count, accs + list(args[1:]))
            return context.make_tuple(builder, sig.return_type, outs)
        return sig, codegen
    return mma


def wgmma_rs(kind):
    """An intrinsic (acc, a0, a1, a2, a3, desc_b, scale_d) -> acc: A from registers (four
    32-bit words a thread holds of the 64 x K tile), B from shared memory. For "f16" a word
    packs two float16 values; for "tf32" it is one float32 value's bits."""
    regs, constraints = accumulator_operands()
    base = 2 * N_ACC
    a = "{" + ", ".join(f"${base + i}" for i in range(4)) + "}"
    b, s = f"${base + 4}", f"${base + 5}"
    if kind == "f16":   # imm-scale-a, imm-scale-b, imm-trans-b
        tail, shape = "1, 1, 0", "m64n64k16.f32.f16.f16"
    else:
        tail, shape = "1, 1", "m64n64k8.f32.tf32.tf32"
    text = ("{ .reg .pred p; setp.ne.b32 p, " + s + ", 0;\n\t"
            f"wgmma.mma_async.sync.aligned.{shape} {regs}, {a}, {b}, p, {tail}; }}")
    constraints += ",r,r,r,r,l,r,~{memory}"

    @intrinsic
    def mma(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
        u32 = types.uint32
        sig = ACC(ACC, u32, u32, u32, u32, types.uint64, u32)

        def codegen(context, builder, sig, args):
            accs = [builder.extract_value(args[0], i) for i in range(N_ACC)]
            outs = call_asm(builder, text, constraints, [F32] * N_ACC, accs + list(args[1:]))
            return context.make_tuple(builder, sig.return_type, outs)
        return sig, codegen
    return mma


def zeros(count):
    """An intrinsic () -> a UniTuple(float32, count) of zeros (Numba cannot repeat a
    tuple)."""
    @intrinsic
    def make(typingctx):
        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, sig.return_type,
                                      [ir.Constant(F32, 0.0)] * count)
        return types.UniTuple(types.float32, count)(), codegen
    return make


zero_accumulators = zeros(N_ACC)


wgmma_f16_ss = wgmma_ss("f16")
wgmma_tf32_ss = wgmma_ss("tf32")
wgmma_f16_rs = wgmma_rs("f16")
wgmma_tf32_rs = wgmma_rs("tf32")


@intrinsic
def wgmma_sp_f16(typingctx, desc_a, desc_b, meta):
    """Sparse wgmma (2:4 structured A): m64n8k32, float16 in, float32 out, 4 accumulators
    a thread, scale_d off; ``meta`` is the sparsity metadata word, selector 0."""
    sig = types.UniTuple(types.float32, 4)(types.uint64, types.uint64, types.uint32)
    text = ("wgmma.mma_async.sp.sync.aligned.m64n8k32.f32.f16.f16 "
            "{$0, $1, $2, $3}, $4, $5, $6, 0, 0, 1, 1, 0, 0;")

    def codegen(context, builder, sig, args):
        outs = call_asm(builder, text, "=f,=f,=f,=f,l,l,r,~{memory}", [F32] * 4, list(args))
        return context.make_tuple(builder, sig.return_type, outs)
    return sig, codegen


def mma_sp(opcode):
    """Warp-level sparse mma (sm_80+): m16n8k16, float16 A (2:4 sparse: 2 words) and B
    (2 words), float32 C/D, metadata word ``e``, selector 0."""
    text = (f"{opcode}.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{$0, $1, $2, $3}, {$4, $5}, {$6, $7}, {$8, $9, $10, $11}, $12, 0x0;")

    @intrinsic
    def mma(typingctx, a0, a1, b0, b1, c0, c1, c2, c3, e):
        u32, f32 = types.uint32, types.float32
        sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, f32, f32, f32, f32, u32)

        def codegen(context, builder, sig, args):
            outs = call_asm(builder, text, "=f,=f,=f,=f,r,r,r,r,f,f,f,f,r", [F32] * 4,
                            list(args))
            return context.make_tuple(builder, sig.return_type, outs)
        return sig, codegen
    return mma


mma_sp_f16 = mma_sp("mma.sp")
mma_sp_ordered_f16 = mma_sp("mma.sp::ordered_metadata")


# --------------------------------------------------------------------------------------
# mbarrier and bulk copies (plain sm_90): a producer thread arms a barrier with the number
# of bytes to expect, starts bulk copies that count their bytes down on it, and consumers
# wait on the barrier's phase.
# --------------------------------------------------------------------------------------

@intrinsic
def mbarrier_init(typingctx, bar, count):
    sig = types.void(types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        call_asm(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}", [],
                 list(args))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mbarrier_arrive_expect_tx(typingctx, bar, nbytes):
    sig = types.void(types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        call_asm(builder, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                 "r,r,~{memory}", [], list(args))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mbarrier_wait(typingctx, bar, parity):
    """Spin until the barrier's phase with this parity has completed (try_wait loop;
    ``${:uid}`` gives each inlined copy its own label)."""
    sig = types.void(types.uint32, types.uint32)
    text = ("{ .reg .pred done;\n"
            "WAIT_${:uid}:\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n\t"
            "@!done bra WAIT_${:uid}; }")

    def codegen(context, builder, sig, args):
        call_asm(builder, text, "r,r,~{memory}", [], list(args))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def bulk_copy_to_shared(typingctx, dst, src, nbytes, bar):
    """1D bulk copy (no tensor map): nbytes (a multiple of 16) from the global address src
    to the shared address dst, completing on the barrier."""
    sig = types.void(types.uint32, types.uint64, types.uint32, types.uint32)
    text = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
            "[$0], [$1], $2, [$3];")

    def codegen(context, builder, sig, args):
        call_asm(builder, text, "r,l,r,r,~{memory}", [], list(args))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def tma_load_2d(typingctx, dst, tensor_map, x, y, bar):
    """TMA: the box at coordinates (x, y) of the tensor described by the 128-byte tensor
    map at generic address tensor_map (here a global array; a CUtensorMap made on the host
    with cuTensorMapEncodeTiled), into shared memory at dst, completing on the barrier."""
    sig = types.void(types.uint32, types.uint64, types.int32, types.int32, types.uint32)
    text = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
            "[$0], [$1, {$2, $3}], [$4];")

    def codegen(context, builder, sig, args):
        call_asm(builder, text, "r,l,r,r,r,~{memory}", [], list(args))
        return context.get_dummy_value()
    return sig, codegen


# --------------------------------------------------------------------------------------
# Kernels. Each is compiled, never launched.
# --------------------------------------------------------------------------------------

def descriptor(addr, lead_bytes, stride_bytes):
    """A wgmma shared-memory matrix descriptor without swizzling: start address, leading
    and stride byte offsets, each in units of 16 bytes (bits 0-13, 16-29, 32-45)."""
    d = numba.uint64((addr & 0x3FFFF) >> 4)
    d |= numba.uint64((lead_bytes & 0x3FFFF) >> 4) << numba.uint64(16)
    d |= numba.uint64((stride_bytes & 0x3FFFF) >> 4) << numba.uint64(32)
    return d


descriptor_dev = cuda.jit(device=True, inline=True)(descriptor)


def k_setmaxnreg_and_fence(out):
    """The minimal sm_90a-only kernel the question names."""
    setmaxnreg_inc_232()
    wgmma_fence()
    out[0] = 1.0


def k_wgmma_f16_ss(out, scale):
    """Two chained SS wgmma (float16), accumulators stored to out."""
    A = cuda.shared.array(64 * 16, float16)
    B = cuda.shared.array(64 * 16, float16)
    da = descriptor_dev(shared_address(A), 128, 256)
    db = descriptor_dev(shared_address(B), 128, 256)
    acc = zero_accumulators()
    wgmma_fence()
    acc = wgmma_f16_ss(acc, da, db, numba.uint32(0))
    acc = wgmma_f16_ss(acc, da + numba.uint64(2), db + numba.uint64(2), numba.uint32(1))
    wgmma_commit()
    wgmma_wait0()
    t = cuda.threadIdx.x
    for i in range(N_ACC):
        out[t, i] = acc[i] * scale


def k_wgmma_tf32_3x(out, Ab, As):
    """3xTF32 with wgmma: D = Ab Bb + Ab Bs + As Bb, A (big and small parts) from registers
    (RS form), B's two parts from shared memory. Three wgmma per product."""
    Bb = cuda.shared.array(64 * 8, numba.float32)
    Bs = cuda.shared.array(64 * 8, numba.float32)
    db_big = descriptor_dev(shared_address(Bb), 128, 256)
    db_small = descriptor_dev(shared_address(Bs), 128, 256)
    t = cuda.threadIdx.x
    a = cuda.libdevice.float_as_int  # the words travel as 32-bit registers
    ab0, ab1, ab2, ab3 = (numba.uint32(a(Ab[t, 0])), numba.uint32(a(Ab[t, 1])),
                          numba.uint32(a(Ab[t, 2])), numba.uint32(a(Ab[t, 3])))
    as0, as1, as2, as3 = (numba.uint32(a(As[t, 0])), numba.uint32(a(As[t, 1])),
                          numba.uint32(a(As[t, 2])), numba.uint32(a(As[t, 3])))
    acc = zero_accumulators()
    wgmma_fence()
    acc = wgmma_tf32_rs(acc, as0, as1, as2, as3, db_big, numba.uint32(0))    # small x big
    acc = wgmma_tf32_rs(acc, ab0, ab1, ab2, ab3, db_small, numba.uint32(1))  # big x small
    acc = wgmma_tf32_rs(acc, ab0, ab1, ab2, ab3, db_big, numba.uint32(1))    # big x big
    wgmma_commit()
    wgmma_wait0()
    for i in range(N_ACC):
        out[t, i] = acc[i]


def k_wgmma_tf32_ss(out):
    """One SS wgmma with tf32 inputs (both operands in shared memory)."""
    A = cuda.shared.array(64 * 8, numba.float32)
    B = cuda.shared.array(64 * 8, numba.float32)
    da = descriptor_dev(shared_address(A), 128, 256)
    db = descriptor_dev(shared_address(B), 128, 256)
    acc = zero_accumulators()
    wgmma_fence()
    acc = wgmma_tf32_ss(acc, da, db, numba.uint32(0))
    wgmma_commit()
    wgmma_wait0()
    t = cuda.threadIdx.x
    for i in range(N_ACC):
        out[t, i] = acc[i]


def k_wgmma_f16_rs(out, P):
    """The RS form with float16 (FlashAttention-3's P V: P stays in registers)."""
    V = cuda.shared.array(64 * 16, float16)
    db = descriptor_dev(shared_address(V), 128, 256)
    t = cuda.threadIdx.x
    acc = zero_accumulators()
    wgmma_fence()
    acc = wgmma_f16_rs(acc, P[t, 0], P[t, 1], P[t, 2], P[t, 3], db, numba.uint32(0))
    wgmma_commit()
    wgmma_wait0()
    for i in range(N_ACC):
        out[t, i] = acc[i]


def k_wgmma_sparse(out, meta):
    A = cuda.shared.array(64 * 16, float16)
    B = cuda.shared.array(32 * 8, float16)
    da = descriptor_dev(shared_address(A), 128, 256)
    db = descriptor_dev(shared_address(B), 128, 256)
    wgmma_fence()
    d0, d1, d2, d3 = wgmma_sp_f16(da, db, meta[0])
    wgmma_commit()
    wgmma_wait0()
    t = cuda.threadIdx.x
    out[t, 0], out[t, 1], out[t, 2], out[t, 3] = d0, d1, d2, d3


def k_mma_sparse(out, w):
    """Warp-level sparse mma (sm_80+), the older and the ordered-metadata spelling."""
    t = cuda.threadIdx.x
    z = numba.float32(0.0)
    d = mma_sp_f16(w[t, 0], w[t, 1], w[t, 2], w[t, 3], z, z, z, z, w[t, 4])
    e = mma_sp_ordered_f16(w[t, 0], w[t, 1], w[t, 2], w[t, 3], d[0], d[1], d[2], d[3],
                           w[t, 4])
    out[t, 0], out[t, 1], out[t, 2], out[t, 3] = e


def k_bulk_and_tma(out, src, tensor_map):
    """Plain sm_90 features: mbarrier with a transaction count, a 1D bulk copy and a 2D
    TMA load, then a wait on the barrier's phase 0."""
    tile = cuda.shared.array(64 * 64, float16)
    bar = cuda.shared.array(1, numba.uint64)
    b = shared_address(bar)
    if cuda.threadIdx.x == 0:
        mbarrier_init(b, numba.uint32(1))
        fence_barrier_init()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        mbarrier_arrive_expect_tx(b, numba.uint32(2 * 64 * 64 * 2))
        bulk_copy_to_shared(shared_address(tile), global_address(src),
                            numba.uint32(64 * 64 * 2), b)
        tma_load_2d(shared_address(tile), global_address(tensor_map),
                    numba.int32(0), numba.int32(0), b)
    mbarrier_wait(b, numba.uint32(0))
    out[cuda.threadIdx.x] = numba.float32(tile[cuda.threadIdx.x])


def k_warp_specialised(out, src, scale):
    """A skeleton of the warp-specialised loop body: warpgroup 0 gives registers away and
    one of its threads starts a bulk copy of a K tile; warpgroups 1 and 2 take registers,
    wait for the tile and run a wgmma on it."""
    A = cuda.shared.array(64 * 16, float16)
    K = cuda.shared.array(64 * 16, float16)
    bar = cuda.shared.array(1, numba.uint64)
    b = shared_address(bar)
    t = cuda.threadIdx.x
    if t == 0:
        mbarrier_init(b, numba.uint32(1))
        fence_barrier_init()
    cuda.syncthreads()
    if t // 128 == 0:                              # producer warpgroup
        setmaxnreg_dec_40()
        if t == 0:
            mbarrier_arrive_expect_tx(b, numba.uint32(64 * 16 * 2))
            bulk_copy_to_shared(shared_address(K), global_address(src),
                                numba.uint32(64 * 16 * 2), b)
    else:                                          # consumer warpgroups
        setmaxnreg_inc_232()
        mbarrier_wait(b, numba.uint32(0))
        da = descriptor_dev(shared_address(A), 128, 256)
        db = descriptor_dev(shared_address(K), 128, 256)
        acc = zero_accumulators()
        wgmma_fence()
        acc = wgmma_f16_ss(acc, da, db, numba.uint32(0))
        wgmma_commit()
        wgmma_wait0()
        for i in range(N_ACC):
            out[t - 128, i] = acc[i] * scale


def arr(dtype, ndim):
    return types.Array(dtype, ndim, "C")


f32, f16, u32, u8 = types.float32, types.float16, types.uint32, types.uint8

# name, function, signature, launch bounds (maxntid), what it needs
KERNELS = [
    ("setmaxnreg+wgmma.fence", k_setmaxnreg_and_fence, (arr(f32, 1),), (384, 1), "sm_90a"),
    ("setmaxnreg, no launch bounds", k_setmaxnreg_and_fence, (arr(f32, 1),), None, "sm_90a"),
    ("wgmma f16 SS m64n64k16 x2", k_wgmma_f16_ss, (arr(f32, 2), f32), (128,), "sm_90a"),
    ("wgmma tf32 SS m64n64k8", k_wgmma_tf32_ss, (arr(f32, 2),), (128,), "sm_90a"),
    ("wgmma tf32 RS 3xTF32", k_wgmma_tf32_3x, (arr(f32, 2), arr(f32, 2), arr(f32, 2)),
     (128,), "sm_90a"),
    ("wgmma f16 RS m64n64k16", k_wgmma_f16_rs, (arr(f32, 2), arr(u32, 2)), (128,), "sm_90a"),
    ("wgmma.sp f16 m64n8k32", k_wgmma_sparse, (arr(f32, 2), arr(u32, 1)), (128,), "sm_90a"),
    ("mma.sp f16 m16n8k16 (warp)", k_mma_sparse, (arr(f32, 2), arr(u32, 2)), (32,), "sm_80+"),
    ("mbarrier+bulk copy+TMA 2d", k_bulk_and_tma, (arr(f32, 1), arr(f16, 2), arr(u8, 1)),
     (128,), "sm_90"),
    ("warp-specialised skeleton", k_warp_specialised, (arr(f32, 2), arr(f16, 2), f32),
     (384, 1), "sm_90a"),
    ("warp-spec., maxntid only", k_warp_specialised, (arr(f32, 2), arr(f16, 2), f32),
     (384,), "sm_90a"),
]


# --------------------------------------------------------------------------------------
# Linking with nvJitLink (ptxas inside).
# --------------------------------------------------------------------------------------

def nvjitlink_link(code, arch, lto=False):
    """Link one input for ``arch`` with nvJitLink: PTX text, or (lto=True) NVVM's LTOIR
    bytes, linked with -lto as numba's _Linker does for cuda.jit(lto=True). Returns
    (ok, cubin bytes or None, log text)."""
    from cuda.bindings import nvjitlink
    options = [f"-arch={arch}", "-verbose"] + (["-lto"] if lto else [])
    handle = nvjitlink.create(len(options), options)
    try:
        if lto:
            kind, data = nvjitlink.InputType.LTOIR, bytes(code)
        else:
            kind, data = nvjitlink.InputType.PTX, code.encode()
        try:
            # nvJitLink runs ptxas on a PTX input as it is added: errors show up here.
            nvjitlink.add_data(handle, kind, data, len(data), "probe")
            nvjitlink.complete(handle)
            ok = True
        except nvjitlink.nvJitLinkError as e:
            ok, raised = False, f"nvJitLinkError: {e}\n"
        size = nvjitlink.get_error_log_size(handle)
        err = bytearray(size)
        nvjitlink.get_error_log(handle, err)
        size = nvjitlink.get_info_log_size(handle)
        info = bytearray(size)
        nvjitlink.get_info_log(handle, info)
        cubin = None
        if ok:
            size = nvjitlink.get_linked_cubin_size(handle)
            cubin = bytearray(size)
            nvjitlink.get_linked_cubin(handle, cubin)
        log = (err.decode(errors="replace") + info.decode(errors="replace")).replace("\x00", "")
        if not ok:
            log = raised + log
        return ok, cubin, log.strip()
    finally:
        nvjitlink.destroy(handle)


def cubin_arch(cubin):
    """The target a cubin names. Its ELF header's e_flags read the same (0x06005a04) for
    sm_90 and sm_90a here, but the cubin carries the target's name as a string."""
    names = sorted(set(re.findall(rb"\bsm_\d+[af]?\b", bytes(cubin))))
    return "naming " + ", ".join(n.decode() for n in names)


def interesting(log):
    """ptxas lines worth printing: errors, warnings and the resource report."""
    keep = []
    for line in log.splitlines():
        line = line.strip()
        if not line or line.startswith("info    : 0 bytes gmem"):
            continue
        if ("error" in line.lower() or "warning" in line.lower() or "Used" in line
                or re.search(r"\(C\d+\)", line) or "Advisory" in line):
            keep.append(line)
    return keep


def target_line(ptx):
    m = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    return m.group(1) if m else "?"


def main():
    from cuda.bindings import nvjitlink
    from numba.cuda import codegen as cuda_codegen
    from numba.cuda import dispatcher as cuda_dispatcher
    from numba.cuda.core import config as cuda_config
    from numba.cuda.cudadrv import driver as cuda_driver
    from numba.cuda.cudadrv import nvrtc, nvvm

    print("== Versions")
    import importlib.metadata as md
    for pkg in ("numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core",
                "nvidia-nvjitlink", "nvidia-nvvm"):
        try:
            print(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg} (not installed)")
    print(f"NVVM IR version {nvvm.NVVM().get_ir_version()}, nvJitLink {nvjitlink.version()}")
    print(f"cuda.is_available(): {cuda.is_available()}")

    print("\n== 1. How numba-cuda picks the target")
    print("nvrtc.get_arch_option(9, 0)      ->", nvrtc.get_arch_option(9, 0),
          "  (NVVM's -arch for cc=(9, 0))")
    print("nvrtc.get_arch_option(9, 0, 'a') ->", nvrtc.get_arch_option(9, 0, "a"),
          "  (cc may be a 3-tuple (major, minor, 'a' or 'f'))")
    print("driver._Linker(cc=(9, 0, 'a')).arch ->", cuda_driver._Linker(cc=(9, 0, "a")).arch,
          "  (nvJitLink's -arch)")
    print("CUDACodeLibrary._ensure_cc (cc when none is given, i.e. a launch on a GPU):")
    for line in inspect.getsource(cuda_codegen.CUDACodeLibrary._ensure_cc).splitlines():
        print("   |", line)
    print("config._parse_cc('9.0a') ->", cuda_config._parse_cc("9.0a"),
          "  (NUMBA_FORCE_CUDA_CC / NUMBA_CUDA_DEFAULT_PTX_CC keep major.minor only)")
    saved = cuda_config.FORCE_CUDA_CC
    cuda_config.FORCE_CUDA_CC = (9, 0)
    print("with NUMBA_FORCE_CUDA_CC=9.0: get_arch_option(9, 0, 'a') ->",
          nvrtc.get_arch_option(9, 0, "a"), "  (forcing drops the 'a')")
    cuda_config.FORCE_CUDA_CC = saved
    print("CUDA_DEFAULT_PTX_CC =", cuda_config.CUDA_DEFAULT_PTX_CC,
          "(compile_ptx's cc when none is given)")

    print("\n== 2 and 3. compile_ptx / LTOIR, then nvJitLink for sm_90 and sm_90a")
    print("Inputs: 'ptx cc=(9,0)' -> .target sm_90; 'ptx cc=(9,0,'a')' -> .target sm_90a;\n"
          "'ptx edited' = the sm_90 PTX with its .target line changed to sm_90a;\n"
          "'ltoir cc=...' = NVVM's LTOIR (cuda.compile(output='ltoir')), linked with -lto.")
    summary = []
    for name, fn, sig, bounds, needs in KERNELS:
        print(f"\n-- {name} (needs {needs}, launch_bounds={bounds})")
        inputs = {}
        for cc in ((9, 0), (9, 0, "a")):
            label = "cc=(" + ",".join(repr(c) if isinstance(c, str) else str(c)
                                      for c in cc) + ")"
            try:
                ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, launch_bounds=bounds)
                inputs["ptx " + label] = (ptx, False)
                print(f"compile_ptx {label:13s}: OK, .target {target_line(ptx)}, "
                      f"{len(ptx)} bytes")
                if cc == (9, 0):
                    edited = re.sub(r"^\.target\s+sm_90\b", ".target sm_90a", ptx,
                                    count=1, flags=re.M)
                    inputs["ptx edited"] = (edited, False)
            except Exception as e:                                   # noqa: BLE001
                print(f"compile_ptx {label:13s}: FAILED {type(e).__name__}: {e}")
        for cc in ((9, 0), (9, 0, "a")):
            label = "cc=(" + ",".join(repr(c) if isinstance(c, str) else str(c)
                                      for c in cc) + ")"
            try:
                ltoir, _ = cuda.compile(fn, sig, cc=cc, launch_bounds=bounds, device=False,
                                        abi="numba", output="ltoir")
                inputs["ltoir " + label] = (ltoir, True)
                print(f"LTOIR       {label:13s}: OK, {len(ltoir)} bytes")
            except Exception as e:                                   # noqa: BLE001
                print(f"LTOIR       {label:13s}: FAILED {type(e).__name__}: {e}")
        for label, (code, lto) in inputs.items():
            for arch in ("sm_90", "sm_90a"):
                ok, cubin, log = nvjitlink_link(code, arch, lto=lto)
                head = f"link {label:18s} -arch={arch:7s}{' -lto' if lto else '     '}: "
                if ok:
                    print(head + "OK, cubin " + cubin_arch(cubin))
                    for line in interesting(log):
                        print("      " + line)
                else:
                    print(head + "FAILED")
                    for line in log.splitlines():
                        print("      " + line)
                summary.append((name, label, arch, ok, interesting(log)))

    print("\n== 4. The @cuda.jit dispatcher with a stand-in cc 9.0 device (what a launch "
          "on an H100/H200 compiles)")

    class FakeDevice:
        compute_capability = (9, 0)
        id = 0

    class FakeContext:
        device = FakeDevice()

    # _Kernel asks the current device for its cc while typing; CUDACodeLibrary asks the
    # current context's device when no cc is given. Both get the stand-in. The kernel is
    # built as the dispatcher builds it, but not bound (binding loads the cubin into a
    # context: get_cufunc passes get_cubin()'s result to ctx.create_module_image).
    cuda_dispatcher.get_current_device = lambda: FakeDevice()
    cuda_codegen.devices.get_context = lambda: FakeContext()
    sig = (arr(f32, 2), arr(f16, 2), f32)
    for options in ({"launch_bounds": (384, 1)}, {"launch_bounds": (384, 1), "lto": True}):
        print(f"\n-- cuda.jit({', '.join(f'{k}={v}' for k, v in options.items())}) "
              "on the warp-specialised skeleton")
        kernel = cuda_dispatcher._Kernel(k_warp_specialised, sig, **options)
        lib = kernel._codelibrary
        cc = lib._ensure_cc(None)
        print("cc the code library picks for the device:", cc)
        if options.get("lto"):
            code = lib.get_ltoir()          # what _link_all adds for lto=True
            print("LTOIR from NVVM -arch=" + nvrtc.get_arch_option(*cc) + f": {len(code)} bytes")
        else:
            code = lib.get_asm_str()        # what _link_all adds otherwise
            print("PTX .target:", target_line(code))
        try:
            cubin = lib.get_cubin()         # numba's own _Linker (cuda.core + nvJitLink)
            data = cubin.code if hasattr(cubin, "code") else cubin
            print("cubin from numba's _Linker:", len(bytes(data)), "bytes,", cubin_arch(data))
        except Exception as e:                                       # noqa: BLE001
            print(f"cubin from numba's _Linker: FAILED {type(e).__name__}: {e}")
        # numba's linker runs without -verbose; the same input and options plus -verbose
        # show what ptxas did with setmaxnreg.
        ok, _, log = nvjitlink_link(code, "sm_90a", lto=bool(options.get("lto")))
        print("same input relinked with -verbose:", "OK" if ok else "FAILED")
        for line in interesting(log):
            print("      " + line)

    print("\n== Summary (kernel | input | nvJitLink -arch | result; setmaxnreg note)")
    for name, label, arch, ok, lines in summary:
        note = ""
        for line in lines:
            m = re.search(r"\((C750\d)\)", line)
            if m:
                note = m.group(1) + " setmaxnreg ignored"
            m = re.search(r"Used (\d+) registers", line)
            if m and ok:
                note += f" [{m.group(1)} registers]"
        print(f"{name:30s} | {label:18s} | {arch:7s} | {'OK' if ok else 'FAILED':6s} {note}")

    print("""
== On a GPU (not run here; what the above implies)
* A plain @cuda.jit kernel launched on a cc 9.0 device already compiles for sm_90a:
  CUDACodeLibrary._ensure_cc turns the device's (9, 0) into (9, 0, 'a'), NVVM gets
  -arch=compute_90a (".target sm_90a") and nvJitLink -arch=sm_90a (section 4). Inline
  wgmma, wgmma.sp, cp.async.bulk(.tensor) and mbarrier need nothing more -- unless
  NUMBA_FORCE_CUDA_CC is set: it holds major.minor only and drops the 'a' (section 1).
* setmaxnreg assembles on that path but ptxas drops it (C7504): nvJitLink compiles a PTX
  input as one of several compilation units. With cuda.jit(lto=True, launch_bounds=
  (threads, 1)) the kernel goes to nvJitLink as LTOIR, ptxas sees the whole program and
  keeps setmaxnreg (168 registers at entry for 384 threads, no C750x note); without the
  minimum-blocks 1 it drops it again (C7508: no register count at entry).
* compile_ptx / cuda.compile need cc=(9, 0, 'a') spelled out: cc=(9, 0) gives sm_90 PTX
  that ptxas rejects for these instructions whatever nvJitLink's -arch; an LTOIR made
  for cc=(9, 0) does link for -arch=sm_90a, since the final PTX is generated at link.
* A PTX or cubin made elsewhere loads with cuda.jit(link=["file.ptx" or "file.cubin"])
  (numba's _Linker adds it to the kernel's own link, -arch=sm_90a on a cc 9.0 device),
  or with cuda.core (ObjectCode.from_cubin, then launch) or the driver's
  cuModuleLoadData. An sm_90a cubin runs only on cc 9.0 devices.""")


if __name__ == "__main__":
    main()
