"""The tile steps forward v6 introduced and v8 and v9 reuse.

``make_v6_tile_steps`` builds the device functions that stage Qi, Kj and Vj
(each element split once into its TF32 pair, in dynamic shared memory) and
compute a chunk's scores S = Qi Kj^T and its P~ Vj on the tensor cores.
On the simulator through kernels/simulated.py.
"""

import functools
from collections import namedtuple

from numba import cuda, int32

from .. import acc_type
from ..sequences import make_packed_rows, make_sequences
from ..smem import U
from .mma_rows import make_mma_row_steps

V6_CHUNK = 16                           # v6: keys per online-softmax step, by default
V6_Q_REGISTERS_MAX_DP = 64              # v6: Q's fragments stay in registers up to this DP
V6_LOAD_BATCH = 4                       # v6: K and V elements a thread loads at once (8: 253
                                        # registers at d = 64 instead of 179)


# What v6_shared_layout returns, by name.
V6Layout = namedtuple("V6Layout", "KP_AT VP_AT QP_AT END K_ROW V_ROW")


def v6_shared_layout(Br, Bc, d):
    """Where forward v6's tiles sit in its one dynamic float32 array, and their row
    lengths: (KP_AT, VP_AT, QP_AT, END, K_ROW, V_ROW). Kj, Vj (Bc rows) and, when Qi does
    not stay in registers (DP > V6_Q_REGISTERS_MAX_DP), Qi (Br rows) are stored split
    into their TF32 parts, each element as a (big, small) pair, so that one 8-byte load
    fetches both: element k of row c of Kj is at KP_AT + c * K_ROW + 2k (big) and the
    float after it (small). DP is d rounded up to the mma's k = 8; the rows are padded,
    K_ROW = 2 DP + 8 (Qi's too) and V_ROW = 2 DP + 4, so that the fragment reads of a
    half-warp hit 16 different bank pairs (make_forward_v6). Without a Qi tile, QP_AT =
    END. ``v6_split_once.v6_shared_bytes`` is END * 4."""
    DP = (d + 7) // 8 * 8
    K_ROW = 2 * DP + 8
    V_ROW = 2 * DP + 4
    KP_AT = 0
    VP_AT = KP_AT + Bc * K_ROW
    QP_AT = VP_AT + Bc * V_ROW
    END = QP_AT + (0 if DP <= V6_Q_REGISTERS_MAX_DP else Br * K_ROW)
    return V6Layout(KP_AT, VP_AT, QP_AT, END, K_ROW, V_ROW)


def v6_staging_width(d):
    """How many threads forward v6 puts on one row of a K/V tile when it stages it (one
    column each): d rounded up to the mma's k = 8 and then to a power of two, so that it
    divides the block's 2 Br threads (which must be at least this many)."""
    W = 8
    while W < d:
        W *= 2
    return W


# What make_v6_tile_steps returns: inlined device functions, by name.
V6TileSteps = namedtuple("V6TileSteps", "load_q stage_kv scores scores_q_once values "
                         "finite_or_zero load_finite scores_head_dim_outside")


@functools.lru_cache(maxsize=None)
def make_v6_tile_steps(Br, Bc, d, chunk, varlen=False, rows=False):
    """The steps of forward v6 that v8 and v9 reuse, as inlined device functions: Qi into
    registers (or QP), a K/V tile staged as split pairs, and the two products of one
    chunk. Float32 accumulation; the arguments are make_forward_v6's.

    Returns a V6TileSteps (load_q, stage_kv, scores, scores_q_once, values,
    finite_or_zero, load_finite, scores_head_dim_outside); make_forward_v6's docstring
    explains what they do, and each says which line of Algorithm 1 it is. The last three
    are for v9: v6's non-finite guards, and the factory of scores_q_once for another way
    of reading Qi. ``varlen``: K and V are a packed batch's views (kernels/sequences.py),
    whose flat positions come from their strides."""
    from ..ptx import flat_load, load_pair, mma_tf32  # inline PTX (simulator: simulated.py)
    from ..ptx import split_tf32 as split
    from ..ptx import split_tf32_finite as split_finite
    from ..ptx import store_pair

    acc = acc_type("float32")
    ZERO = acc(0)
    CHUNK = chunk
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = (d + 7) // 8 * 8                   # head dim padded to the mma's k = 8
    KS = DP // 8                            # mma steps over the head dim
    NT = CHUNK // 8                         # mma steps over the keys of a chunk
    S_FRAGS = NT * 4                        # fragment registers of S per lane
    Q_REGS = DP <= V6_Q_REGISTERS_MAX_DP    # Qi's fragments in registers, else in QP
    W = v6_staging_width(d)                 # the staging loops' row width (<= THREADS)
    RSTEP = THREADS // W                    # rows a pass of the block stages
    layout = v6_shared_layout(Br, Bc, d)
    K_ROW, V_ROW = layout.K_ROW, layout.V_ROW
    finite = make_mma_row_steps(d, False, CHUNK, KS).finite
    sequences = make_sequences(varlen)
    position, row_step = sequences.position, sequences.row_step
    ROWS = rows
    element = make_packed_rows(rows).element
    if rows:
        position = make_packed_rows(rows).position

    @cuda.jit(device=True, inline=True)
    def mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s, b1s, c, e, f):
        """3xTF32 A B with both operands already split: big*big is added to C, the two
        small products to E and F (the small terms in their own accumulators, as in v3;
        two of them, so that the tensor cores work on three independent sums: one
        accumulator would make every mma of a score wait for the one before it)."""
        c = mma_tf32(a0b, a1b, a2b, a3b, b0b, b1b, c[0], c[1], c[2], c[3])
        e = mma_tf32(a0s, a1s, a2s, a3s, b0b, b1b, e[0], e[1], e[2], e[3])
        f = mma_tf32(a0b, a1b, a2b, a3b, b0s, b1s, f[0], f[1], f[2], f[3])
        return c, e, f

    @cuda.jit(device=True, inline=True)
    def mma3_short(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s, b1s, c, e):
        """mma3 with both small products in E, as in v3: for P~ Vj, whose sums are only
        chunk / 8 steps long and many (one per 8 columns of O), so that a third
        accumulator would buy no parallelism and cost registers."""
        c = mma_tf32(a0b, a1b, a2b, a3b, b0b, b1b, c[0], c[1], c[2], c[3])
        e = mma_tf32(a0s, a1s, a2s, a3s, b0b, b1b, e[0], e[1], e[2], e[3])
        e = mma_tf32(a0b, a1b, a2b, a3b, b0s, b1s, e[0], e[1], e[2], e[3])
        return c, e

    @cuda.jit(device=True, inline=True)
    def finite_or_zero(x, bad, slot, mark):
        """x, or 0 if x is not finite; then bad[slot] is raised to ``mark``."""
        if not finite(x):
            cuda.atomic.max(bad, slot, mark)
            x = ZERO
        return x

    @cuda.jit(device=True, inline=True)
    def load_finite(A, bh, r, k, nrows, bad, slot, mark):
        """A[bh, r, k] as float32, 0 past the rows (r >= nrows) or the head dim, through
        finite_or_zero."""
        if ROWS:
            x = acc(element(A, bh, r, k)) if r < nrows and k < d else ZERO
        else:
            x = acc(A[U(bh), U(r), U(k)]) if r < nrows and k < d else ZERO
        return finite_or_zero(x, bad, slot, mark)

    @cuda.jit(device=True, inline=True)
    def load_q(Q, QP, qb, qs, bad, bh, i, row0, row1, t, tid, Sq, q_first=0):
        """Alg.1 l.4: Qi, split (zero past Sq and d): this lane's A fragments in
        registers (qb, qs), or the whole tile in QP (read after the first tile's
        barriers)."""
        if Q_REGS:
            for ks in range(KS):
                for h in range(2):
                    col = ks * 8 + t + 4 * h
                    qb[ks * 4 + 2 * h], qs[ks * 4 + 2 * h] = split(
                        load_finite(Q, bh, q_first + row0, col, q_first + Sq, bad, 0,
                                    int32(1)))
                    qb[ks * 4 + 2 * h + 1], qs[ks * 4 + 2 * h + 1] = split(
                        load_finite(Q, bh, q_first + row1, col, q_first + Sq, bad, 0,
                                    int32(1)))
        else:
            idx = tid
            while idx < Br * DP:
                r = idx // DP
                k = idx % DP
                big, small = split(load_finite(Q, bh, q_first + i * Br + r, k, q_first + Sq,
                                               bad, 0, int32(1)))
                store_pair(QP, U(r * K_ROW + 2 * k), big, small)
                idx += THREADS

    @cuda.jit(device=True, inline=True)
    def stage_kv(K, V, KP, VP, kx, vx, bad, bh_kv, j, tid, Sk, k_first=0):
        """Alg.1 l.7: load Kj and Vj of K/V head bh_kv, split once (rows past Sk and
        columns past d: 0), into KP and VP. A non-finite element is staged as 0 and raises bad[1] (K) or
        bad[2] (V) to j + 1.

        This thread's column is k_own, its rows c_own, c_own + RSTEP, ...; V6_LOAD_BATCH
        rows of each are loaded (into kx, vx) before any is used, so that their loads
        from global memory wait together, not one after the other. The loads are
        unconditional, at flat positions in K and V (ptx.flat_load: one address
        computation each, where K[bh, col, k] costs seven 64-bit multiply-adds); a
        position outside the arrays is replaced by one inside (row Sk - 1; Sk >= 1
        here) and its value by 0."""
        mark = int32(j + 1)
        k_own = tid % W                         # the column and first row this thread
        c_own = tid // W                        # stages of each K/V tile
        k_in = k_own < d
        k_load = min(k_own, d - 1)              # a column inside the arrays
        last_row = position(K, bh_kv, k_first + Sk - 1, Sk, d) + k_load   # inside K, V
        step = K.shape[1] * d if ROWS else row_step(K, d)
        c = c_own
        while c < Bc:
            at = position(K, bh_kv, k_first + j * Bc + c, Sk, d) + k_load  # row, col k_load
            for u in range(V6_LOAD_BATCH):
                col = j * Bc + c + u * RSTEP
                inside = k_in and c + u * RSTEP < Bc and col < Sk
                at_u = at + u * RSTEP * step if col < Sk else last_row
                kx[u] = acc(flat_load(K, U(at_u)))
                vx[u] = acc(flat_load(V, U(at_u)))
                kx[u] = kx[u] if inside else ZERO
                vx[u] = vx[u] if inside else ZERO
            if k_own < DP:
                for u in range(V6_LOAD_BATCH):
                    r = c + u * RSTEP
                    if r < Bc:
                        big, small = split_finite(finite_or_zero(kx[u], bad, 1, mark))
                        store_pair(KP, U(r * K_ROW + 2 * k_own), big, small)
                        big, small = split_finite(finite_or_zero(vx[u], bad, 2, mark))
                        store_pair(VP, U(r * V_ROW + 2 * k_own), big, small)
            c += V6_LOAD_BATCH * RSTEP

    @cuda.jit(device=True, inline=True)
    def scores(s, qb, qs, QP, KP, key0, r0, g, t):
        """Alg.1 l.8: the chunk's S = Qi Kj^T (keys key0 ... key0 + chunk - 1 of the
        tile) on the tensor cores, into the fragments s, unscaled."""
        for nt in range(NT):
            c = (ZERO, ZERO, ZERO, ZERO)
            e = c
            f = c
            kr = (key0 + nt * 8 + g) * K_ROW + 2 * t    # B = Kj^T: B[t, g] = Kj[g, t]
            for ks in range(KS):
                if Q_REGS:
                    a0b, a1b, a2b, a3b = qb[ks * 4], qb[ks * 4 + 1], qb[ks * 4 + 2], qb[ks * 4 + 3]
                    a0s, a1s, a2s, a3s = qs[ks * 4], qs[ks * 4 + 1], qs[ks * 4 + 2], qs[ks * 4 + 3]
                else:
                    qr = r0 * K_ROW + 2 * (ks * 8 + t)
                    a0b, a0s = load_pair(QP, U(qr))                     # Q[g, 8ks + t]
                    a1b, a1s = load_pair(QP, U(qr + 8 * K_ROW))         # Q[g + 8, ...]
                    a2b, a2s = load_pair(QP, U(qr + 8))                 # Q[g, ... + 4]
                    a3b, a3s = load_pair(QP, U(qr + 8 * K_ROW + 8))
                b0b, b0s = load_pair(KP, U(kr + 16 * ks))               # Kj[g, 8ks + t]
                b1b, b1s = load_pair(KP, U(kr + 16 * ks + 8))           # Kj[g, ... + 4]
                c, e, f = mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                               b0b, b1b, b0s, b1s, c, e, f)
            for x in range(4):
                s[nt * 4 + x] = c[x] + (e[x] + f[x])

    def scores_head_dim_outside(q_fragment):
        """``scores`` for a Qi staged in shared memory (d > 64), with the loops the other
        way round: the head dim outside, the chunk's n-tiles inside, so that each A
        fragment of Qi is read once per chunk instead of once per n-tile (v8). Each score
        is summed over the head dim in the same order as in ``scores``, so the results
        are the same bits. ``q_fragment(QX, r0, ks, t)`` reads Qi's A fragment for head-dim
        step ks from its tile QX as (big parts, small parts): from split pairs (v8's
        q_pair_fragment) or plain values split as read (v9). se and sf hold the small
        products' sums."""
        @cuda.jit(device=True, inline=True)
        def scores_q_once(s, se, sf, QX, KP, key0, r0, g, t):
            for x in range(S_FRAGS):
                s[x] = ZERO
                se[x] = ZERO
                sf[x] = ZERO
            for ks in range(KS):
                a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s = q_fragment(QX, r0, ks, t)
                for nt in range(NT):
                    kr = (key0 + nt * 8 + g) * K_ROW + 2 * t + 16 * ks
                    b0b, b0s = load_pair(KP, U(kr))                 # Kj[g, 8ks + t]
                    b1b, b1s = load_pair(KP, U(kr + 8))             # Kj[g, ... + 4]
                    y = nt * 4
                    c, e, f = mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s,
                                   b1s, (s[y], s[y + 1], s[y + 2], s[y + 3]),
                                   (se[y], se[y + 1], se[y + 2], se[y + 3]),
                                   (sf[y], sf[y + 1], sf[y + 2], sf[y + 3]))
                    for x in range(4):
                        s[y + x] = c[x]
                        se[y + x] = e[x]
                        sf[y + x] = f[x]
            for x in range(S_FRAGS):
                s[x] = s[x] + (se[x] + sf[x])
        return scores_q_once

    @cuda.jit(device=True, inline=True)
    def q_pair_fragment(QP, r0, ks, t):
        """Qi's A fragment for head-dim step ks from QP (split pairs, rows of K_ROW)."""
        qr = r0 * K_ROW + 2 * (ks * 8 + t)
        a0b, a0s = load_pair(QP, U(qr))                     # Q[g, 8ks + t]
        a1b, a1s = load_pair(QP, U(qr + 8 * K_ROW))         # Q[g + 8, ...]
        a2b, a2s = load_pair(QP, U(qr + 8))                 # Q[g, ... + 4]
        a3b, a3s = load_pair(QP, U(qr + 8 * K_ROW + 8))
        return a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s

    scores_q_once = scores_head_dim_outside(q_pair_fragment)

    @cuda.jit(device=True, inline=True)
    def values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1):
        """Alg.1 l.10: O = diag(alpha) O + P~ Vj for the chunk, P~ straight from the S
        fragments s (keys 2t and 2t+1 of each 8 play the mma's k = t and t + 4, as in
        v3), split into pb, ps first. A NaN in P~ (from a NaN score) reaches l, so its
        split may be anything."""
        for x in range(S_FRAGS):
            pb[x], ps[x] = split_finite(s[x])
        for nd in range(KS):
            c = (ZERO, ZERO, ZERO, ZERO)
            e = c
            for ks in range(NT):
                vr = (key0 + ks * 8 + 2 * t) * V_ROW + 2 * (nd * 8 + g)
                b0b, b0s = load_pair(VP, U(vr))             # Vj[2t, 8nd + g]
                b1b, b1s = load_pair(VP, U(vr + V_ROW))     # Vj[2t + 1, 8nd + g]
                c, e = mma3_short(
                    pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                    ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],
                    b0b, b1b, b0s, b1s, c, e)
            # The chunk's P~ Vj is summed from zero, then added to the rescaled O in
            # ordinary float32 arithmetic (as in v3).
            o[nd * 4] = o[nd * 4] * alpha0 + (c[0] + e[0])
            o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + (c[1] + e[1])
            o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + (c[2] + e[2])
            o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + (c[3] + e[3])

    return V6TileSteps(load_q, stage_kv, scores, scores_q_once, values, finite_or_zero,
                       load_finite, scores_head_dim_outside)
