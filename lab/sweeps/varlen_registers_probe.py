"""Where forward v8's packed-batch build (Variant(varlen=True)) spends its registers: ptxas
for sm_90 (through nvJitLink, as tests/ptx_check.py links), d = 64, default tiles, float32,
C-contiguous arrays in the signature, no causal mask. Registers only: most builds below
compute wrong results on purpose (each takes one piece of the packed prologue away).

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/varlen_registers_probe.py [MODE ...]

Modes (all of them without arguments):

plain           the kernel without varlen
varlen          the packed build as it is in the tree (its per-sequence views)
nocut           ... without the views (``cut`` the identity): the sequence's bounds and
                the shifted offsets from cu_seqlens remain
lengths_param   ... nocut, and the sequence's lengths the arrays' shapes (kernel
                parameters) instead of values read from cu_seqlens
sq_loaded       ... nocut, only Sq read from cu_seqlens (Sk the parameter)
sk_loaded       ... nocut, only Sk read from cu_seqlens (Sq the parameter)
sk_loaded_range_param
                sk_loaded, but the K/V tile loop's range from the parameter (Sk read
                from cu_seqlens everywhere else: staging, masks)
nocut_uniform_range
                nocut, with the K/V tile loop's bounds passed through ``redux.sync.min``
                (every lane holds the same value, so the minimum is that value; ptxas
                then knows it is the same in every lane)
offsets_uniform_range
                nocut_uniform_range, and the sequence's first rows folded into the head
                index (positions right for (total, heads, d) arrays, the indices past
                the middle dimension: registers only), as a kernel without views would
                address the packed arrays
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import importlib.util  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import cuda, int64  # noqa: E402
from numba.core import types  # noqa: E402
from numba.core.extending import intrinsic  # noqa: E402

import ptx_check as pc  # noqa: E402
import numbaflash.kernels.sequences as sq  # noqa: E402

MODES = ("plain", "varlen", "nocut", "lengths_param", "sq_loaded", "sk_loaded",
         "sk_loaded_range_param", "nocut_uniform_range", "offsets_uniform_range")
V8 = os.path.join(ROOT, "numbaflash", "kernels", "forward", "v8_reordered.py")


@intrinsic
def uniform_i32(typingctx, x):
    """x through redux.sync.min.s32 over the full warp."""
    sig = types.int32(types.int32)

    def codegen(context, builder, sig, args):
        f = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                         "redux.sync.min.s32 $0, $1, 0xffffffff;", "=r,r")
        return builder.call(f, args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def locate_lengths_param(seqs, b, Sq, Sk):
    q0 = int64(seqs[0, b])
    k0 = int64(seqs[1, b])
    nq = int64(seqs[0, b + 1]) - q0
    nk = int64(seqs[1, b + 1]) - k0
    return q0, k0, int64(Sq), int64(Sk), nk - nq


@cuda.jit(device=True, inline=True)
def locate_sq_loaded(seqs, b, Sq, Sk):
    q0 = int64(seqs[0, b])
    return q0, int64(0), int64(seqs[0, b + 1]) - q0, int64(Sk), int64(0)


@cuda.jit(device=True, inline=True)
def locate_sk_loaded(seqs, b, Sq, Sk):
    k0 = int64(seqs[1, b])
    return int64(0), k0, int64(Sq), int64(seqs[1, b + 1]) - k0, int64(0)


def v8_module(mode):
    """forward v8's module, its source changed for ``mode`` where the mode needs that."""
    src = open(V8).read()
    tile_range = "        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)     # as v6\n"
    assert tile_range in src
    if mode == "sk_loaded_range_param":
        src = src.replace(tile_range, tile_range.replace("(i, Sk,", "(i, K.shape[1],"))
    if mode in ("nocut_uniform_range", "offsets_uniform_range"):
        src = src.replace(tile_range, tile_range + "        j_start = uniform_i32(int32(j_start))\n"
                                                   "        j_end = uniform_i32(int32(j_end))\n")
    if mode == "offsets_uniform_range":
        heads = "            bh, bh_kv = h, h // group\n"
        assert heads in src
        src = src.replace(heads, "            bh, bh_kv = q0 * Hq + h, k0 * (Hq // group) + h // group\n")
    path = f"/tmp/v8_probe_{mode}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"numbaflash.kernels.forward.v8_probe_{mode}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.uniform_i32 = uniform_i32
    return module


def run(mode):
    real = sq.make_sequences

    def steps(varlen, *args, **kwargs):
        st = real(varlen, *args, **kwargs)
        if not varlen or mode == "varlen":
            return st
        locate = {"lengths_param": locate_lengths_param, "sq_loaded": locate_sq_loaded,
                  "sk_loaded": locate_sk_loaded,
                  "sk_loaded_range_param": locate_sk_loaded}.get(mode, st.locate)
        return st._replace(locate=locate, cut=sq._all_rows)

    from numbaflash.kernels.forward import v6_split_once as v6mod
    from numbaflash.kernels.variants import PLAIN, Variant
    v8 = v8_module(mode)
    v8.make_sequences = steps
    d = 64
    Br, Bc = v6mod.default_v6_tiles(d, "v8", v6mod.v6_shared_bytes)
    acc = np.dtype("float32")
    t3 = pc.array(acc, 3)
    sig = ((t3, t3, t3, t3, pc.array(acc, 2), numba.float32, numba.int64)
           + pc.variant_signature(acc))
    variant = PLAIN if mode == "plain" else Variant(varlen=True)
    k = v8.make_forward_v8(Br, Bc, d, False, v8.v8_chunk(d, Bc), variant=variant)
    ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
    print(mode, (Br, Bc), pc.parse_link_log(pc.link(ptx, mode)), flush=True)


if __name__ == "__main__":
    for m in sys.argv[1:] or MODES:
        run(m)
