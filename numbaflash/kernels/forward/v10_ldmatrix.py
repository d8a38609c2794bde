"""Forward v10: v7 with its mma operands loaded by ldmatrix and its K/V tiles copied by
cp.async into two stages of shared memory (float16 and bfloat16).

Parent: v7 (v7_float16.py). What changes is how Kj and Vj reach the tensor cores; the
products, their order and everything after them are v7's, so the results are v7's bit
for bit (tests/test_forward_v10.py checks it on the simulator):

* Vj untransposed. v7 stores Vj transposed, one 2-byte store per element, so that each
  B word of P~ Vj (two keys of one column) is one 32-bit load. v10 stores Vj as V is
  stored (row-major) and reads those words with ``ldmatrix .trans`` (ptx.ldmatrix_x4_trans),
  which transposes 8 x 8 blocks on the way into registers.
* ldmatrix for K and V. v7 reads every B word with its own 32-bit shared load (two a
  product). One ``ldmatrix.x4`` (ptx.ldmatrix_x4) gives a lane the b0, b1 words of two
  n-tiles: a quarter of the load instructions.
* cp.async, double-buffered. v7's threads load K and V into registers (four elements in
  flight), test each for finiteness and store it, and every warp waits for that at each
  tile. In v10 each thread starts 16-byte copies (ptx.cp_async16, 8 values, no register)
  of tile j + 1 into the other stage while the block computes tile j; at the next tile
  it waits for its own copies (cp.async.wait_group 1), tests them for NaN and inf in
  shared memory (a 32-bit load per two values; a non-finite one is zeroed there and
  flagged, as v7 stages it), and a barrier makes the tile everyone's.
* Qi's A fragments stay in registers, and P~ stays in registers as the A operand of
  P~ Vj, as in v7.

What it buys: fewer shared-memory instructions per product and the K/V loads off the
critical path (FlashAttention-2's ingredients that v7 lacks). Measured on the H100
(lab/runs/2026-12-05/105_half_speed.txt, scripts/half_gpu.py --parts speed
--forward-versions default,v10, float16): at (2, 16, 4096, 128) 3.49 ms against v7's 5.14
(1.47x), causal 2.12 against 3.30 (1.56x); at d = 64 from 0.95x (not causal, 16384) to
1.16x (causal, 4096) v7's speed, mixed. So the policy runs v10 for plain attention at
64 < d <= 128 with d a multiple of 8, and v7 below. Nsight Compute at (2, 16, 4096, 64)
(lab/runs/2026-12-05/104_ncu_v10.txt): one block of 8 warps per SM (registers and shared
memory each allow one), issue slots 42% busy, the integer ALU the busiest pipe (36%):
address arithmetic and too few warps to hide latency, not the tensor cores, limit it.

Shared memory (v10_shared_layout): two stages of Kj and Vj, Bc rows each, row-major,
rows of ROW = DP + 8 halves (DP = d rounded up to the mma's k = 16). ldmatrix reads an
8 x 8 matrix as 8 rows of 16 bytes; with the 16-byte pad a row is DP / 8 + 1 (odd)
16-byte units long, so the 8 rows of a matrix start in 8 different groups of 4 banks:
no bank conflict. Padding rather than an XOR swizzle: it keeps each row's address
arithmetic one multiply-add, costs DP / (DP + 8) of the space (89% used at d = 64, 94%
at d = 128), and every row still starts 16-byte aligned for the copies.

Copies: 16 bytes need d a multiple of 8 and K and V 16-byte aligned (their first
elements; rows are then aligned too). Otherwise (checked in the kernel, the same in
every thread) the same threads load the same 8 values element by element and store
them: every head dim d <= 128 runs, the odd ones without the asynchronous copies.

Inline PTX, ldmatrix, cp.async and warp shuffles on a GPU (sm_80 and later); on the
simulator kernels/simulated.py's stand-ins. float16 and bfloat16 inputs, d <= 128, plain
attention with or without a causal mask (both alignments), in one batch or packed; GQA and
the other variants (window, softcap, ALiBi, masks, score and mask functions, dropout) are
refused by name in the plan (v7 takes them).

Packed batches (``varlen``, numbaflash/varlen.py) of plain attention: a block finds its
sequence from cu_seqlens (kernels/sequences.py's ``locate``) and returns at once if its
tile lies past the sequence's end. It takes the packed arrays as they are, C-contiguous
(total, heads, d) (``PACKED_ROWS``; kernels/sequences.py's make_packed_rows), adds the
sequence's first query or key row to every row index (no view, no strided index), runs
on a (tiles, heads, batch) grid (no division for the block's head and sequence), and
makes its tile loop's bounds known-uniform (``uniform_range``). The build before, with
views cut to the sequence, took 172 registers at d = 64 against the plain build's 128,
and ran at 0.41x its speed on flash-attn's layout
(lab/runs/2026-12-06/118_torch_layout.txt); this one takes the plain build's registers,
128 at d = 64 and 166-170 at d = 128, unheld (ptxas for sm_90,
lab/runs/2026-12-06/packed_rows_registers.txt).
"""

import functools
import math
from collections import namedtuple

from numba import cuda, int32

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..halves import NAMES, make_halves
from ..plan import (
    DYNAMIC_SHARED_MEM_LIMIT, Plan, device_dynamic_shared_limit, parse_tiles, refuse_variants,
    variant_description
)
from ..sequences import make_packed_rows, make_sequences
from ..smem import U
from ..variants import PLAIN
from .mma_rows import make_mma_row_steps
from .v7_float16 import V7_CANDIDATES, V7_MAX_HEAD_DIM, V7_WIDE_MAX_HEAD_DIM, v7_chunk

# What v10_shared_layout returns, by name.
V10Layout = namedtuple("V10Layout", "ROW TILE K_AT V_AT END")


def v10_shared_layout(Bc, d):
    """Where forward v10's tiles sit in its one dynamic array of 16-bit values: (ROW,
    TILE, K_AT, V_AT, END). Stage s (0 or 1) of Kj starts at K_AT + s * TILE, of Vj at
    V_AT + s * TILE; each is Bc rows of ROW = DP + 8 halves, row-major (key c's column k
    at c * ROW + k), DP = d rounded up to 16. The 8-half pad makes every ldmatrix
    conflict-free (module docstring). ``v10_shared_bytes`` is END * 2."""
    DP = (d + 15) // 16 * 16
    ROW = DP + 8
    TILE = Bc * ROW
    return V10Layout(ROW, TILE, 0, 2 * TILE, 4 * TILE)


@functools.lru_cache(maxsize=None)
def make_forward_v10(Br, Bc, d, causal, chunk, half="float16", max_registers=None,
                     varlen=False):
    """v10: v7 with ldmatrix loads of Kj and Vj (Vj untransposed) and cp.async copies of
    the next K/V tile into the other of two stages (module docstring). float16 or bfloat16
    (``half``, kernels/halves.py), d <= 128, plain attention, ``causal`` as v7's.

    ``chunk``: keys per online-softmax step, a multiple of 16 dividing Bc (v7_chunk);
    with v7's chunk the same results as v7, bit for bit. ``max_registers``: ptxas's
    register limit (None: ptxas's choice), a knob for lab/sweeps/half_sweep.py.

    Per K/V tile j (stage st = its parity from the first visited tile):

        barrier                      every warp has read stage 1 - st (tile j - 1)
        start copies of tile j + 1 into stage 1 - st; commit
        wait_group 1                 this thread's copies of tile j have landed
        test them for NaN and inf    zero those in place, flag the tile (bad[1], bad[2])
        barrier                      tile j complete and tested, bad up to date
        S = Qi Kj^T, softmax step, O += P~ Vj   (v7's products and mma_rows' steps)

    A thread copies 16-byte pieces (8 columns of a row): piece n of the tile, for n =
    tid, tid + 2 Br, ..., is row n // (DP / 8), columns 8 (n % (DP / 8)) on; rows past
    Sk and columns past d are written as 0 (a stale NaN there would reach O through the
    0 it is multiplied by).

    Launch: grid (ceil(Sq / Br), BH) (a packed batch: (ceil(longest Sq / Br), Hq, B)),
    block (2 * Br,): Br / 16 warps of 16 query rows, and
    ``v10_shared_layout(Bc, d).END * 2`` bytes of dynamic shared memory. Arguments: Q, K, V,
    O, L, softmax_scale, causal_offset (kernels/forward/__init__.py). ``varlen``: a packed
    batch (module docstring): Q, O (total_q, Hq, d), K, V (total_k, Hq, d) C-contiguous,
    L (Hq, total_q), and the variant arguments after causal_offset, as the kernels that
    take variants have them (their seqs last).
    """
    from numba.types import uint32

    from ..ptx import (  # inline PTX (simulator: simulated.py)
        cp_async16, cp_async_commit, cp_async_wait_group, flat_load, is_aligned16,
        ldmatrix_x4, ldmatrix_x4_trans, load_b32)

    halves = make_halves(half)
    HALF = halves.storage                   # float16, or uint16 holding bfloat16 bits
    widen, narrow, pack2, mma = halves.widen, halves.narrow, halves.pack2, halves.mma
    # A 16-bit value is NaN or inf iff its exponent bits are all ones.
    EXP = uint32(0x7C00 if half == "float16" else 0x7F80)
    EXP_HI = uint32(int(EXP) << 16)

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 16 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = (d + 15) // 16 * 16                # head dim padded to the mma's k = 16
    KS = DP // 16                           # mma steps over the head dim (S = Q K^T)
    ND = DP // 8                            # n-tiles of 8 columns of O (even)
    NT = CHUNK // 8                         # n-tiles of 8 keys of S in a chunk (even)
    PK = CHUNK // 16                        # mma steps over the keys of a chunk (P~ V)
    Q_WORDS = KS * 4
    P_WORDS = PK * 4
    O_FRAGS = ND * 4
    S_FRAGS = NT * 4
    PIECES = DP // 8                        # 16-byte pieces of a tile row
    COPIES = -(-Bc * PIECES // THREADS)     # pieces of a tile per thread (the last partly)
    WIDE = d % 8 == 0                       # rows of K and V are whole 16-byte pieces
    ROW, TILE, K_AT, V_AT, END = v10_shared_layout(Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    rows = make_mma_row_steps(d, causal, CHUNK, ND, PLAIN, half, rows=varlen)
    finite, add_nonfinite_scores = rows.finite, rows.add_nonfinite_scores
    softmax_step, add_nonfinite_values = rows.softmax_step, rows.add_nonfinite_values
    write_rows, whole_tile_seen = rows.write_rows, rows.whole_tile
    VARLEN = varlen
    sequences = make_sequences(VARLEN)
    locate, uniform_range = sequences.locate, sequences.uniform_range
    element, position = make_packed_rows(VARLEN).element, make_packed_rows(VARLEN).position

    @cuda.jit(device=True, inline=True)
    def q_value(Q, bh, r, k, Sq, bad):
        """Q[bh, r, k] as float32, 0 past the rows or the head dim, and 0 if not finite
        (then bad[0] is set); v7's."""
        x = widen(element(Q, bh, r, k)) if r < Sq and k < d else ZERO
        if not finite(x):
            bad[0] = 1
            x = ZERO
        return x

    @cuda.jit(device=True, inline=True)
    def start_copies(smem, K, V, bh, k_first, jn, st, tid, Sk, wide, HZERO):
        """Alg.1 l.7, issued: this thread's pieces of Kj and Vj for tile jn into stage st,
        by cp.async when ``wide`` (16-byte rows, aligned arrays), else loaded and stored
        here; 0 past Sk and d. The sequence's keys start at row k_first of K and V."""
        for u in range(COPIES):
            n = tid + u * THREADS
            if n < Bc * PIECES:
                r = n // PIECES
                k0 = (n % PIECES) * 8
                at = r * ROW + k0
                key = jn * Bc + r
                if key < Sk and k0 < d:
                    src = position(K, bh, k_first + key, Sk, d) + k0
                    if wide:
                        cp_async16(smem, U(K_AT + st * TILE + at), K, U(src))
                        cp_async16(smem, U(V_AT + st * TILE + at), V, U(src))
                    else:
                        for e in range(8):
                            kx = HZERO
                            vx = HZERO
                            if k0 + e < d:
                                kx = flat_load(K, U(src + e))
                                vx = flat_load(V, U(src + e))
                            smem[U(K_AT + st * TILE + at + e)] = kx
                            smem[U(V_AT + st * TILE + at + e)] = vx
                else:
                    for e in range(8):
                        smem[U(K_AT + st * TILE + at + e)] = HZERO
                        smem[U(V_AT + st * TILE + at + e)] = HZERO

    @cuda.jit(device=True, inline=True)
    def all_finite(smem, at):
        """Whether the 8 values smem[at:at + 8] are all finite (exponents not all ones)."""
        ok = True
        for w in range(4):
            word = load_b32(smem, U(at + 2 * w))
            if (word & EXP) == EXP or (word & EXP_HI) == EXP_HI:
                ok = False
        return ok

    @cuda.jit(device=True, inline=True)
    def zero_nonfinite(smem, at, bad, which, mark, HZERO):
        """Rare: the non-finite values of smem[at:at + 8] set to 0, and bad[which] raised to
        ``mark`` (as v7 stages them)."""
        for e in range(8):
            if not finite(widen(smem[U(at + e)])):
                smem[U(at + e)] = HZERO
                cuda.atomic.max(bad, which, mark)

    @cuda.jit(device=True, inline=True)
    def test_copies(smem, bad, j, st, tid, Sk, HZERO):
        """Alg.1 l.7, landed: this thread's pieces of tile j (stage st), which only it has
        written, tested for NaN and inf; those are zeroed and flagged (bad[1] for K,
        bad[2] for V, raised to j + 1) for the fix-ups of mma_rows."""
        mark = int32(j + 1)
        for u in range(COPIES):
            n = tid + u * THREADS
            if n < Bc * PIECES:
                r = n // PIECES
                k0 = (n % PIECES) * 8
                if j * Bc + r < Sk and k0 < d:
                    at = r * ROW + k0
                    if not all_finite(smem, K_AT + st * TILE + at):
                        zero_nonfinite(smem, K_AT + st * TILE + at, bad, 1, mark, HZERO)
                    if not all_finite(smem, V_AT + st * TILE + at):
                        zero_nonfinite(smem, V_AT + st * TILE + at, bad, 2, mark, HZERO)

    @cuda.jit(device=True, inline=True)
    def copyable(A):
        """Whether A's rows can be copied 16 bytes at a time: A's first element 16-byte
        aligned (d a multiple of 8 is WIDE's part: a packed batch's rows are then H d
        elements apart, whole pieces too)."""
        return is_aligned16(A)

    @cuda.jit(device=True, inline=True)
    def work(Q, K, V, O, L, softmax_scale, causal_offset, Hq, seqs):
        i = cuda.blockIdx.x
        # A packed batch: this block's sequence (kernels/sequences.py). Every row index
        # below adds the sequence's first query row (q_first) or key row (k_first) of the
        # packed arrays; 0 in one batch.
        if VARLEN:
            bh = cuda.blockIdx.y                # the head (query and K/V head alike)
            b = cuda.blockIdx.z                 # the sequence: no division (module doc.)
            Sq, Sk = Q.shape[0], K.shape[0]     # (locate: the sequence's own)
        else:
            bh = cuda.blockIdx.y                # b * H + h (query and K/V head alike)
            b = 0
            Sq, Sk = Q.shape[1], K.shape[1]
        q_first, k_first, Sq, Sk, shift = locate(seqs, b, Sq, Sk)
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
        causal_offset += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g               # this lane's two rows within the tile
        row0 = i * Br + r0
        row1 = row0 + 8
        # The row this lane gives ldmatrix (lanes 8m .. 8m + 7: rows 0..7 of matrix m):
        # for Kj, keys 8 (m // 2) + lane % 8 of an n-tile pair, columns 8 (m % 2) of a
        # k-step; for Vj, keys 8 (m % 2) + lane % 8 of a k-step, columns 8 (m // 2) of
        # an n-tile pair (make_forward_v10's docstring, kernels/ptx.py).
        m = lane // 8
        k_row = (8 * (m // 2) + lane % 8) * ROW + 8 * (m % 2)
        v_row = (8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2)
        HZERO = narrow(ZERO)        # (a float16 constant from outside is invalid NVVM IR)
        # 16-byte copies where every row of K and V is 16-byte aligned (the same in
        # every thread); else element by element.
        wide = WIDE and copyable(K) and copyable(V)

        # The block's dynamic shared memory: two stages of Kj and Vj (v10_shared_layout).
        smem = cuda.shared.array(0, HALF, alignment=16)
        bad = cuda.shared.array(3, int32)       # non-finite inputs staged as 0 (as v7)
        q = cuda.local.array(Q_WORDS, uint32)   # Q's A fragments, two halves a word
        o = cuda.local.array(O_FRAGS, acc)      # O fragments
        s = cuda.local.array(S_FRAGS, acc)      # S, then P~, fragments of a chunk
        p = cuda.local.array(P_WORDS, uint32)   # P~ as the A fragments of P~ Vj

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        # Wait until bad is clear.
        cuda.syncthreads()
        # Only the tiles the causal band leaves work in (bands.py).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, 0)
        j_start, j_end = uniform_range(j_start, j_end)  # packed: known uniform (sequences.py)
        # The first tile's copies, on their way while Qi is read.
        if j_start < j_end:
            start_copies(smem, K, V, bh, k_first, j_start, 0, tid, Sk, wide, HZERO)
        cp_async_commit()
        # Alg.1 l.4: Qi's A fragments (zero past Sq and d), as v7: word ks * 4 + w holds
        # row row0 (w even) or row1 (w odd), columns 16 ks + 2t (+ 8 for w >= 2) and the next.
        for ks in range(KS):
            for w in range(4):
                row = q_first + row0 + 8 * (w % 2)
                col = ks * 16 + 2 * t + 8 * (w // 2)
                q[ks * 4 + w] = pack2(q_value(Q, bh, row, col, q_first + Sq, bad),
                                      q_value(Q, bh, row, col + 1, q_first + Sq, bad))
        for x in range(O_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        for j in range(j_start, j_end):
            st = (j - j_start) % 2
            mark = int32(j + 1)
            # Wait until every warp has finished reading stage 1 - st (tile j - 1).
            cuda.syncthreads()
            # Alg.1 l.7 for tile j + 1, into the other stage while this one is used.
            if j + 1 < j_end:
                start_copies(smem, K, V, bh, k_first, j + 1, 1 - st, tid, Sk, wide, HZERO)
            cp_async_commit()               # (empty at the last tile: the count stays)
            cp_async_wait_group(1)          # this thread's copies of tile j have landed
            test_copies(smem, bad, j, st, tid, Sk, HZERO)
            # Wait until Kj and Vj are complete and tested (and, for j = j_start, bad[0]).
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark     # the same in every thread
            fix_values = bad[2] == mark
            whole_tile = whole_tile_seen(i * Br, i * Br + Br - 1, j * Bc, j * Bc + Bc - 1, Sk,
                                         causal_offset, 0)
            KJ = K_AT + st * TILE + k_row           # this lane's ldmatrix row in Kj, Vj
            VJ = V_AT + st * TILE + v_row

            for ch in range(Bc // CHUNK):
                key0 = ch * CHUNK
                # Alg.1 l.8: S = Qi Kj^T, one mma per 16 x 8 x 16 block (v7's order); one
                # ldmatrix gives b0, b1 of n-tiles nt and nt + 1.
                for nt in range(0, NT, 2):
                    acc_a = (ZERO, ZERO, ZERO, ZERO)
                    acc_b = (ZERO, ZERO, ZERO, ZERO)
                    for ks in range(KS):
                        b0, b1, b2, b3 = ldmatrix_x4(smem, U(KJ + (key0 + nt * 8) * ROW
                                                             + 16 * ks))
                        acc_a = mma(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                    b0, b1, acc_a[0], acc_a[1], acc_a[2], acc_a[3])
                        acc_b = mma(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                    b2, b3, acc_b[0], acc_b[1], acc_b[2], acc_b[3])
                    for x in range(4):
                        s[nt * 4 + x] = acc_a[x]
                        s[nt * 4 + 4 + x] = acc_b[x]
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, bh, bh, k_first + j * Bc + key0,
                                         q_first + row0, t, q_first + Sq, k_first + Sk)
                # Alg.1 l.9 (as v7): scale, mask, new running max, P~ in s, alpha.
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, 0, 0, Sq, Sk,
                    causal_offset, 0, 0, 0, 0, m0, m1, l0, l1)
                # Alg.1 l.10: O = diag(alpha) O + P~ Vj, P~ rounded as v7 rounds it.
                for pk in range(PK):
                    for w in range(4):
                        x = (2 * pk + w // 2) * 4 + 2 * (w % 2)
                        p[pk * 4 + w] = pack2(s[x], s[x + 1])
                for nd in range(0, ND, 2):
                    acc_a = (ZERO, ZERO, ZERO, ZERO)
                    acc_b = (ZERO, ZERO, ZERO, ZERO)
                    for pk in range(PK):
                        # B[k, n] = Vj[k, n]: .trans gives b0, b1 of columns 8 nd and
                        # 8 (nd + 1) from Vj's rows (keys) 16 pk on.
                        b0, b1, b2, b3 = ldmatrix_x4_trans(smem, U(VJ + (key0 + 16 * pk) * ROW
                                                                   + 8 * nd))
                        acc_a = mma(p[pk * 4], p[pk * 4 + 1], p[pk * 4 + 2], p[pk * 4 + 3],
                                    b0, b1, acc_a[0], acc_a[1], acc_a[2], acc_a[3])
                        acc_b = mma(p[pk * 4], p[pk * 4 + 1], p[pk * 4 + 2], p[pk * 4 + 3],
                                    b2, b3, acc_b[0], acc_b[1], acc_b[2], acc_b[3])
                    # The chunk's P~ Vj is summed from zero, then added to the rescaled O
                    # (as v7).
                    o[nd * 4] = o[nd * 4] * alpha0 + acc_a[0]
                    o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + acc_a[1]
                    o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + acc_a[2]
                    o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + acc_a[3]
                    o[nd * 4 + 4] = o[nd * 4 + 4] * alpha0 + acc_b[0]
                    o[nd * 4 + 5] = o[nd * 4 + 5] * alpha0 + acc_b[1]
                    o[nd * 4 + 6] = o[nd * 4 + 6] * alpha1 + acc_b[2]
                    o[nd * 4 + 7] = o[nd * 4 + 7] * alpha1 + acc_b[3]
                if fix_values:          # rare: a non-finite v was staged as 0 (as v7)
                    add_nonfinite_values(o, s, V, bh, j * Bc + key0, row0, row1, g, t, 0, 0,
                                         Sq, Sk, causal_offset, 0, 0, k_first)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v7).
        write_rows(O, L, o, bh, q_first + row0, q_first + row1, t, m0, m1, l0, l1,
                   q_first + Sq)

    if VARLEN:
        @cuda.jit(**jit_options(max_registers))
        def forward_v10(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group,
                        softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold,
                        keep_scale, seqs):
            work(Q, K, V, O, L, softmax_scale, causal_offset, Hq, seqs)
    else:
        @cuda.jit(**jit_options(max_registers))
        def forward_v10(Q, K, V, O, L, softmax_scale, causal_offset):
            work(Q, K, V, O, L, softmax_scale, causal_offset, 1, None)

    return forward_v10


# --- the launch contract ------------------------------------------------------------
#
# Tile rule: v7's (its candidates and chunks, the tiles measured best for v7), each
# candidate taken if v10's two stages fit the GPU's per-block maximum: (128, 128) at
# d <= 64 (72 KB), (128, 64) with 16-key chunks above (68 KB at d = 128). Swept on the
# H100 at (2, 16, 4096, d), float16 (lab/runs/2026-12-05/108_sweep_after.txt, ms not causal
# / causal): d = 64, (128, 128) with 128 registers 1.18 / 1.07, (64, 64) 1.55 / 0.98,
# (64, 128) 1.80 / 1.14, 64-key chunks 1.44 / 1.08; d = 128, (128, 64) 2.83, (128, 128)
# 2.76, (64, 64) 3.10, (64, 32) 3.18. A caller's tiles: Br a multiple of 16 up to 256, Bc a
# multiple of 32.

V10_SIM_TILES = (32, 32)      # the simulator: two warps, a tile boundary at short lengths
# Up to d = 64 ptxas is held to 128 registers a thread (it takes 130-132 unheld, no spills
# at 128 without a causal mask, 48 bytes of stack causal): 256 threads x 128 fill half
# the register file, so two blocks share an SM. Measured on the H100 at (2, 16, 4096, 64),
# float16 (lab/sweeps/half_sweep.py, lab/runs/2026-12-05/108_sweep_after.txt): 1.18 ms
# against 1.49 unheld, causal 1.07 against 1.09. At d = 128 the cap spills (88 bytes at
# (64, 64)) and was slower: 4.03 ms against 3.10.
V10_MAX_REGISTERS = 128
V10_CAP_MAX_HEAD_DIM = 64
V10_MAX_HEAD_DIM = V7_MAX_HEAD_DIM
VARIANTS = False              # plain attention only (refuse_variants names the variant) ...
PACKED = True                 # ... in one batch or packed (kernels/plan.py: packed_only),
PACKED_ROWS = True            # the packed arrays as they are (kernels/sequences.py)
BFLOAT16 = True               # reads bfloat16 inputs itself (numbaflash/dtypes.py)
TILE_TABLE = False


def v10_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v10 (v10_shared_layout), 16-bit values."""
    return v10_shared_layout(Bc, d).END * 2


def refusal(p, where):
    """Why forward v10 cannot run Problem ``p`` here, or None if it can."""
    if p.dtype.name not in NAMES:
        return (f"v10 multiplies float16 and bfloat16 inputs on the 16-bit tensor cores; "
                f"{p.dtype} inputs run on v8 or v9 (float32) or v2 (float64)")
    if p.d > V10_MAX_HEAD_DIM:
        return (f"v10 keeps its O fragments in registers, which holds head dims up to "
                f"{V10_MAX_HEAD_DIM}")
    return None


def tiles_within(d, limit):
    """The first of v7's candidates (from (128, 64) when d > 64) whose two stages fit
    ``limit`` bytes, or None."""
    candidates = V7_CANDIDATES if d <= V7_WIDE_MAX_HEAD_DIM else V7_CANDIDATES[1:]
    return next(((Br, Bc) for Br, Bc in candidates if v10_shared_bytes(Br, Bc, d) <= limit),
                None)


def check_v10_tiles(tiles, d):
    """A caller's forward v10 tiles; ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
    if Br % 16 or Br > 256 or Bc % 32:
        raise ValueError(f"v10 tiles must be (Br, Bc) with Br a multiple of 16 up to 256 "
                         f"(warps of 16 query rows) and Bc a multiple of 32 (keys in chunks "
                         f"of up to 32, n-tiles in pairs for ldmatrix); got ({Br}, {Bc})")
    need = v10_shared_bytes(Br, Bc, d)
    if need > DYNAMIC_SHARED_MEM_LIMIT:
        raise ValueError(f"v10 tiles ({Br}, {Bc}) need {need} bytes of shared memory at head "
                         f"dim {d} (two stages of Kj and Vj); the limit is "
                         f"{DYNAMIC_SHARED_MEM_LIMIT} (227 KB dynamic shared memory per "
                         f"block on the H100/H200)")
    return Br, Bc


def plan(p, where, tiles, reason):
    """The Plan of forward v10 for Problem ``p``: grid (Tr, B * H), 2 Br threads a block;
    plain attention (causal or not) only."""
    refuse_variants("v10", p, packed=True)
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"forward v10 cannot run this input: {why}")
    if tiles is None and where == "simulator":
        Br, Bc = V10_SIM_TILES
        reason += f"; tiles by the v10 rule for d={p.d} on the simulator"
    elif tiles is None:
        limit = device_dynamic_shared_limit(where)
        found = tiles_within(p.d, limit)
        if found is None:
            raise ValueError(f"forward v10 cannot run this input: no v10 tile fits head dim "
                             f"{p.d} within {limit} bytes of shared memory")
        Br, Bc = found
        reason += f"; tiles by the v10 rule for d={p.d}"
    else:
        Br, Bc = check_v10_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    # A packed batch's grid names the head and the sequence apart (no division in the
    # kernel: module docstring)
    grid = ((math.ceil(p.Sq / Br), p.Hq, p.B) if p.variant.varlen
            else (math.ceil(p.Sq / Br), p.BH))
    return Plan("forward", "v10", "forward_v10", where, Br, Bc, grid, (2 * Br,),
                v10_shared_bytes(Br, Bc, p.d), p.acc_dtype, p.causal, reason,
                variant_description(p), dynamic_shared=True)


def v10_max_registers(d):
    """ptxas's register limit for forward v10 at head dim d, packed or not:
    V10_MAX_REGISTERS up to V10_CAP_MAX_HEAD_DIM, else None (ptxas's choice). The packed
    build unheld took 128 registers with CUDA 13.5's ptxas
    (lab/runs/2026-12-06/packed_rows_registers.txt) but 129 with the H100's toolchain,
    one block an SM, and ran at 1.41x the plain build's time at (2, 4096, 16, 64) in
    float16; held to 128 (24 bytes of spill) at 1.025x
    (lab/runs/2026-12-06/132_flash_layout_parts*.txt)."""
    return V10_MAX_REGISTERS if d <= V10_CAP_MAX_HEAD_DIM else None


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v10(plan.Br, plan.Bc, p.d, p.upper, v7_chunk(p.d, plan.Bc),
                            half=p.dtype.name,
                            max_registers=v10_max_registers(p.d),
                            varlen=p.variant.varlen)
