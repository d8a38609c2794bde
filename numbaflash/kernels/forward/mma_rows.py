"""The per-row steps of the tensor-core forward kernels (v3, v6, v7, v8, v9).

``make_mma_row_steps`` builds the device functions that work on the rows a
warp's mma fragments hold: the finite test, the online-softmax step over one
chunk of keys (Alg.1 l.8-10 on fragments, row max and sum by quad shuffles),
the fix-ups that put NaN and inf where the reference has them, and the
write-out of O and L (Alg.1 l.12-13). On the simulator through kernels/simulated.py.

Variants (kernels/variants.py) enter here, in the mask and the scale of softmax_step and
in the visibility of add_nonfinite_values: the factory takes the compile-time ``variant``
and the steps take its run-time arguments. Dropout is a step of its own, ``drop``,
between softmax_step and the product with V, and the ``keep_scale`` of write_rows. With
``PLAIN`` they compile to the plain steps.
"""

import functools
import math
from collections import namedtuple

from numba import cuda

from .. import acc_type
from ..halves import make_halves
from ..ptx import exp2_approx, fmax
from ..sequences import make_packed_rows
from ..smem import U
from ..variants import PLAIN, make_dropout, make_variant_functions
from ..warp import FULL_WARP, quad_max, quad_sum

# What make_mma_row_steps returns: inlined device functions, by name.
MmaRowSteps = namedtuple("MmaRowSteps", "finite whole_tile add_nonfinite_scores softmax_step "
                         "drop add_nonfinite_values write_rows")


@cuda.jit(device=True, inline=True)
def _as_it_is(x):
    """A float32 result for an output array of float32 or float16 (the store converts)."""
    return x


@functools.lru_cache(maxsize=None)
def make_mma_row_steps(d, causal, chunk, o_tiles, variant=PLAIN, half=None, rows=False):
    """The steps forward v6 to v9 share, as inlined device functions: everything in their
    chunk loop and after it except the two matrix products and the staging (v3 takes
    write_rows only). Both keep a
    warp's 16 query rows in the m16n8 accumulator layout (lane (g, t) holds rows g and
    g + 8, keys or columns 2t and 2t + 1 of each n-tile of 8), so the same code serves
    v6's TF32 products and v7's float16 ones. ``chunk``: keys per online-softmax step
    (NT = chunk / 8 n-tiles of S); ``o_tiles``: n-tiles of 8 columns of O (d padded to
    the mma's k, over 8). Float32 accumulation.

    ``variant`` (kernels/variants.py, compile-time): which entries are masked
    (``visible``) and how a visible entry's score is changed (``score``). The costs, per
    entry of S, only where the variant asks for them: a window adds one comparison to
    the mask of the tiles that need one (the edge, diagonal and window-edge tiles, as the
    kernels' ``whole_tile`` says); a score-changing variant (softcap, ALiBi, a bias,
    score_mod) calls ``score`` on every visible entry of every tile, and a data mask
    (bool attn_mask, mask_mod) tests ``visible`` on every entry of every tile it does not
    skip. Rows past Sq are masked whenever the variant reads per-entry data (attn_mask,
    the user's functions), which has no entry for them.

    Dropout (``variant.dropout``): ``drop`` zeroes the dropped entries of P~ after
    softmax_step has added them to the row sums, one Philox call per lane and n-tile
    (``kept_rows``, shared by the lanes of a pair), on every tile (whole ones too);
    write_rows multiplies O by keep_scale.

    ``half``: the name of the 16-bit input type of v7 ("float16" or "bfloat16",
    kernels/halves.py), whose widen reads Q, K, V here and whose narrow rounds O; None
    for float32 inputs (and float16 read as Numba's float16, the same code as "float16").

    ``rows``: Q, K, V and O are a packed batch's (total, heads, d) arrays as they are
    (kernels/sequences.py, make_packed_rows); the row and key indices the steps take are
    then counted from the packed arrays' first row (Sq and Sk of the checks shifted the
    same way), except add_nonfinite_values' keys, counted within the sequence, whose
    first key row is its ``k_first``.

    Returns a MmaRowSteps (finite, whole_tile, add_nonfinite_scores, softmax_step, drop,
    add_nonfinite_values, write_rows); each says what it does. The non-finite fix-ups are
    described in make_forward_v6."""
    acc = acc_type("float32")
    if half is None:
        widen, narrow = acc, _as_it_is
    else:
        widen, narrow = make_halves(half).widen, make_halves(half).narrow
    ZERO = acc(0)
    ONE = acc(1)
    NEG_INF = acc(-math.inf)
    F32_MAX = acc(3.4028234663852886e38)
    LOG2E = acc(1.4426950408889634)
    NT = chunk // 8
    S_FRAGS = NT * 4
    visible, score = make_variant_functions(variant, causal, "float32")
    kept_rows = make_dropout(variant).kept_rows
    DROPOUT = variant.dropout
    # Compile-time: does every visible entry need score()? Does the mask depend on data
    # (then every tile needs the per-entry visible(), and rows past Sq see nothing)?
    SCORES = (variant.softcap or variant.alibi or variant.mask == "bias"
              or variant.score_mod is not None)
    MASKS = variant.tile_table
    PER_ENTRY = SCORES or MASKS
    WINDOW = variant.window
    ROWS = rows
    element, put = make_packed_rows(rows).element, make_packed_rows(rows).put

    @cuda.jit(device=True, inline=True)
    def finite(x):
        return abs(x) <= F32_MAX        # one comparison; False for NaN and +-inf

    @cuda.jit(device=True, inline=True)
    def whole_tile(first_row, last_row, first_col, last_col, Sk, causal_offset, window_lo):
        """Does every row of the block (first_row ... last_row) see every key of the tile
        (first_col ... last_col) through the band? Then softmax_step needs no mask there.
        Plain: the tile ends within Sk and, causal, below the diagonal; a window's left
        bound is tested the same way; a data mask (bool attn_mask, mask_mod) is never
        whole (it needs the per-entry test)."""
        return (last_col < Sk
                and (not causal or last_col <= first_row + causal_offset)
                and (not WINDOW or first_col >= last_row + window_lo)
                and not MASKS)

    @cuda.jit(device=True, inline=True)
    def nonfinite_terms(Q, K, bh, bh_kv, row, col, Sq, Sk):
        """The sum of the products Q[row, k] * K[col, k] (query head bh, K/V head bh_kv)
        with a non-finite factor: what the tensor cores left out of this score (those
        factors were staged as 0)."""
        x = ZERO
        if row < Sq and col < Sk:
            k = 0
            while k < d:
                q = widen(element(Q, bh, row, k))
                kk = widen(element(K, bh_kv, col, k))
                if not (finite(q) and finite(kk)):
                    x += q * kk
                k += 1
        return x

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_scores(s, Q, K, bh, bh_kv, col0, row0, t, Sq, Sk):
        """Rare: a non-finite q or k was staged as 0; add its terms to the chunk's scores
        s (keys from col0; K/V head bh_kv)."""
        for nt in range(NT):
            col = col0 + nt * 8 + 2 * t
            for x in range(4):      # s[nt * 4 + x]: row0 or row1, col or col + 1
                term = nonfinite_terms(Q, K, bh, bh_kv, row0 + 8 * (x // 2), col + x % 2,
                                       Sq, Sk)
                # s[nt * 4 + x] += term, with constant indices only: this loop is not
                # unrolled (its body holds a loop over d), and one run-time index into s
                # would put s in local memory for the whole kernel (it did with 32-key
                # chunks: lab/sweeps/v7_chunk_registers.py); the loop below is unrolled.
                for y in range(S_FRAGS):
                    if y == nt * 4 + x:
                        s[y] += term

    @cuda.jit(device=True, inline=True)
    def softmax_step(s, softmax_scale, whole_tile, col0, row0, t, b, h, Sq, Sk,
                     causal_offset, window_lo, softcap, slopes, attn_mask, m0, m1, l0, l1):
        """Alg.1 l.8-9 after the product: scale the chunk's scores s (keys from col0),
        mask them unless ``whole_tile`` (every key of the tile visible from every row of
        the block: the kernel decides, per tile), apply the variant's score, take the new
        running max over the quad, and turn s into P~ = exp(S - m_new) in place. b, h
        (batch, query head) and the arguments after Sk are the variant's (variants.py).
        Returns (alpha0, alpha1, m0, m1, l0, l1): the rescale factors of rows row0 and
        row0 + 8 and their new running max and (this lane's part of the) sums."""
        if PER_ENTRY:
            # Every visible entry goes through score(); a data mask (never whole_tile)
            # tests every entry. Rows past Sq have no mask or bias entry: masked.
            for nt in range(NT):
                col = col0 + nt * 8 + 2 * t
                for x in range(4):
                    row = row0 + 8 * (x // 2)
                    key = col + x % 2
                    y = nt * 4 + x
                    if row < Sq and (whole_tile or visible(b, h, row, key, Sk, causal_offset,
                                                           window_lo, attn_mask)):
                        s[y], _ = score(s[y] * softmax_scale, b, h, row, key, Sq, Sk,
                                        softcap, slopes, attn_mask)
                    else:
                        s[y] = NEG_INF
        else:
            for x in range(S_FRAGS):
                s[x] *= softmax_scale
            if not whole_tile:
                # The band alone (the variant's visible() here, written out as the plain
                # kernel had it): past Sk, past the causal bound, before a window's left.
                for nt in range(NT):
                    col = col0 + nt * 8 + 2 * t
                    for x in range(4):
                        key = col + x % 2
                        row = row0 + 8 * (x // 2)
                        if not (key < Sk and (not causal or key <= row + causal_offset)
                                and (not WINDOW or key >= row + window_lo)):
                            s[nt * 4 + x] = NEG_INF
        mt0 = NEG_INF           # this lane's part of the chunk's row maxima (fmax: a
        mt1 = NEG_INF           # NaN score does not win, as in quad_max)
        for nt in range(NT):
            for h in range(2):
                mt0 = fmax(mt0, s[nt * 4 + h])
                mt1 = fmax(mt1, s[nt * 4 + 2 + h])
        mt0 = quad_max(mt0)
        mt1 = quad_max(mt1)
        mn0 = mt0 if mt0 > m0 else m0
        mn1 = mt1 if mt1 > m1 else m1
        ms0 = ZERO if mn0 == NEG_INF else mn0     # no key seen yet: avoid -inf - -inf
        ms1 = ZERO if mn1 == NEG_INF else mn1
        # exp(x - m) as exp2(x * log2(e) - m * log2(e)): one multiply-add and the
        # hardware's exp2 (ptx.exp2_approx), where math.exp spends about 15 instructions.
        # A masked score (-inf) gives exp2(-inf) = 0, and so does a running max of -inf
        # (no key seen yet: ms is 0 then), with no test.
        alpha0 = exp2_approx((m0 - ms0) * LOG2E)
        alpha1 = exp2_approx((m1 - ms1) * LOG2E)
        ml0 = ms0 * LOG2E
        ml1 = ms1 * LOG2E
        lt0 = ZERO
        lt1 = ZERO
        for nt in range(NT):
            for h in range(2):
                s[nt * 4 + h] = exp2_approx(s[nt * 4 + h] * LOG2E - ml0)
                lt0 += s[nt * 4 + h]
                s[nt * 4 + 2 + h] = exp2_approx(s[nt * 4 + 2 + h] * LOG2E - ml1)
                lt1 += s[nt * 4 + 2 + h]
        return alpha0, alpha1, mn0, mn1, alpha0 * l0 + lt0, alpha1 * l1 + lt1

    @cuda.jit(device=True, inline=True)
    def drop(s, col0, row0, t, b, h, seed_lo, seed_hi, keep_threshold):
        """Dropout, after softmax_step (whose row sums hold every P~: L is the undropped
        softmax's): P~ = 0 where the entry is dropped, so that P~ Vj leaves it out. The
        lane's keys 2t and 2t + 1 of each n-tile, in rows row0 and row0 + 8, lie in two
        blocks of four that lane t ^ 1 needs too: one Philox call per lane and n-tile,
        shared by a shuffle (kept_rows, a warp collective). Nothing without
        ``variant.dropout``."""
        if DROPOUT:
            for nt in range(NT):
                keep00, keep01, keep10, keep11 = kept_rows(
                    seed_lo, seed_hi, keep_threshold, b, h, row0, col0 + nt * 8 + 2 * t, t)
                if not keep00:                  # s[nt * 4], [+ 1]: row0; [+ 2], [+ 3]: + 8
                    s[nt * 4] = ZERO
                if not keep01:
                    s[nt * 4 + 1] = ZERO
                if not keep10:
                    s[nt * 4 + 2] = ZERO
                if not keep11:
                    s[nt * 4 + 3] = ZERO

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_values(o, s, V, bh_kv, col0, row0, row1, g, t, b, h, Sq, Sk,
                             causal_offset, window_lo, attn_mask, k_first=0):
        """Rare: a non-finite v of the chunk (keys from col0, K/V head bh_kv) was staged
        as 0; add p * v for those values to the O fragments o of the rows that see the
        key (the variant's visible(), as softmax_step masks). With ``rows`` V's key col
        is row k_first + col of the packed array."""
        kk = 0
        while kk < chunk:        # the chunk's keys, in step in every lane
            # P~ of this key for row0 and row1 is in lane (g, kk % 8 // 2) of the
            # quad, in s[kk // 8 * 4 + kk % 2] and the entry 2 after it.
            x0 = ZERO
            x1 = ZERO
            for nt in range(NT):
                for h in range(2):
                    if kk // 8 == nt and kk % 2 == h:
                        x0 = s[nt * 4 + h]
                        x1 = s[nt * 4 + 2 + h]
            p0 = cuda.shfl_sync(FULL_WARP, x0, g * 4 + kk % 8 // 2)
            p1 = cuda.shfl_sync(FULL_WARP, x1, g * 4 + kk % 8 // 2)
            col = col0 + kk
            if col < Sk:
                sees0 = (not MASKS or row0 < Sq) and visible(b, h, row0, col, Sk,
                                                             causal_offset, window_lo, attn_mask)
                sees1 = (not MASKS or row1 < Sq) and visible(b, h, row1, col, Sk,
                                                             causal_offset, window_lo, attn_mask)
                for nd in range(o_tiles):
                    for h in range(2):
                        k = nd * 8 + 2 * t + h
                        if k < d:
                            if ROWS:
                                v = widen(element(V, bh_kv, k_first + col, k))
                            else:
                                v = widen(V[U(bh_kv), U(col), U(k)])
                            if not finite(v):
                                if sees0:
                                    o[nd * 4 + h] += p0 * v
                                if sees1:
                                    o[nd * 4 + 2 + h] += p1 * v
            kk += 1

    @cuda.jit(device=True, inline=True)
    def write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq, keep_scale=ONE):
        """Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v3).
        With dropout O = o / l * keep_scale (1 / (1 - p)); without it keep_scale is never
        read (v3 passes none)."""
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        for nd in range(o_tiles):
            for h in range(2):
                col = nd * 8 + 2 * t + h
                if col < d:
                    if DROPOUT:
                        if row0 < Sq:
                            put(O, bh, row0, col, narrow(ZERO if l0 == ZERO
                                                         else o[nd * 4 + h] / l0 * keep_scale))
                        if row1 < Sq:
                            put(O, bh, row1, col, narrow(ZERO if l1 == ZERO
                                                         else o[nd * 4 + 2 + h] / l1
                                                         * keep_scale))
                    else:
                        if row0 < Sq:
                            put(O, bh, row0, col, narrow(ZERO if l0 == ZERO
                                                         else o[nd * 4 + h] / l0))
                        if row1 < Sq:
                            put(O, bh, row1, col, narrow(ZERO if l1 == ZERO
                                                         else o[nd * 4 + 2 + h] / l1))
        if t == 0:
            if row0 < Sq:
                L[bh, row0] = NEG_INF if l0 == ZERO else m0 + math.log(l0)
            if row1 < Sq:
                L[bh, row1] = NEG_INF if l1 == ZERO else m1 + math.log(l1)

    return MmaRowSteps(finite, whole_tile, add_nonfinite_scores, softmax_step, drop,
                       add_nonfinite_values, write_rows)
