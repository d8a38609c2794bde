"""Forward v3: the tensor cores (3xTF32 mma.sync).

Parent: v2 (v2_flash2.py). The same Algorithm 1 with both matrix products, Sij = Qi Kj^T
and P~ij Vj, on the tensor cores through inline-PTX ``mma.sync`` (m16n8k8, TF32 inputs,
float32 sums; kernels/ptx.py). TF32 keeps 10 of float32's 23 mantissa bits, so every
operand is split into two TF32 parts and three products are summed ("3xTF32"), which
keeps v3's error below that of a float32 matmul. A warp owns 16 query rows; the four
lanes of a quad share a row's max and sum by warp shuffles.

What it buys and costs: 9.4 TFLOP/s at (2, 16, 4096, 64) against v2's 8.3 and SDPA
EFFICIENT's 34.4 (lab/runs/2026-11-30/05_gpu_check.txt). Held back by 249 registers a
thread, the TF32 splits redone for every mma (lab/sweeps/sass_loops.py), and K/V tiles
loaded with no overlap with the math; v6 removes the first two.

Contract: finite inputs. A NaN or inf in V at a key a mask hides from some rows of a
tile reaches them (0 * NaN inside the product), and an inf in K splits into NaN; so v3
runs only when asked for (version="v3"); v6, its successor, is exact for every input.

Inline PTX and warp shuffles on a GPU; on the simulator kernels/simulated.py's stand-ins
(slow; the policy's default there stays v5).
"""

import functools
import math

from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    SHARED_MEM_LIMIT, Plan, here, parse_tiles, refuse_variants, tensor_core_refusal
)
from ..warp import quad_max
from .mma_rows import make_mma_row_steps

V3_WARPS = 4                            # v3: warps per block, 16 query rows each


V3_BR = 16 * V3_WARPS                   # v3: query rows per block


V3_CHUNK = 16                           # v3: keys per online-softmax step


@functools.lru_cache(maxsize=None)
def make_forward_v3(Bc, d, causal):
    """v3 (tensor cores, 3xTF32) kernel. It emits inline PTX (``mma.sync``) and warp
    shuffles; on the simulator kernels/simulated.py's stand-ins run them (slowly; the
    default there stays v5). Float32 accumulation only (float16 and float32 inputs).

    Launch: grid (ceil(Sq / 64), BH), block (128,): four warps, warp w owning query rows
    i*64 + 16w .. +16 of the tile. Shared memory: Kj and Vj, (Bc, DP + 4) float32 each,
    DP = d rounded up to a multiple of 8 (the mma's k); the +4 makes every fragment read
    below hit 32 different banks.

    Lane ``lane`` of a warp holds, for g = lane // 4 and t = lane % 4 (see ptx.py):
      Q fragments  q[ks*4 + 0..3] = Q[g, 8ks+t], Q[g+8, 8ks+t], Q[g, 8ks+t+4], Q[g+8, 8ks+t+4]
      S fragments  s[nt*4 + 0..3] = S[g, 8nt+2t], S[g, 8nt+2t+1], S[g+8, 8nt+2t], S[g+8, 8nt+2t+1]
      O fragments  o[nd*4 + 0..3] = O[g, 8nd+2t], O[g, 8nd+2t+1], O[g+8, 8nd+2t], O[g+8, 8nd+2t+1]
    so each lane owns 2 rows (g and g+8) and the 4 lanes of a "quad" (same g) share them:
    the row max needs a reduction over the quad (two shuffles); the row sum is kept per
    lane and reduced once at the end.

    P~ Vj reuses the S fragments as the A operand without moving data between lanes: the
    mma's k index is a free relabelling of the keys, so "k = t" is taken to mean key 2t
    and "k = t + 4" key 2t + 1 (the two keys a lane holds), and Vj's rows are read in
    that same order for the B operand.

    The K/V tile is processed V3_CHUNK keys at a time: loops that short are unrolled
    completely by NVVM, which keeps every fragment array in registers (over a whole
    64-key tile NVVM left S and O in local memory, and v3 ran at 9 TFLOP/s instead).
    """
    from ..ptx import mma3_split_b as mma3  # inline PTX (the simulator: kernels/simulated.py)
    from ..ptx import split_tf32 as split

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    DP = (d + 7) // 8 * 8                   # head dim padded to the mma's k = 8
    KS = DP // 8                            # mma steps over the head dim
    NT = V3_CHUNK // 8                      # mma steps over the keys of a chunk
    STRIDE = DP + 4                         # shared row stride (bank-conflict free)
    QO_FRAGS = KS * 4                       # fragment registers of Q and of O per lane
    S_FRAGS = NT * 4                        # fragment registers of S per lane
    write_rows = make_mma_row_steps(d, causal, V3_CHUNK, KS).write_rows     # as v6 to v9
    THREADS = 32 * V3_WARPS
    kv_tile_range = make_kv_tile_range(V3_BR, Bc, causal, False)
    assert Bc % V3_CHUNK == 0

    @cuda.jit(**jit_options())
    def forward_v3(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0 = i * V3_BR + (tid // 32) * 16 + g     # this lane's two rows
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

        Kj = cuda.shared.array((Bc, STRIDE), acc)
        Vj = cuda.shared.array((Bc, STRIDE), acc)
        qb = cuda.local.array(QO_FRAGS, acc)        # Q fragments: TF32 big parts
        qs = cuda.local.array(QO_FRAGS, acc)        # and small parts
        o = cuda.local.array(QO_FRAGS, acc)         # O fragments
        s = cuda.local.array(S_FRAGS, acc)          # S, then P~, fragments of a chunk
        pb = cuda.local.array(S_FRAGS, acc)         # P~ split for the tensor cores
        ps = cuda.local.array(S_FRAGS, acc)
        # Alg.1 l.4: load this warp's 16 rows of Qi as A fragments (zero past Sq and d).
        for ks in range(KS):
            for h in range(2):
                col = ks * 8 + t + 4 * h
                x0 = acc(Q[bh, row0, col]) if row0 < Sq and col < d else ZERO
                x1 = acc(Q[bh, row1, col]) if row1 < Sq and col < d else ZERO
                qb[ks * 4 + 2 * h], qs[ks * 4 + 2 * h] = split(x0)
                qb[ks * 4 + 2 * h + 1], qs[ks * 4 + 2 * h + 1] = split(x1)
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # causal: skip masked tiles
        for j in range(Tc):
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            for idx in range(tid, Bc * DP, THREADS):               # Alg.1 l.7
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                Kj[c, k] = acc(K[bh, col, k]) if inside else ZERO
                Vj[c, k] = acc(V[bh, col, k]) if inside else ZERO
            # Wait until Kj and Vj are complete.
            cuda.syncthreads()

            for ch in range(Bc // V3_CHUNK):
                key0 = ch * V3_CHUNK                # first key of the chunk within the tile
                # Alg.1 l.8: S = Qi Kj^T on the tensor cores, then scale and mask.
                mt0 = NEG_INF
                mt1 = NEG_INF
                for nt in range(NT):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(KS):
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            qb[ks * 4], qb[ks * 4 + 1], qb[ks * 4 + 2], qb[ks * 4 + 3],
                            qs[ks * 4], qs[ks * 4 + 1], qs[ks * 4 + 2], qs[ks * 4 + 3],
                            Kj[key0 + nt * 8 + g, ks * 8 + t], Kj[key0 + nt * 8 + g, ks * 8 + t + 4],
                            c0, c1, c2, c3, e0, e1, e2, e3)
                    col = j * Bc + key0 + nt * 8 + 2 * t
                    vis00 = col < Sk and (not causal or col <= row0 + causal_offset)
                    vis01 = col + 1 < Sk and (not causal or col + 1 <= row0 + causal_offset)
                    vis10 = col < Sk and (not causal or col <= row1 + causal_offset)
                    vis11 = col + 1 < Sk and (not causal or col + 1 <= row1 + causal_offset)
                    s[nt * 4] = (c0 + e0) * softmax_scale if vis00 else NEG_INF
                    s[nt * 4 + 1] = (c1 + e1) * softmax_scale if vis01 else NEG_INF
                    s[nt * 4 + 2] = (c2 + e2) * softmax_scale if vis10 else NEG_INF
                    s[nt * 4 + 3] = (c3 + e3) * softmax_scale if vis11 else NEG_INF
                    for h in range(2):
                        if s[nt * 4 + h] > mt0:
                            mt0 = s[nt * 4 + h]
                        if s[nt * 4 + 2 + h] > mt1:
                            mt1 = s[nt * 4 + 2 + h]
                # Alg.1 l.9: new running max (over the quad), P~ = exp(S - m_new), rescale.
                mt0 = quad_max(mt0)
                mt1 = quad_max(mt1)
                mn0 = mt0 if mt0 > m0 else m0
                mn1 = mt1 if mt1 > m1 else m1
                ms0 = ZERO if mn0 == NEG_INF else mn0     # no key seen yet: avoid -inf - -inf
                ms1 = ZERO if mn1 == NEG_INF else mn1
                alpha0 = math.exp(m0 - ms0) if m0 != NEG_INF else ZERO
                alpha1 = math.exp(m1 - ms1) if m1 != NEG_INF else ZERO
                lt0 = ZERO
                lt1 = ZERO
                for nt in range(NT):
                    for h in range(2):
                        x = s[nt * 4 + h]
                        s[nt * 4 + h] = math.exp(x - ms0) if x != NEG_INF else ZERO
                        lt0 += s[nt * 4 + h]
                        x = s[nt * 4 + 2 + h]
                        s[nt * 4 + 2 + h] = math.exp(x - ms1) if x != NEG_INF else ZERO
                        lt1 += s[nt * 4 + 2 + h]
                l0 = alpha0 * l0 + lt0
                l1 = alpha1 * l1 + lt1
                m0 = mn0
                m1 = mn1
                # Alg.1 l.10: O = diag(alpha) O + P~ Vj, with P~ straight from the S
                # fragments (this lane's keys 2t and 2t+1 play the mma's k = t and t + 4).
                for x in range(S_FRAGS):
                    pb[x], ps[x] = split(s[x])
                for nd in range(KS):
                    # The chunk's P~ Vj is summed from zero, then added to the rescaled O in
                    # ordinary float32 arithmetic (as l_tile in v2, and for the same reason).
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(NT):
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                            ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],
                            Vj[key0 + ks * 8 + 2 * t, nd * 8 + g],
                            Vj[key0 + ks * 8 + 2 * t + 1, nd * 8 + g],
                            c0, c1, c2, c3, e0, e1, e2, e3)
                    o[nd * 4] = o[nd * 4] * alpha0 + (c0 + e0)
                    o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + (c1 + e1)
                    o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + (c2 + e2)
                    o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + (c3 + e3)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (the step
        # v6 to v8 share: make_mma_row_steps).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v3


# --- the launch contract ------------------------------------------------------------

V3_MAX_HEAD_DIM = 128         # v3 keeps Q (split in two) and O fragments in registers
VARIANTS = False
TILE_TABLE = False


def v3_shared_bytes(Bc, d):
    """Shared memory of the v3 forward: Kj, Vj of (Bc, DP + 4) float32, DP = d rounded up to 8."""
    return 2 * Bc * ((d + 7) // 8 * 8 + 4) * 4


# On the simulator (kernels/simulated.py), small tiles: every thread is a Python thread
# and every mma a rendezvous of a warp's 32 lanes, so fewer warps a block and a tile
# boundary crossed at the simulator's short sequences.
V3_SIM_TILES = (V3_BR, 16)


def default_v3_tiles(d, where=None):
    """v3 tile rule: Br = 64 (four warps of 16 rows); Bc the largest of 64, 32, 16 that
    fits; on the simulator V3_SIM_TILES."""
    if here(where) == "simulator":
        return V3_SIM_TILES
    for Bc in (64, 32, 16):
        if v3_shared_bytes(Bc, d) <= SHARED_MEM_LIMIT:
            return V3_BR, Bc
    raise ValueError(f"no v3 tile fits head dim {d} in {SHARED_MEM_LIMIT} bytes")


def check_v3_tiles(tiles, d):
    """A caller's forward v3 tiles; ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
    chunk = V3_CHUNK
    if Br != V3_BR or Bc % chunk:
        raise ValueError(f"v3 tiles must be (Br, Bc) = ({V3_BR}, a multiple of "
                         f"{chunk}): four warps of 16 query rows, keys in chunks of {chunk}; "
                         f"got ({Br}, {Bc})")
    if v3_shared_bytes(Bc, d) > SHARED_MEM_LIMIT:
        raise ValueError(f"v3 tiles (64, {Bc}) need {v3_shared_bytes(Bc, d)} bytes of shared "
                         f"memory at head dim {d}; the limit is {SHARED_MEM_LIMIT}")
    return Br, Bc


def refusal(p, where):
    """Why forward v3 cannot run Problem ``p`` here, or None if it can."""
    return tensor_core_refusal("v3", p, where, V3_MAX_HEAD_DIM, "its Q and O fragments")


def plan(p, where, tiles, reason):
    """The Plan of forward v3 for Problem ``p``: grid (Tr, B * Hq), four warps a block."""
    refuse_variants("v3", p)
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"forward v3 cannot run this input: {why}")
    if tiles is None:
        Br, Bc = default_v3_tiles(p.d, where)
        reason += f"; tiles by the v3 rule for d={p.d}"
    else:
        Br, Bc = check_v3_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    return Plan("forward", "v3", "forward_v3", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (32 * V3_WARPS,), v3_shared_bytes(Bc, p.d), p.acc_dtype, p.causal, reason)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v3(plan.Bc, p.d, p.upper)
