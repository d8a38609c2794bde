"""Backward v9: v7 with its mma operands loaded by ldmatrix and its streamed tiles copied
by cp.async into two stages of shared memory (float16 and bfloat16).

Parent: v7 (v7_half.py); forward v10 made the same change to forward v7
(forward/v10_ldmatrix.py). The products, their order and everything computed from them
are v7's, so the gradients are v7's bit for bit (tests/test_backward_v9.py checks it on
the simulator). What changes is how the tiles reach the tensor cores:

* No transposed copies. v7 stores Qi and dOi a second time transposed in its dK/dV
  kernel, and Kj in its dQ kernel, one 2-byte store per element, because the B operand
  of dVj += P^T dOi, dKj += dS^T Qi and dQi += dS Kj runs along the other axis. v9 reads
  those operands from the row-major tiles with ``ldmatrix .trans`` (ptx.ldmatrix_x4_trans),
  which transposes 8 x 8 blocks on the way into registers: half the shared memory of the
  streamed tiles, and none of the staging stores that cost v7's dK/dV kernel as many
  instructions per Q tile as its products (lab/sweeps/sass_half.py counts them).
* ldmatrix everywhere. Every A and B fragment is one ``ldmatrix.x4`` (four words a lane)
  where v7 spends four or two 32-bit loads (ptx.load_b32): a quarter of the shared-memory
  instructions; and an A fragment (the block's own Kj, Vj in the dK/dV kernel, Qi, dOi in
  the dQ kernel) is loaded once per k-step for both n-tiles of a chunk, where v7 loads it
  for each.
* cp.async, double-buffered. The streamed tiles (Qi, dOi with L and D in the dK/dV
  kernel; Kj, Vj in the dQ kernel) are copied 16 bytes at a time (8 values, no register;
  L and D 4 bytes at a time) into one of two stages while the block works on the other,
  as forward v10 does with Kj and Vj: wait for this thread's copies of tile i
  (cp.async.wait_group 1), a barrier, work, and the copies of tile i + 1 already on
  their way. The tiles every block keeps (Kj, Vj; Qi, dOi) are copied the same way once.

What it buys: on the H200 at (2, 16, 4096, d), float16, the whole backward in 3.63 ms
against v7's 9.52 at d = 64 (causal 2.78 against 5.64) and 7.13 against 24.14 at d = 128
(lab/sweeps/half_sweep.py, lab/runs/2026-12-05/110_sweep_h200.txt), with v7's bits on
every timed input; 50 of 50 reruns bitwise identical, memcheck and racecheck clean
(109_reruns_v9.txt, 111_*_v9.txt there). Runs when asked for (version="v9").

Copies need d a multiple of 8 and the arrays 16-byte aligned (rows are then whole
16-byte pieces); otherwise the same threads load the same 8 values element by element
and store them (every d <= 128 runs). Rows past Sq or Sk and columns past d are written
as 0; L and D past Sq as 0 (those rows see no key, so P = dS = 0 there).

Shared rows are DP + 8 halves (DP = d rounded up to 16), as in forward v10: each
ldmatrix's 8 rows start in 8 different groups of 4 banks, so no bank conflicts.

Packed batches (``varlen``, numbaflash/varlen.py) of plain attention: a block finds its
sequence from cu_seqlens (kernels/sequences.py's ``locate``) and returns at once if its
tile lies past the sequence's end; from then on it runs the plain kernel's steps with
the sequence's first row added to every row index of the packed (total, heads, d)
arrays as they are (``copy_rows``' ``base``; kernels/sequences.py's packed rows, as
forward v8-v10 and backward v6), on a (tiles, heads, batch) grid, and with its tile
loop's bounds made known-uniform (``uniform_range``). The build before read (heads,
total, d) views and took the sequence from bh // Hq: its dK/dV kernel at d = 64, held to
128 registers, spilled 8 bytes (16 causal), its dQ kernel took about 150 registers
where the plain one needs 95-108 (ptxas, lab/sweeps/packed_half_registers.py,
lab/runs/2026-12-05/packed_half_registers.txt), and flash-attn's layout read through it
took 1.6x the copies' time with gradients (lab/runs/2026-12-06/135_layout_f16_d64_grad.txt).
The dK/dV kernel addresses L and D, C-contiguous (heads, total), from their shape (head
* total + row): from their strides, as the build with views did, its per-tile loop took
970 SASS instructions where the plain build's takes 700, and 721 from the shape (float16,
d = 64; lab/sweeps/sass_packed_v9.py, lab/runs/2026-12-07/sass_packed_v9.txt before,
sass_packed_v9_after.txt after).
A packed batch of equal lengths (flash-attn's (batch, seqlen, heads, d) layout read in
place) gives the causal dQ kernel the two lengths as kernel parameters instead of
cu_seqlens (``equal_lengths``; kernels/sequences.py says why): the same arithmetic, so
the same bits.
GQA, windows and the other variants run on v6 (``PACKED``: the plan refuses them,
naming the variant).

Finite inputs only, as v7 (the call checks them first; version="v9" with a NaN or inf is
a ValueError). Deterministic (no atomics).
Inline PTX on a GPU (sm_80 and later); on the simulator kernels/simulated.py's stand-ins
(slow). float16 and bfloat16, float32 accumulation, d <= 128, plain attention with or
without a causal mask in either alignment, in one batch or packed.
"""

import functools
import math
from collections import namedtuple
from dataclasses import replace

from numba import cuda, float32

from .. import LOG2E, acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..halves import NAMES, make_halves
from ..plan import (Plan, Plans, check_per_kernel_tiles, refuse_backward_variants,
                    rule_per_kernel_tiles, variant_description)
from ..sequences import make_packed_rows, make_sequences
from ..smem import U
from .v7_half import V7_CHUNK, _write_narrow, v7_head_dim, v7_rows

# What the layouts return, by name: offsets in halves of the one dynamic array (after the
# float32 values, F32 of them, in the dK/dV kernel), TILE the halves of one streamed tile,
# END the array's length in halves.
DkdvV9Layout = namedtuple("DkdvV9Layout", "F32 K_AT V_AT Q_AT dO_AT TILE END")
DqV9Layout = namedtuple("DqV9Layout", "Q_AT dO_AT K_AT V_AT TILE END")
# What _make_copies returns: inlined device functions, by name.
Copies = namedtuple("Copies", "copy_rows copyable")


def dkdv_v9_shared_layout(Br, Bc, d):
    """backward_dkdv_v9's dynamic shared memory: first 4 Br float32 values (stage s of
    L_i at s * 2 Br, of D_i at s * 2 Br + Br), then, in halves, Kj and Vj (Bc rows of
    v7_rows(DP)) and two stages of Qi and dOi (Br rows each; stage s of Qi at
    Q_AT + s * TILE, of dOi at dO_AT + s * TILE). ``dkdv_v9_shared_bytes`` is END * 2."""
    ROW = v7_rows(v7_head_dim(d))
    F32 = 4 * Br
    K_AT = 2 * F32                      # halves after the float32 values
    V_AT = K_AT + Bc * ROW
    TILE = Br * ROW
    Q_AT = V_AT + Bc * ROW
    dO_AT = Q_AT + 2 * TILE
    return DkdvV9Layout(F32, K_AT, V_AT, Q_AT, dO_AT, TILE, dO_AT + 2 * TILE)


def dq_v9_shared_layout(Br, Bc, d):
    """backward_dq_v9's dynamic shared memory, in halves: Qi and dOi (Br rows of
    v7_rows(DP)), then two stages of Kj and Vj (Bc rows each; stage s of Kj at K_AT + s *
    TILE, of Vj at V_AT + s * TILE). ``dq_v9_shared_bytes`` is END * 2."""
    ROW = v7_rows(v7_head_dim(d))
    dO_AT = Br * ROW
    K_AT = 2 * Br * ROW
    TILE = Bc * ROW
    V_AT = K_AT + 2 * TILE
    return DqV9Layout(0, dO_AT, K_AT, V_AT, TILE, V_AT + 2 * TILE)


def dkdv_v9_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of backward_dkdv_v9 (dkdv_v9_shared_layout)."""
    return dkdv_v9_shared_layout(Br, Bc, d).END * 2


def dq_v9_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of backward_dq_v9 (dq_v9_shared_layout)."""
    return dq_v9_shared_layout(Br, Bc, d).END * 2


@functools.lru_cache(maxsize=None)
def _make_copies(d, THREADS, half, varlen=False):
    """The tile copies both kernels use, for a block of THREADS threads and head dim d:
    ``copy_rows(smem, at, A, bh, base, first, rows, n, wide, HZERO)`` starts this thread's
    pieces of rows first .. first + rows - 1 of a sequence of n rows that starts at row
    ``base`` of A[bh] into smem from ``at`` on, and ``wide`` says whether by cp.async
    (16-byte pieces) or element by element. ``varlen``: A is a packed batch's (total,
    heads, d) array as it is (kernels/sequences.py's packed rows), ``base`` the sequence's
    first row in it; else base is 0."""
    from ..ptx import cp_async16, flat_load, is_aligned16

    position = make_packed_rows(varlen).position
    DP = v7_head_dim(d)
    ROW = v7_rows(DP)
    PIECES = DP // 8                    # 16-byte pieces of a row

    @cuda.jit(device=True, inline=True)
    def copy_rows(smem, at, A, bh, base, first, rows, n, tid, wide, HZERO):
        """Alg.2 l.6 / l.8, issued: row r of the tile (A's row first + r) into smem[at + r
        * ROW: ...], 8 columns a piece; 0 past n and past d."""
        m = tid
        while m < rows * PIECES:
            r = m // PIECES
            k0 = (m % PIECES) * 8
            dst = at + r * ROW + k0
            row = first + r
            if row < n and k0 < d:
                src = position(A, bh, base + row, n, d) + k0
                if wide:
                    cp_async16(smem, U(dst), A, U(src))
                else:
                    for e in range(8):
                        x = HZERO
                        if k0 + e < d:
                            x = flat_load(A, U(src + e))
                        smem[U(dst + e)] = x
            else:
                for e in range(8):
                    smem[U(dst + e)] = HZERO
            m += THREADS

    @cuda.jit(device=True, inline=True)
    def copyable(A):
        """Whether A's rows can be copied 16 bytes at a time: A's first element 16-byte
        aligned (d a multiple of 8 is the caller's part; a packed batch's rows are then
        H d elements apart, whole pieces too)."""
        return is_aligned16(A)

    return Copies(copy_rows, copyable)


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v9(Br, Bc, d, causal, half="float16", max_registers=None,
                          varlen=False):
    """v9 dK/dV kernel: v7's (make_backward_dkdv_v7) with ldmatrix operands and Qi, dOi,
    L_i, D_i copied by cp.async into two stages (module docstring). Warp w owns the keys
    j * Bc + 16 w .. + 16; per chunk of V7_CHUNK = 16 queries of Qi, as v7:

        S^T  = Kj Qi^T     A = Kj: ldmatrix of rows 16 w.., B = Qi: ldmatrix of query rows
        dP^T = Vj dOi^T    A = Vj, B = dOi, the same way
        P^T = exp(scale S^T - L), dS^T = P^T (dP^T - D)              float32, as v7
        dVj += P^T dOi     A = P^T (accumulators, pack2), B = dOi: ldmatrix .trans
        dKj += dS^T Qi     A = dS^T (pack2), B = Qi: ldmatrix .trans

    Per Q tile i (stage st = its parity from the first visited tile): barrier (every warp
    is done with stage 1 - st), start the copies of tile i + 1 into stage 1 - st, commit,
    wait_group 1 (this thread's copies of tile i have landed), barrier, the chunks.

    ``max_registers``: ptxas's register limit (None: ptxas's choice; the launch contract
    gives V9_DKDV_MAX_REGISTERS up to d = 64).

    Launch: grid (ceil(Sk / Bc), BH), block (2 * Bc,), ``dkdv_v9_shared_bytes`` of dynamic
    shared memory; arguments as v7's: Q, K, V, dO, L, D, dK, dV, softmax_scale,
    causal_offset. ``varlen``: a packed batch (module docstring), and the variant
    arguments after causal_offset, as the kernels that take variants have them.
    """
    from ..ptx import (cp_async, cp_async_commit, cp_async_wait_group, exp2_approx,
                       ldmatrix_x4, ldmatrix_x4_trans)

    halves = make_halves(half)
    HALF = halves.storage
    narrow, pack2, mma = halves.narrow, halves.pack2, halves.mma
    write_narrow = _write_narrow(half)
    acc = acc_type("float32")
    ZERO = acc(0)
    LOG2E_ACC = acc(LOG2E)
    assert Bc % 16 == 0 and Br % V7_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Bc                        # Bc / 16 warps of 32 lanes
    DP = v7_head_dim(d)
    ROW = v7_rows(DP)
    KS = DP // 16                           # k-steps over the head dim (S^T, dP^T)
    ND = DP // 8                            # n-tiles over the head dim (dKj, dVj), even
    NT = V7_CHUNK // 8                      # n-tiles over the queries of a chunk (2)
    ACC = ND * 4
    S_FRAGS = NT * 4
    WIDE = d % 8 == 0
    F32, K_AT, V_AT, Q_AT, dO_AT, TILE, END = dkdv_v9_shared_layout(Br, Bc, d)
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)
    copies = _make_copies(d, THREADS, half, varlen)
    copy_rows, copyable = copies.copy_rows, copies.copyable
    VARLEN = varlen
    sequences = make_sequences(VARLEN)
    locate, position = sequences.locate, sequences.position
    uniform_range = sequences.uniform_range

    @cuda.jit(device=True, inline=True)
    def start_tile(smem, smem32, Q, dO, L, D, bh, q_first, i, st, tid, Sq, wide, HZERO):
        """Alg.2 l.8, issued: Qi, dOi of Q tile i into stage st, and L_i, D_i (0 past Sq);
        the sequence's rows start at row q_first of the arrays."""
        copy_rows(smem, Q_AT + st * TILE, Q, bh, q_first, i * Br, Br, Sq, tid, wide, HZERO)
        copy_rows(smem, dO_AT + st * TILE, dO, bh, q_first, i * Br, Br, Sq, tid, wide, HZERO)
        r = tid
        while r < Br:
            row = i * Br + r
            if row < Sq:
                if VARLEN:      # L and D alike: C-contiguous (Hq, total)
                    at = bh * L.shape[1] + q_first + row
                else:
                    at = position(L, bh, q_first + row, Sq, 1)
                cp_async(smem32, U(st * 2 * Br + r), L, U(at))
                cp_async(smem32, U(st * 2 * Br + Br + r), D, U(at))
            else:
                smem32[U(st * 2 * Br + r)] = ZERO
                smem32[U(st * 2 * Br + Br + r)] = ZERO
            r += THREADS

    @cuda.jit(device=True, inline=True)
    def work(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, Hq, seqs):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x
        if VARLEN:
            # A packed batch read as it is (kernels/sequences.py): the head and the
            # sequence from the (tiles, heads, batch) grid
            q_first, k_first, Sq, Sk, shift = locate(seqs, cuda.blockIdx.z, Q.shape[0],
                                                     K.shape[0])
            if j * Bc >= Sk:
                return                  # past this sequence: the whole block, no barrier yet
        else:
            q_first, k_first, Sq, Sk, shift = locate(seqs, 0, Q.shape[1], K.shape[1])
        causal_offset += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16                   # the warp's first key within the tile
        key0 = j * Bc + w0 + g                  # this lane's two keys: key0, key0 + 8
        scale_log2 = softmax_scale * LOG2E_ACC  # exp(x) = exp2(x log2(e))
        HZERO = narrow(ZERO)        # (a 16-bit constant from outside is invalid NVVM IR)
        # The row this lane gives ldmatrix (lanes 8m .. 8m + 7: rows 0..7 of matrix m):
        # an A fragment takes rows 8 (m % 2) + lane % 8, columns 8 (m // 2); a pair of
        # n-tiles' B words (rows = the n index) rows 8 (m // 2) + lane % 8, columns
        # 8 (m % 2); .trans (rows = the k index) rows 8 (m % 2) + lane % 8, columns
        # 8 (m // 2), as forward v10's Vj.
        m = lane // 8
        a_row = (w0 + 8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2)
        b_row = (8 * (m // 2) + lane % 8) * ROW + 8 * (m % 2)
        t_row = (8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2)
        wide = WIDE and copyable(Q) and copyable(dO) and copyable(K) and copyable(V)

        smem32 = cuda.shared.array(0, float32, alignment=16)
        smem = cuda.shared.array(0, HALF, alignment=16)
        dk = cuda.local.array(ACC, acc)         # dKj fragments (v7's layout)
        dv = cuda.local.array(ACC, acc)
        s = cuda.local.array(S_FRAGS, acc)      # S^T, then P^T, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP^T, then dS^T

        # Alg.2 l.6: Kj and Vj once (zeros past Sk and past d), and the first Q tile.
        copy_rows(smem, K_AT, K, bh, k_first, j * Bc, Bc, Sk, tid, wide, HZERO)
        copy_rows(smem, V_AT, V, bh, k_first, j * Bc, Bc, Sk, tid, wide, HZERO)
        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)   # causal: skip hidden tiles
        i_start, i_end = uniform_range(i_start, i_end)  # packed: known uniform (sequences.py)
        if i_start < i_end:
            start_tile(smem, smem32, Q, dO, L, D, bh, q_first, i_start, 0, tid, Sq, wide,
                       HZERO)
        cp_async_commit()
        for x in range(ACC):
            dk[x] = ZERO
            dv[x] = ZERO

        for i in range(i_start, i_end):
            st = (i - i_start) % 2
            # Wait until every warp has finished reading stage 1 - st (tile i - 1).
            cuda.syncthreads()
            if i + 1 < i_end:
                start_tile(smem, smem32, Q, dO, L, D, bh, q_first, i + 1, 1 - st, tid, Sq,
                           wide, HZERO)
            cp_async_commit()               # (empty at the last tile: the count stays)
            cp_async_wait_group(1)          # this thread's copies of tile i have landed
            # Wait until tile i is complete (and, the first time, Kj and Vj).
            cuda.syncthreads()
            QI = Q_AT + st * TILE
            DOI = dO_AT + st * TILE
            LI = st * 2 * Br
            DI = LI + Br

            for ch in range(Br // V7_CHUNK):
                r0 = ch * V7_CHUNK              # first query of the chunk within the tile
                # Alg.2 l.10, l.13: S^T = Kj Qi^T and dP^T = Vj dOi^T (v7's products).
                s4a = (ZERO, ZERO, ZERO, ZERO)
                s4b = (ZERO, ZERO, ZERO, ZERO)
                p4a = (ZERO, ZERO, ZERO, ZERO)
                p4b = (ZERO, ZERO, ZERO, ZERO)
                for ks in range(KS):
                    k0, k1, k2, k3 = ldmatrix_x4(smem, U(K_AT + a_row + 16 * ks))
                    v0, v1, v2, v3 = ldmatrix_x4(smem, U(V_AT + a_row + 16 * ks))
                    q0, q1, q2, q3 = ldmatrix_x4(smem, U(QI + r0 * ROW + b_row + 16 * ks))
                    o0, o1, o2, o3 = ldmatrix_x4(smem, U(DOI + r0 * ROW + b_row + 16 * ks))
                    s4a = mma(k0, k1, k2, k3, q0, q1, s4a[0], s4a[1], s4a[2], s4a[3])
                    s4b = mma(k0, k1, k2, k3, q2, q3, s4b[0], s4b[1], s4b[2], s4b[3])
                    p4a = mma(v0, v1, v2, v3, o0, o1, p4a[0], p4a[1], p4a[2], p4a[3])
                    p4b = mma(v0, v1, v2, v3, o2, o3, p4b[0], p4b[1], p4b[2], p4b[3])
                for x in range(4):
                    s[x] = s4a[x]
                    s[4 + x] = s4b[x]
                    dp[x] = p4a[x]
                    dp[4 + x] = p4b[x]
                # Alg.2 l.11, l.14: P^T and dS^T on the visible (key, query) pairs (v7's).
                for nt in range(NT):
                    for x in range(4):
                        r = r0 + nt * 8 + 2 * t + x % 2        # query within the tile
                        row = i * Br + r
                        col = key0 + 8 * (x // 2)
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        L_r = smem32[U(LI + r)] * LOG2E_ACC
                        p = exp2_approx(s[y] * scale_log2 - L_r) if seen else ZERO
                        dp[y] = p * (dp[y] - smem32[U(DI + r)]) if seen else ZERO
                        s[y] = p
                # Alg.2 l.12, l.16: dVj += P^T dOi, dKj += dS^T Qi; B by ldmatrix .trans
                # of the chunk's 16 query rows, head-dim columns 8 nd.. (two n-tiles).
                pa0 = pack2(s[0], s[1])
                pa1 = pack2(s[2], s[3])
                pa2 = pack2(s[4], s[5])
                pa3 = pack2(s[6], s[7])
                ga0 = pack2(dp[0], dp[1])
                ga1 = pack2(dp[2], dp[3])
                ga2 = pack2(dp[4], dp[5])
                ga3 = pack2(dp[6], dp[7])
                for nd in range(0, ND, 2):
                    o0, o1, o2, o3 = ldmatrix_x4_trans(smem, U(DOI + r0 * ROW + t_row + 8 * nd))
                    q0, q1, q2, q3 = ldmatrix_x4_trans(smem, U(QI + r0 * ROW + t_row + 8 * nd))
                    y = nd * 4
                    v4a = mma(pa0, pa1, pa2, pa3, o0, o1, dv[y], dv[y + 1], dv[y + 2], dv[y + 3])
                    v4b = mma(pa0, pa1, pa2, pa3, o2, o3, dv[y + 4], dv[y + 5], dv[y + 6],
                              dv[y + 7])
                    k4a = mma(ga0, ga1, ga2, ga3, q0, q1, dk[y], dk[y + 1], dk[y + 2], dk[y + 3])
                    k4b = mma(ga0, ga1, ga2, ga3, q2, q3, dk[y + 4], dk[y + 5], dk[y + 6],
                              dk[y + 7])
                    for x in range(4):
                        dv[y + x] = v4a[x]
                        dv[y + 4 + x] = v4b[x]
                        dk[y + x] = k4a[x]
                        dk[y + 4 + x] = k4b[x]

        cp_async_wait_group(0)      # no copy left in flight (with no Q tile: Kj, Vj)
        # Write dKj (times the scale) and dVj, rounded to the input type once (v7's).
        for nd in range(ND):
            for x in range(4):
                col = key0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if col < Sk and k < d:
                    at = k_first + col
                    if VARLEN:
                        dK[U(at), U(bh), U(k)] = write_narrow(dk[nd * 4 + x] * softmax_scale)
                        dV[U(at), U(bh), U(k)] = write_narrow(dv[nd * 4 + x])
                    else:
                        dK[U(bh), U(at), U(k)] = write_narrow(dk[nd * 4 + x] * softmax_scale)
                        dV[U(bh), U(at), U(k)] = write_narrow(dv[nd * 4 + x])

    if VARLEN:
        @cuda.jit(**jit_options(max_registers))
        def backward_dkdv_v9(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset,
                             window_lo, Hq, group, softcap, slopes, attn_mask, tiles, seed_lo,
                             seed_hi, keep_threshold, keep_scale, seqs):
            work(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, Hq, seqs)
    else:
        @cuda.jit(**jit_options(max_registers))
        def backward_dkdv_v9(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
            work(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, 1, None)

    return backward_dkdv_v9


@functools.lru_cache(maxsize=None)
def make_backward_dq_v9(Br, Bc, d, causal, half="float16", varlen=False,
                        equal_lengths=False):
    """v9 dQ kernel: v7's (make_backward_dq_v7) with ldmatrix operands and Kj, Vj copied
    by cp.async into two stages (module docstring). Warp w owns the query rows i * Br +
    16 w .. + 16; per chunk of V7_CHUNK = 16 keys of Kj, as v7:

        S  = Qi Kj^T       A = Qi: ldmatrix of rows 16 w.., B = Kj: ldmatrix of key rows
        dP = dOi Vj^T      A = dOi, B = Vj, the same way
        P = exp(scale S - L), dS = P (dP - D)                          float32, as v7
        dQi += dS Kj       A = dS (pack2), B = Kj: ldmatrix .trans

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,), ``dq_v9_shared_bytes`` of dynamic
    shared memory; arguments as v7's: Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset;
    ``varlen`` as make_backward_dkdv_v9's; ``equal_lengths`` (with varlen): a packed batch
    of equal lengths, its ``seqs`` argument the pair (nq, nk) (kernels/sequences.py).
    """
    from ..ptx import (cp_async_commit, cp_async_wait_group, exp2_approx, ldmatrix_x4,
                       ldmatrix_x4_trans)

    halves = make_halves(half)
    HALF = halves.storage
    narrow, pack2, mma = halves.narrow, halves.pack2, halves.mma
    write_narrow = _write_narrow(half)
    acc = acc_type("float32")
    ZERO = acc(0)
    LOG2E_ACC = acc(LOG2E)
    assert Br % 16 == 0 and Bc % V7_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = v7_head_dim(d)
    ROW = v7_rows(DP)
    KS = DP // 16
    ND = DP // 8
    NT = V7_CHUNK // 8                      # n-tiles over the keys of a chunk (2)
    ACC = ND * 4
    S_FRAGS = NT * 4
    WIDE = d % 8 == 0
    Q_AT, dO_AT, K_AT, V_AT, TILE, END = dq_v9_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    copies = _make_copies(d, THREADS, half, varlen)
    copy_rows, copyable = copies.copy_rows, copies.copyable
    VARLEN = varlen
    sequences = make_sequences(VARLEN, equal=equal_lengths)
    locate, uniform_range = sequences.locate, sequences.uniform_range

    @cuda.jit(device=True, inline=True)
    def work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, Hq, seqs):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        if VARLEN:
            # A packed batch read as it is (kernels/sequences.py): the head and the
            # sequence from the (tiles, heads, batch) grid
            q_first, k_first, Sq, Sk, shift = locate(seqs, cuda.blockIdx.z, Q.shape[0],
                                                     K.shape[0])
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
        else:
            q_first, k_first, Sq, Sk, shift = locate(seqs, 0, Q.shape[1], K.shape[1])
        causal_offset += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16                   # the warp's first row within the tile
        row0 = i * Br + w0 + g                  # this lane's two rows: row0, row0 + 8
        scale_log2 = softmax_scale * LOG2E_ACC
        HZERO = narrow(ZERO)
        m = lane // 8                           # ldmatrix rows as in the dK/dV kernel
        a_row = (w0 + 8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2)
        b_row = (8 * (m // 2) + lane % 8) * ROW + 8 * (m % 2)
        t_row = (8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2)
        wide = WIDE and copyable(Q) and copyable(dO) and copyable(K) and copyable(V)

        smem = cuda.shared.array(0, HALF, alignment=16)
        dq = cuda.local.array(ACC, acc)         # dQi fragments (C layout)
        s = cuda.local.array(S_FRAGS, acc)      # S, then P, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP, then dS
        Lr = cuda.local.array(2, acc)           # L * log2(e) and D of this lane's two rows
        Dr = cuda.local.array(2, acc)

        # Alg.2 l.8 (the dQ pass): Qi and dOi once, and the first K/V tile.
        copy_rows(smem, Q_AT, Q, bh, q_first, i * Br, Br, Sq, tid, wide, HZERO)
        copy_rows(smem, dO_AT, dO, bh, q_first, i * Br, Br, Sq, tid, wide, HZERO)
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, 0)  # causal: skip hidden tiles
        j_start, j_end = uniform_range(j_start, j_end)  # packed: known uniform (sequences.py)
        if j_start < j_end:
            copy_rows(smem, K_AT, K, bh, k_first, j_start * Bc, Bc, Sk, tid, wide, HZERO)
            copy_rows(smem, V_AT, V, bh, k_first, j_start * Bc, Bc, Sk, tid, wide, HZERO)
        cp_async_commit()
        for h in range(2):
            row = row0 + 8 * h
            Lr[h] = L[U(bh), U(q_first + row)] * LOG2E_ACC if row < Sq else ZERO
            Dr[h] = D[U(bh), U(q_first + row)] if row < Sq else ZERO
        for x in range(ACC):
            dq[x] = ZERO

        for j in range(j_start, j_end):
            st = (j - j_start) % 2
            # Wait until every warp has finished reading stage 1 - st (tile j - 1).
            cuda.syncthreads()
            if j + 1 < j_end:
                copy_rows(smem, K_AT + (1 - st) * TILE, K, bh, k_first, (j + 1) * Bc, Bc, Sk,
                          tid, wide, HZERO)
                copy_rows(smem, V_AT + (1 - st) * TILE, V, bh, k_first, (j + 1) * Bc, Bc, Sk,
                          tid, wide, HZERO)
            cp_async_commit()
            cp_async_wait_group(1)          # this thread's copies of tile j have landed
            # Wait until tile j is complete (and, the first time, Qi and dOi).
            cuda.syncthreads()
            KJ = K_AT + st * TILE
            VJ = V_AT + st * TILE

            for ch in range(Bc // V7_CHUNK):
                c_0 = ch * V7_CHUNK             # first key of the chunk within the tile
                # Alg.2 l.10, l.13: S = Qi Kj^T and dP = dOi Vj^T (v7's products).
                s4a = (ZERO, ZERO, ZERO, ZERO)
                s4b = (ZERO, ZERO, ZERO, ZERO)
                p4a = (ZERO, ZERO, ZERO, ZERO)
                p4b = (ZERO, ZERO, ZERO, ZERO)
                for ks in range(KS):
                    q0, q1, q2, q3 = ldmatrix_x4(smem, U(Q_AT + a_row + 16 * ks))
                    o0, o1, o2, o3 = ldmatrix_x4(smem, U(dO_AT + a_row + 16 * ks))
                    k0, k1, k2, k3 = ldmatrix_x4(smem, U(KJ + c_0 * ROW + b_row + 16 * ks))
                    v0, v1, v2, v3 = ldmatrix_x4(smem, U(VJ + c_0 * ROW + b_row + 16 * ks))
                    s4a = mma(q0, q1, q2, q3, k0, k1, s4a[0], s4a[1], s4a[2], s4a[3])
                    s4b = mma(q0, q1, q2, q3, k2, k3, s4b[0], s4b[1], s4b[2], s4b[3])
                    p4a = mma(o0, o1, o2, o3, v0, v1, p4a[0], p4a[1], p4a[2], p4a[3])
                    p4b = mma(o0, o1, o2, o3, v2, v3, p4b[0], p4b[1], p4b[2], p4b[3])
                for x in range(4):
                    s[x] = s4a[x]
                    s[4 + x] = s4b[x]
                    dp[x] = p4a[x]
                    dp[4 + x] = p4b[x]
                # Alg.2 l.11, l.14: P and dS on the visible (row, key) pairs (v7's).
                for nt in range(NT):
                    for x in range(4):
                        h = x // 2
                        row = row0 + 8 * h
                        col = j * Bc + c_0 + nt * 8 + 2 * t + x % 2
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        p = exp2_approx(s[y] * scale_log2 - Lr[h]) if seen else ZERO
                        dp[y] = p * (dp[y] - Dr[h]) if seen else ZERO
                # Alg.2 l.15: dQi += dS Kj; B by ldmatrix .trans of the chunk's 16 key
                # rows, head-dim columns 8 nd.. (two n-tiles).
                ga0 = pack2(dp[0], dp[1])
                ga1 = pack2(dp[2], dp[3])
                ga2 = pack2(dp[4], dp[5])
                ga3 = pack2(dp[6], dp[7])
                for nd in range(0, ND, 2):
                    k0, k1, k2, k3 = ldmatrix_x4_trans(smem, U(KJ + c_0 * ROW + t_row + 8 * nd))
                    y = nd * 4
                    q4a = mma(ga0, ga1, ga2, ga3, k0, k1, dq[y], dq[y + 1], dq[y + 2], dq[y + 3])
                    q4b = mma(ga0, ga1, ga2, ga3, k2, k3, dq[y + 4], dq[y + 5], dq[y + 6],
                              dq[y + 7])
                    for x in range(4):
                        dq[y + x] = q4a[x]
                        dq[y + 4 + x] = q4b[x]

        cp_async_wait_group(0)      # no copy left in flight (with no K/V tile: Qi, dOi)
        # Write dQi (times the scale), rounded to the input type once (v7's).
        for nd in range(ND):
            for x in range(4):
                row = row0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if row < Sq and k < d:
                    if VARLEN:
                        dQ[U(q_first + row), U(bh), U(k)] = write_narrow(
                            dq[nd * 4 + x] * softmax_scale)
                    else:
                        dQ[U(bh), U(q_first + row), U(k)] = write_narrow(
                            dq[nd * 4 + x] * softmax_scale)

    if VARLEN:
        @cuda.jit(**jit_options())
        def backward_dq_v9(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                           group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                           keep_threshold, keep_scale, seqs):
            work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, Hq, seqs)
    else:
        @cuda.jit(**jit_options())
        def backward_dq_v9(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
            work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, 1, None)

    return backward_dq_v9


# --- the launch contract ------------------------------------------------------------

# Tile rule, per kernel: the first of its candidates whose kernel fits
# BWD_V9_SHARED_MEM_TARGET (or the device's maximum if lower). The dQ kernel prefers 64
# query rows (four warps) to 64 keys. Swept on the H100 at (2, 16, 4096, d), float16
# (lab/sweeps/half_sweep.py, lab/runs/2026-12-05/108_sweep_after.txt, ms for the whole
# backward): d = 64, both (64, 64) 4.27 (causal 3.73), dK/dV (64, 128) 4.42 (4.02), dQ
# (128, 64) 4.35 (3.58); d = 128, dK/dV (32, 64) with dQ (64, 32) 8.47, both (64, 64)
# (105 KB) 8.91, both (32, 64) 12.34. So: at d = 64 (64, 64) for both kernels, 55 KB each;
# at d = 128 dK/dV (32, 64), 69 KB, and dQ (64, 32), 68 KB. A caller's tiles: as v7's,
# (Br, Bc) for both kernels or ((Br, Bc), (Br, Bc)); Br and Bc multiples of 16 up to 256,
# within 227 KB.
BWD_V9_CANDIDATES = {"dkdv": ((64, 64), (32, 64), (64, 32), (32, 32), (16, 32), (16, 16)),
                     "dq": ((64, 64), (64, 32), (32, 64), (32, 32), (16, 32), (16, 16))}
BWD_V9_SHARED_MEM_TARGET = 99 * 1024
# The dK/dV kernel up to d = 64 is held to 128 registers a thread: four blocks of four
# warps then share an SM (55 KB of shared memory each), as when it was first timed
# (lab/runs/2026-12-05/108_sweep_after.txt; ptxas gave it 128 unheld then). Accumulating
# dK and dV in the mma's C operand took it to 134-138 (three blocks); held at 128 it has
# no spills without a mask, 12 bytes causal (lab/sweeps/half_registers.py,
# lab/runs/2026-12-05/half_registers.txt), and the whole backward took 3.75 ms where it
# took 4.42 before the change (lab/runs/2026-12-05/109_v9_before_after.txt, H200).
V9_DKDV_MAX_REGISTERS = 128
V9_CAP_MAX_HEAD_DIM = 64
# At d = 128 with the causal mask the dK/dV kernel spills: ptxas gives it 255 registers and
# 112 bytes of spill stores in float16 (88 in bfloat16), where summing each chunk from zero
# first took 254-255 without spills. Kept, because the whole causal backward at (2, 16,
# 4096, 128) took 5.23 ms on the H200 with it, against v7's 12.43
# (lab/runs/2026-12-05/110_sweep_h200.txt); tests/test_backward_half.py bounds it here.
V9_DKDV_SPILL_BYTES = 128
# On the simulator (kernels/simulated.py): v7's small tiles, several tile boundaries at
# the simulator's short sequences (and so both stages in use).
BWD_V9_SIM = {"dkdv": (16, 32), "dq": (32, 16)}
BWD_V9_MAX_HEAD_DIM = 128     # dKj, dVj and dQi fragments (d / 2 each a lane) in registers
SHARED_BYTES = {"dkdv": dkdv_v9_shared_bytes, "dq": dq_v9_shared_bytes}

VARIANTS = False              # plain attention only (causal in both alignments) ...
PACKED = True                 # ... in one batch or packed (kernels/plan.py: packed_only),
PACKED_ROWS = True            # the packed arrays as they are (kernels/sequences.py)
TILE_TABLE = False
BFLOAT16 = True               # reads bfloat16 inputs itself (numbaflash/dtypes.py)


def equal_lengths(kernel, p):
    """Whether the kernel named ``kernel`` is built for a packed batch of equal lengths,
    taking the pair (nq, nk) where other packed builds take cu_seqlens
    (kernels/sequences.py): the causal dQ kernel. ptxas for sm_90, float16
    (lab/sweeps/equal_lengths_registers.py, lab/runs/2026-12-07/equal_lengths_registers.txt):
    causal at d = 64 106 registers where reading cu_seqlens took 148 (the plain build
    108), four blocks of four warps on an SM instead of three; at d = 128 184 against
    190 (two blocks either way). Without the mask reading cu_seqlens takes fewer (80
    against 90 at d = 64), and the dK/dV kernel gained nothing
    (lab/runs/2026-12-06/packed_equal_lengths_registers.txt)."""
    return p.equal_lengths is not None and p.upper and kernel == "backward_dq_v9"


def refusal(p, where):
    """Why backward v9 cannot run Problem ``p`` here (its dtype or head dim), or None."""
    if p.dtype.name not in NAMES:
        other = "v3" if p.dtype.name == "float64" else "v6 or v4"
        return (f"v9 multiplies float16 and bfloat16 inputs on the 16-bit tensor cores; "
                f"{p.dtype} inputs run on {other}")
    if p.d > BWD_V9_MAX_HEAD_DIM:
        return (f"v9 keeps its dK, dV and dQ fragments in registers, which holds head dims "
                f"up to {BWD_V9_MAX_HEAD_DIM}")
    return None


def default_backward_v9_tiles(d, where):
    """The backward v9 tile rule (above): {"dkdv": (Br, Bc), "dq": (Br, Bc)} for ``where``
    (the simulator: BWD_V9_SIM); ValueError if no candidate fits (kernels/plan.py)."""
    return rule_per_kernel_tiles("v9", d, where, BWD_V9_CANDIDATES, SHARED_BYTES,
                                 BWD_V9_SHARED_MEM_TARGET, BWD_V9_SIM)


def check_backward_v9_tiles(tiles, d):
    """A caller's backward v9 tiles: (Br, Bc) for both kernels, or ((Br, Bc), (Br, Bc)) for
    the dK/dV kernel and the dQ kernel. Returns {"dkdv": ..., "dq": ...}; ValueError names
    the limit (kernels/plan.py)."""
    return check_per_kernel_tiles("v9", tiles, d, SHARED_BYTES, V7_CHUNK)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v9 for Problem ``p``: D, then dK/dV with grid (Tc, BH) and
    2 Bc threads, then dQ with grid (Tr, BH) and 2 Br threads, both with dynamic shared
    memory, each kernel its own tiles. ValueError for float32 and float64 inputs, d > 128
    and every variant (as v7)."""
    refuse_backward_variants("v9", p, packed=True)
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"backward v9 cannot run this input: {why}")
    if tiles is None:
        per_kernel = default_backward_v9_tiles(p.d, where)
        reason += f"; tiles by the v9 rule for d={p.d} (each kernel its own)"
    else:
        per_kernel = check_backward_v9_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    reason += ("; v7's products with ldmatrix operands and cp.async copies into two stages "
               "(bitwise v7's gradients); finite inputs only (checked on the GPU)")
    if p.dtype.name == "bfloat16":
        reason += "; reads the bfloat16 inputs as their bits"
        preprocess = replace(preprocess,
                             reason=preprocess.reason + "; dO and O read as bfloat16 bits")
    # a packed batch: a (tiles, heads, batch) grid (kernels/sequences.py's packed rows)
    heads = (p.Hq, p.B) if p.variant.varlen else (p.BH,)
    Br, Bc = per_kernel["dkdv"]
    dkdv = Plan("backward dK dV", "v9", "backward_dkdv_v9", where, Br, Bc,
                (math.ceil(p.Sk / Bc),) + heads, (2 * Bc,), dkdv_v9_shared_bytes(Br, Bc, p.d),
                p.acc_dtype, p.causal, reason + "; one block per K/V tile, each warp 16 keys",
                variant=variant_description(p), dynamic_shared=True)
    Br, Bc = per_kernel["dq"]
    dq_reason = reason + "; one block per Q tile, each warp 16 query rows"
    if equal_lengths("backward_dq_v9", p):
        dq_reason += ("; every sequence {} query rows and {} keys, taken as kernel "
                      "parameters rather than read from cu_seqlens").format(*p.equal_lengths)
    dq = Plan("backward dQ", "v9", "backward_dq_v9", where, Br, Bc,
              (math.ceil(p.Sq / Br),) + heads, (2 * Br,), dq_v9_shared_bytes(Br, Bc, p.d),
              p.acc_dtype, p.causal, dq_reason, variant=variant_description(p),
              dynamic_shared=True)
    return Plans((preprocess, dkdv, dq))


def kernel(plan, p):
    """The compiled kernel of one of v9's plans (cached per compile-time parameters), for
    the Problem's input type (float16, or bfloat16 read as bits)."""
    if plan.kernel == "backward_dkdv_v9":
        cap = V9_DKDV_MAX_REGISTERS if p.d <= V9_CAP_MAX_HEAD_DIM else None
        return make_backward_dkdv_v9(plan.Br, plan.Bc, p.d, p.upper, p.dtype.name,
                                     max_registers=cap, varlen=p.variant.varlen)
    return make_backward_dq_v9(plan.Br, plan.Bc, p.d, p.upper, p.dtype.name,
                               varlen=p.variant.varlen,
                               equal_lengths=equal_lengths(plan.kernel, p))
