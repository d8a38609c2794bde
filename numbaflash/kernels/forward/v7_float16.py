"""Forward v7: v6 on the 16-bit tensor cores (m16n8k16), float16 and bfloat16.

Parent: v6 (v6_split_once.py). A float16 value has 11 significant bits, so the tensor
cores' float16 mma (m16n8k16) multiplies two of them exactly and sums in float32: one
product where v6 needs three TF32 ones, over 16 of the head dim instead of 8. Kj and Vj
(transposed) stay float16 in shared memory, two neighbours per 32-bit word; the S
accumulators are, as they stand, the A fragments of P~ Vj, with P~ rounded to float16
there (as flash-attention's float16 kernels do; l sums the float32 P~). NaN and inf are
handled as in v6, and everything after the products is v6's code (mma_rows.py).

What it buys: float16 inputs at (2, 16, 4096, 64), 2.47 ms against v6's 6.04 on the same
inputs; d = 128, 5.34 ms against 12.86 (lab/runs/2026-12-01/43_v7_sweep.txt). SDPA's
float16 EFFICIENT kernel is still 2x to 3x faster (0.468x at d = 64,
lab/runs/2026-12-01/44_bench_f16.txt).

bfloat16 (make_forward_v7's ``half``): the same kernel on bfloat16's mma, its arrays the
values' bits (kernels/halves.py, numbaflash/dtypes.py); not timed on a GPU yet.

Inline PTX and warp shuffles on a GPU; on the simulator kernels/simulated.py's stand-ins
(the default there stays v5). float16 and bfloat16 inputs, d <= 128; takes every
variant, as v6 does (kernels/variants.py; make_forward_v6 says how): the default for
float16 and bfloat16 attention on a GPU.
"""

import functools
import math
from collections import namedtuple

from numba import cuda, int32

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    TILE_TABLE_REASON, Plan, check_warp_tiles, device_dynamic_shared_limit, variant_description
)
from ..halves import NAMES, make_halves
from ..sequences import make_sequences
from ..smem import U
from ..variants import PLAIN
from .mma_rows import make_mma_row_steps
from .v6_tile_steps import v6_staging_width

V7_CHUNK = 32                           # v7: keys per online-softmax step, by default


V7_LOAD_BATCH = 4                       # v7: K and V elements a thread loads at once


# What v7_shared_layout returns, by name.
V7Layout = namedtuple("V7Layout", "VT_AT END K_ROW V_ROW")


def v7_shared_layout(Bc, d):
    """Where forward v7's float16 tiles sit in its one dynamic float16 array, and their row
    lengths: (VT_AT, END, K_ROW, V_ROW). Kj is stored as it is, row c of keys at
    c * K_ROW; Vj transposed, row k (a column of V) at VT_AT + k * V_ROW, so that both
    operands of the mma read two neighbouring float16 values as one 32-bit word. DP is d
    rounded up to the mma's k = 16. The rows are padded to an odd multiple of four words
    (K_ROW = DP + 8, V_ROW = Bc + 8 halves), so that the eight groups of a warp's fragment
    read hit different banks (make_forward_v7). ``v7_shared_bytes`` is END * 2."""
    DP = (d + 15) // 16 * 16
    K_ROW = DP + 8
    V_ROW = Bc + 8
    VT_AT = Bc * K_ROW
    END = VT_AT + DP * V_ROW
    return V7Layout(VT_AT, END, K_ROW, V_ROW)


def v7_staging_width(d):
    """How many threads forward v7 puts on one row of a K/V tile when it stages it (one
    column each): v6's width, but at least the head dim padded to the mma's k = 16. Every
    column of the padded tile needs a thread to write it (0 past d): a column no thread
    writes holds stale shared memory, and a stale NaN times the 0 of the other operand is
    NaN in the mma. (v6's width alone is 8 at d <= 8, where v7 pads to 16;
    tests/test_forward_kernels.py checks the rule.)"""
    return max(v6_staging_width(d), (d + 15) // 16 * 16)


@functools.lru_cache(maxsize=None)
def make_forward_v7(Br, Bc, d, causal, chunk=V7_CHUNK, variant=PLAIN,
                    gqa=False, half="float16"):
    """v7: float16 or bfloat16 inputs on the 16-bit tensor cores (float32 sums, d <= 128).
    On the simulator kernels/simulated.py's stand-ins (the default there stays v5).

    v6 multiplies float32 values to float32 accuracy with three TF32 products (3xTF32).
    A float16 value needs none of that: it has 11 significant bits, and the tensor cores'
    float16 ``mma`` (m16n8k16: 16 x 16 times 16 x 8, ptx.mma_f16) multiplies two of them
    exactly and adds the products in float32. So v7 is v6's algorithm, warp layout and
    online softmax with one product where v6 has three, and k = 16 instead of 8:

    * Sij = Qi Kj^T is one mma per 16 x 8 x 16 block: exact products of the float16
      inputs, summed in float32 (as v6's are, to float32 accuracy).
    * P~ij Vj needs P~ as float16: each probability (in [0, 1]) is rounded to float16
      (ptx.pack_f16x2), a relative error of at most 2^-11 per term, as flash-attention's
      float16 kernels do. The row sum l adds the unrounded float32 P~. The tests hold v7
      to the float16 rule of tests/tolerance.py: its baseline is attention computed in
      float16.
    * The S fragments are the A operand of P~ Vj as they are: the accumulator of an
      m16n8k16 n-tile holds (row g, keys 2t and 2t + 1), and two n-tiles side by side are
      the A fragment of 16 keys (a0 and a1 from the first, a2 and a3 from the second),
      so no shuffle or relabelling is needed.
    * The tiles stay float16 in shared memory (v7_shared_layout): Kj as it is and Vj
      transposed, so that each B word is two neighbours (ptx.load_b32). Half of v6's
      float32 bytes before its pairs; a quarter of them with the pairs.
    * Qi's fragments stay in registers (d / 8 words a lane at d <= 128).

    Non-finite inputs are handled as in v6: such an element is staged as 0, and the terms
    it was part of are added back in float32 (exact NaN and inf positions). Everything
    after the two products is v6's code (``make_mma_row_steps``): the layout of the
    accumulators is the same.

    ``chunk`` (keys per online-softmax step, a multiple of 16 dividing Bc) is there to be
    measured; the plans use the default (v7_chunk).

    ``variant``: masks and score modifiers, with the run-time arguments and costs of
    make_forward_v6's (GQA staging, band and tile-table skips, the per-entry steps of
    make_mma_row_steps, on the float32 scores before P~ is rounded to float16; ``gqa`` as
    there); with ``PLAIN`` the plain kernel, bit for bit.

    ``half``: "float16", or "bfloat16" (kernels/halves.py): the same kernel on bfloat16's
    mma (``mma.sync...bf16``), its arrays and tiles the values' bits (uint16), P~ rounded
    to bfloat16 (8 significant bits: a relative error of at most 2^-8 per term) and O
    rounded to bfloat16 by the same instruction (the simulator follows its rule).

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,): Br / 16 warps of 16 query rows, and
    ``v7_shared_layout(Bc, d).END * 2`` bytes of dynamic shared memory.
    """
    from numba.types import uint32

    from ..ptx import flat_load, load_b32  # inline PTX (simulator: simulated.py)

    halves = make_halves(half)
    HALF = halves.storage                   # float16, or uint16 holding bfloat16 bits
    widen, narrow, pack2, mma = halves.widen, halves.narrow, halves.pack2, halves.mma

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 16 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = (d + 15) // 16 * 16                # head dim padded to the mma's k = 16
    KS = DP // 16                           # mma steps over the head dim (S = Q K^T)
    ND = DP // 8                            # n-tiles of 8 columns of O
    NT = CHUNK // 8                         # n-tiles of 8 keys of S in a chunk
    PK = CHUNK // 16                        # mma steps over the keys of a chunk (P~ V)
    Q_WORDS = KS * 4                        # Q's A fragments per lane (two halves a word)
    P_WORDS = PK * 4                        # P~'s A fragments of a chunk per lane
    O_FRAGS = ND * 4                        # O's fragments per lane
    S_FRAGS = NT * 4                        # S, then P~, fragments of a chunk per lane
    W = v7_staging_width(d)                 # the staging loops' row width (<= THREADS)
    assert THREADS % W == 0, (Br, d)        # check_v7_tiles refuses these
    RSTEP = THREADS // W                    # rows a pass of the block stages
    VT_AT, END, K_ROW, V_ROW = v7_shared_layout(Bc, d)
    TILE_TABLE = variant.tile_table
    GQA = gqa
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, variant.window)
    rows = make_mma_row_steps(d, causal, CHUNK, ND, variant, half)
    finite, add_nonfinite_scores = rows.finite, rows.add_nonfinite_scores
    softmax_step, add_nonfinite_values = rows.softmax_step, rows.add_nonfinite_values
    write_rows, whole_tile_seen = rows.write_rows, rows.whole_tile
    drop = rows.drop

    @cuda.jit(device=True, inline=True)
    def q_value(Q, bh, r, k, Sq, bad):
        """Q[bh, r, k] as float32, 0 past the rows or the head dim, and 0 if not finite
        (then bad[0] is set)."""
        x = widen(Q[U(bh), U(r), U(k)]) if r < Sq and k < d else ZERO
        if not finite(x):
            bad[0] = 1
            x = ZERO
        return x

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut
    position, row_step = sequences.position, sequences.row_step

    @cuda.jit(**jit_options())
    def forward_v7(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y                    # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = bh                              # the K/V head this query head reads
        if GQA:
            bh_kv = b * (Hq // group) + h // group
        i = cuda.blockIdx.x
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
            bh, bh_kv = h, h // group
        Q, O, L = cut(Q, q0, Sq), cut(O, q0, Sq), cut(L, q0, Sq)
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g               # this lane's two rows within the tile
        k_own = tid % W                         # the column and first row this thread
        c_own = tid // W                        # stages of each K/V tile
        k_in = k_own < d
        k_load = min(k_own, d - 1)              # a column inside the arrays
        row0 = i * Br + r0
        row1 = row0 + 8
        HZERO = narrow(ZERO)        # (a float16 constant from outside is invalid NVVM IR)

        # The block's dynamic shared memory, cut into the tiles (v7_shared_layout).
        smem = cuda.shared.array(0, HALF, alignment=16)
        KH = smem[0:VT_AT]                      # Kj, rows of K_ROW halves
        VT = smem[VT_AT:END]                    # Vj transposed, rows of V_ROW halves
        bad = cuda.shared.array(3, int32)       # non-finite inputs staged as 0 (as v6)
        q = cuda.local.array(Q_WORDS, uint32)   # Q's A fragments, two halves a word
        o = cuda.local.array(O_FRAGS, acc)      # O fragments
        s = cuda.local.array(S_FRAGS, acc)      # S, then P~, fragments of a chunk
        p = cuda.local.array(P_WORDS, uint32)    # P~ as the A fragments of P~ Vj
        kx = cuda.local.array(V7_LOAD_BATCH, HALF)      # K and V elements in flight
        vx = cuda.local.array(V7_LOAD_BATCH, HALF)

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        # Wait until bad is clear.
        cuda.syncthreads()
        # Alg.1 l.4: Qi's A fragments (zero past Sq and d): word ks * 4 + w holds row
        # row0 (w even) or row1 (w odd), columns 16 ks + 2t (+ 8 for w >= 2) and the next.
        for ks in range(KS):
            for w in range(4):
                row = row0 + 8 * (w % 2)
                col = ks * 16 + 2 * t + 8 * (w // 2)
                q[ks * 4 + w] = pack2(q_value(Q, bh, row, col, Sq, bad),
                                      q_value(Q, bh, row, col + 1, Sq, bad))
        for x in range(O_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        # Only the tiles the band (causal, window) leaves work in (bands.py).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (the whole block)
            mark = int32(j + 1)
            last_row = position(K, bh_kv, Sk - 1, Sk, d) + k_load     # a position inside K, V
            step = row_step(K, d)
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            # Alg.1 l.7: load Kj and Vj as float16 (rows past Sk, columns past d and
            # non-finite values: 0), as v6 stages them: this thread's column is k_own,
            # its rows c_own, c_own + RSTEP, ..., V7_LOAD_BATCH of them in flight.
            c = c_own
            while c < Bc:
                at = position(K, bh_kv, j * Bc + c, Sk, d) + k_load  # row j * Bc + c, k_load
                for u in range(V7_LOAD_BATCH):
                    col = j * Bc + c + u * RSTEP
                    inside = k_in and c + u * RSTEP < Bc and col < Sk
                    at_u = at + u * RSTEP * step if col < Sk else last_row
                    kx[u] = flat_load(K, U(at_u))
                    vx[u] = flat_load(V, U(at_u))
                    kx[u] = kx[u] if inside else HZERO
                    vx[u] = vx[u] if inside else HZERO
                if k_own < DP:
                    for u in range(V7_LOAD_BATCH):
                        r = c + u * RSTEP
                        if r < Bc:
                            kv = kx[u]
                            if not finite(widen(kv)):
                                cuda.atomic.max(bad, 1, mark)
                                kv = HZERO
                            KH[U(r * K_ROW + k_own)] = kv
                            vv = vx[u]
                            if not finite(widen(vv)):
                                cuda.atomic.max(bad, 2, mark)
                                vv = HZERO
                            VT[U(k_own * V_ROW + r)] = vv
                c += V7_LOAD_BATCH * RSTEP
            # Wait until Kj, Vj (and, for j = 0, bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark     # the same in every thread
            fix_values = bad[2] == mark
            # Does every row of the block see every key of the tile? Then nothing is masked.
            whole_tile = whole_tile_seen(i * Br, i * Br + Br - 1, j * Bc, j * Bc + Bc - 1, Sk,
                                         causal_offset, window_lo)

            for ch in range(Bc // CHUNK):
                key0 = ch * CHUNK                # first key of the chunk within the tile
                # Alg.1 l.8: S = Qi Kj^T, one float16 mma per 16 x 8 x 16 block.
                for nt in range(NT):
                    acc4 = (ZERO, ZERO, ZERO, ZERO)
                    kr = (key0 + nt * 8 + g) * K_ROW + 2 * t    # B[k, n] = Kj[n, k]
                    for ks in range(KS):
                        acc4 = mma(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                   load_b32(KH, U(kr + 16 * ks)),         # Kj[g, 16ks + 2t:]
                                   load_b32(KH, U(kr + 16 * ks + 8)),     # Kj[g, ... + 8:]
                                   acc4[0], acc4[1], acc4[2], acc4[3])
                    for x in range(4):
                        s[nt * 4 + x] = acc4[x]
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, bh, bh_kv, j * Bc + key0, row0, t, Sq, Sk)
                # Alg.1 l.9 (as v6): scale, mask and score, new running max, P~ in s, alpha.
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, b, h, Sq, Sk,
                    causal_offset, window_lo, softcap, slopes, attn_mask, m0, m1, l0, l1)
                # Dropout: P~ = 0 where dropped (l above has every P~)
                drop(s, j * Bc + key0, row0, t, b, h, seed_lo, seed_hi, keep_threshold)
                # Alg.1 l.10: O = diag(alpha) O + P~ Vj. P~ rounded to float16, two S
                # n-tiles (16 keys) to one A fragment: a0, a1 rows g and g + 8 of the
                # first, a2, a3 of the second.
                for pk in range(PK):
                    for w in range(4):
                        x = (2 * pk + w // 2) * 4 + 2 * (w % 2)
                        p[pk * 4 + w] = pack2(s[x], s[x + 1])
                for nd in range(ND):
                    acc4 = (ZERO, ZERO, ZERO, ZERO)
                    vr = (nd * 8 + g) * V_ROW + key0 + 2 * t     # B[k, n] = Vj[k, n] = VT[n, k]
                    for pk in range(PK):
                        acc4 = mma(p[pk * 4], p[pk * 4 + 1], p[pk * 4 + 2], p[pk * 4 + 3],
                                   load_b32(VT, U(vr + 16 * pk)),         # keys 16pk + 2t:
                                   load_b32(VT, U(vr + 16 * pk + 8)),     # keys ... + 8:
                                   acc4[0], acc4[1], acc4[2], acc4[3])
                    # The chunk's P~ Vj is summed from zero, then added to the rescaled O
                    # in ordinary float32 arithmetic (as in v3 and v6).
                    o[nd * 4] = o[nd * 4] * alpha0 + acc4[0]
                    o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + acc4[1]
                    o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + acc4[2]
                    o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + acc4[3]
                if fix_values:          # rare: a non-finite v was staged as 0 (as v6)
                    add_nonfinite_values(o, s, V, bh_kv, j * Bc + key0, row0, row1, g, t, b, h,
                                         Sq, Sk, causal_offset, window_lo, attn_mask)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v6).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq, keep_scale)

    return forward_v7


# --- the launch contract ------------------------------------------------------------
#
# Tile rule: the first (Br, Bc) of V7_CANDIDATES that fits the current GPU's per-block
# maximum, with V7_CHUNK keys a softmax step; d > 64 starts at (128, 64) with 16-key
# chunks. Measured (lab/sweeps/v7_sweep.py, lab/runs/2026-12-01/43_v7_sweep.txt,
# (2, 16, 4096, d), float16, ms not causal / causal): d = 64, (128, 128) 2.47 / 1.69,
# (128, 64) 2.58 / 1.83, (64, 64) 3.04 / 2.03, 16-key chunks at (128, 64) 3.58 / 2.27;
# d = 128, (128, 64) with 16-key chunks 5.34 / 3.12, with 32-key chunks 5.60 / 3.25,
# (64, 64) 6.26 / 3.55. (At d = 128, (128, 128) with 16-key chunks read 4.97 / 3.01 in a
# later sweep, lab/runs/2026-12-01/44_v7_sweep_d128.txt: not taken into the rule without
# a side-by-side.) Forward v6 on the same inputs: 6.04 / 3.77 and 12.86 / 7.16.
# (128, 128) takes 35 KB at d = 64, (128, 64) 35 KB at d = 128. A caller's tiles: Br a
# multiple of 16 up to 256, Bc a multiple of 32.

V7_CANDIDATES = ((128, 128), (128, 64), (64, 64), (64, 32))
# On the simulator (kernels/simulated.py), small tiles: every thread is a Python thread
# and every mma a rendezvous of a warp's 32 lanes, so fewer warps a block and a tile
# boundary crossed at the simulator's short sequences.
V7_SIM_TILES = (32, 32)
V7_WIDE_MAX_HEAD_DIM = 64     # (128, 128) and 32-key chunks up to here (measured best)
V7_MAX_HEAD_DIM = 128         # the O fragments (d / 2 a lane) stay in registers up to here
VARIANTS = True               # takes the variant arguments (kernels/variants.py)
BFLOAT16 = True               # reads bfloat16 inputs itself (numbaflash/dtypes.py)
TILE_TABLE = True             # skips the tiles a mask leaves empty (variants.make_tile_table)


def v7_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v7 (v7_shared_layout), float16."""
    return v7_shared_layout(Bc, d).END * 2


def refusal(p, where):
    """Why forward v7 cannot run Problem ``p`` here, or None if it can."""
    if p.dtype.name not in NAMES:
        return (f"v7 multiplies float16 and bfloat16 inputs on the 16-bit tensor cores; "
                f"{p.dtype} inputs run on v8 (float32) or v2 (float64)")
    if p.d > V7_MAX_HEAD_DIM:
        return (f"v7 keeps its O fragments in registers, which holds head dims up to "
                f"{V7_MAX_HEAD_DIM}")
    return None


def tiles_within(d, limit):
    """The first of V7_CANDIDATES (from (128, 64) when d > V7_WIDE_MAX_HEAD_DIM) whose
    shared memory fits ``limit`` bytes and whose threads cover the staging width, or None."""
    candidates = V7_CANDIDATES if d <= V7_WIDE_MAX_HEAD_DIM else V7_CANDIDATES[1:]
    width = v7_staging_width(d)
    return next(((Br, Bc) for Br, Bc in candidates
                 if v7_shared_bytes(Br, Bc, d) <= limit and 2 * Br >= width), None)


def v7_chunk(d, Bc):
    """Keys per online-softmax step of forward v7: 32 up to V7_WIDE_MAX_HEAD_DIM, 16 above
    (5.34 against 5.60 ms at d = 128, lab/runs/2026-12-01/43_v7_sweep.txt), and never more
    than Bc."""
    return min(V7_CHUNK if d <= V7_WIDE_MAX_HEAD_DIM else 16, Bc)


def check_v7_tiles(tiles, d):
    """A caller's forward v7 tiles; ValueError names the limit."""
    return check_warp_tiles("v7", tiles, d, V7_CHUNK, v7_shared_bytes, v7_staging_width)


def plan(p, where, tiles, reason):
    """The Plan of forward v7 for Problem ``p``: grid (Tr, B * Hq), 2 Br threads a block;
    takes variants (the table of visible tiles is made for the plan's (Br, Bc))."""
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"forward v7 cannot run this input: {why}")
    if tiles is None and where == "simulator":
        Br, Bc = max(V7_SIM_TILES[0], v7_staging_width(p.d) // 2), V7_SIM_TILES[1]
        reason += f"; tiles by the v7 rule for d={p.d} on the simulator"
    elif tiles is None:
        limit = device_dynamic_shared_limit(where)
        found = tiles_within(p.d, limit)
        if found is None:
            raise ValueError(f"forward v7 cannot run this input: no v7 tile fits head dim "
                             f"{p.d} within {limit} bytes of shared memory")
        Br, Bc = found
        reason += f"; tiles by the v7 rule for d={p.d}"
    else:
        Br, Bc = check_v7_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    if p.variant.tile_table:
        reason += TILE_TABLE_REASON
    return Plan("forward", "v7", "forward_v7", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (2 * Br,), v7_shared_bytes(Br, Bc, p.d), p.acc_dtype, p.causal, reason,
                variant_description(p), dynamic_shared=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v7(plan.Br, plan.Bc, p.d, p.upper, v7_chunk(p.d, plan.Bc),
                           variant=p.variant, gqa=p.group > 1, half=p.dtype.name)
