"""Packed batches: how a thread block finds its sequence (``Variant.varlen``).

A packed (variable-length) batch keeps B sequences back to back, with no padding: q is
(total_q, Hq, d) and sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of it; k and
v likewise with cu_seqlens_k. The kernels see the packed arrays through (heads, total, d)
views (strides only, no copy: numbaflash/varlen.py makes them) and one more run-time
argument, ``seqs`` = (cu_seqlens_q, cu_seqlens_k) as a (2, B + 1) int32 array. The grid
is the padded one, sized for the longest sequence: its batch index b names the sequence.

A block of sequence b cuts each array to that sequence's rows (``cut``: a view, nothing
is copied) and from then on runs exactly as for a batch of one, batch index 0 in memory:

    Sq, Sk          the sequence's own lengths (the views' shapes); a block whose tile
                    starts past them returns at once, before any barrier
    causal_offset   shifted by Sk - Sq (``locate``'s shift), and window_lo with it: the
    window_lo       host passes the offsets of a square problem, and each sequence's
                    mask is aligned bottom-right within it, as attention()'s
    b               still the sequence's index for ALiBi's (batch, heads) slopes and for
                    dropout's Philox counter (batch b, row and column within the sequence)

Built without ``varlen``, ``locate`` gives the arrays' own lengths and no shift and
``cut`` gives the array itself, so the kernel compiles to what it was but for the one
more parameter.

Equal lengths (``make_sequences(True, equal=True)``): a packed batch whose every
sequence has nq query rows and nk keys (flash-attn's (batch, seqlen, heads, d) layout
seen as a packed batch; ``Problem.equal_lengths``) needs no cu_seqlens: sequence b starts
at row b * nq and key b * nk. Such a build takes ``seqs`` = (nq, nk), a pair of int64
kernel parameters, in place of the (2, B + 1) array. A value read from cu_seqlens in
global memory is a per-lane register to ptxas, and so is every index made from it; a
kernel parameter is known to be the same in every lane, so those indices can stay in
uniform registers. Backward v9's packed dQ kernel (float16, d = 64, causal) took 148
registers reading cu_seqlens and 106 with the lengths as parameters, about the plain
build's 108 (lab/runs/2026-12-07/equal_lengths_registers.txt); the other packed kernels
gained nothing from it (lab/runs/2026-12-06/packed_equal_lengths_registers.txt), so only
that kernel is built this way (backward v9's ``equal_lengths`` rule).

Backward v9 takes no views: it adds the sequence's first row to the row indices of the
packed arrays themselves (q0 + row; packed rows, below), so its arrays' base addresses
stay kernel parameters,
which ptxas keeps in uniform registers; a view's base computed from cu_seqlens is not
known to be the same in every lane (kernels/backward/v9_ldmatrix.py has its registers).

The tensor-core kernels stage tiles by flat positions (ptx.flat_load, ptx.cp_async: the
element n places after the array's first), computed as (bh * S + row) * d for a
C-contiguous array; ``position`` and ``row_step`` compute them from the strides for a view.

Packed rows (``make_packed_rows``, the packed builds of forward v8, v9 and v10): no
views at all. The
kernel takes the packed arrays as they are, C-contiguous (total, heads, d), and reads
element (head, row, k) at A[row, head, k], the row counted from the packed array's first
(the sequence's first row added by the caller); L stays (heads, total). Every index is
then a multiply-add on the arrays' shapes, where a strided view multiplies by a run-time
stride in every dimension. Its grid is (tiles, heads, batch), so that the block's head
and sequence are block indices rather than b = bh // Hq and h = bh % Hq: with those two
divisions forward v10's packed build at d = 64 took 163 registers, without them the
plain build's 128 (ptxas for sm_90, lab/runs/2026-12-06/packed_rows_registers*.txt).
The likely reason: an integer division is a sequence of instructions that Hopper's
uniform datapath does not run, so ptxas keeps its result, and every address made from
it, in per-lane registers. Forward v8 and v9 read packed rows the same way: v8's packed
build at d = 64 takes the plain build's 183 registers, 244 with the causal mask
(lab/runs/2026-12-06/packed_rows_v8_registers.txt); both run one block of eight warps
per SM either way.
"""

import functools
from collections import namedtuple

from numba import cuda, int64

# What make_sequences returns: inlined device functions, by name.
SequenceSteps = namedtuple("SequenceSteps", "locate cut position row_step uniform_range")
# What make_packed_rows returns: inlined device functions, by name.
PackedRows = namedtuple("PackedRows", "element put position")


@cuda.jit(device=True, inline=True)
def _rows(A, start, n):
    """Rows start .. start + n - 1 of every head of A (heads, rows[, d]): a view."""
    return A[:, start:start + n]


@cuda.jit(device=True, inline=True)
def _all_rows(A, start, n):
    return A


@functools.lru_cache(maxsize=None)
def make_sequences(varlen, equal=False):
    """``SequenceSteps(locate, cut, position, row_step, uniform_range)`` for kernels built
    with or without ``varlen``; ``equal``: a packed batch of equal lengths, ``seqs`` the
    pair (nq, nk) (module docstring):

    locate(seqs, b, Sq, Sk) -> (q0, k0, Sq, Sk, shift)
        sequence b's first query row and first key row in the packed arrays, its lengths
        and the shift Sk - Sq of its mask's offsets; without varlen (0, 0, Sq, Sk, 0)
    cut(A, start, n) -> A[:, start:start + n] with varlen, else A
    position(A, bh, row, S, d) -> the flat position of A[bh, row, 0] (ptx.flat_load): from A's
        strides with varlen, else (bh * S + row) * d for a C-contiguous (., S, d) array
    row_step(A, d) -> how far apart two rows of A are, in elements: d, or from the strides
    uniform_range(start, end) -> a tile loop's bounds: with varlen through
        ptx.warp_min_i32 (every lane holds the same bounds; so ptxas knows they are the
        same in every lane, which it cannot tell of values computed from cu_seqlens, and
        can keep the loop in uniform registers, see ptx.py); without varlen as they are.
        Every lane of the warp must call it. Backward v9's packed build uses it.
    """
    from .ptx import warp_min_i32   # inline PTX (simulator: simulated.py)

    VARLEN = varlen
    EQUAL = varlen and equal

    @cuda.jit(device=True, inline=True)
    def position(A, bh, row, S, d):
        if VARLEN:
            return bh * (A.strides[0] // A.itemsize) + row * (A.strides[1] // A.itemsize)
        return (bh * S + row) * d

    @cuda.jit(device=True, inline=True)
    def row_step(A, d):
        if VARLEN:
            return A.strides[1] // A.itemsize
        return d

    @cuda.jit(device=True, inline=True)
    def locate(seqs, b, Sq, Sk):
        if EQUAL:       # every sequence nq rows and nk keys: kernel parameters
            nq = seqs[0]
            nk = seqs[1]
            return int64(b) * nq, int64(b) * nk, nq, nk, nk - nq
        if VARLEN:
            q0 = int64(seqs[0, b])
            k0 = int64(seqs[1, b])
            nq = int64(seqs[0, b + 1]) - q0
            nk = int64(seqs[1, b + 1]) - k0
            return q0, k0, nq, nk, nk - nq
        return int64(0), int64(0), int64(Sq), int64(Sk), int64(0)

    @cuda.jit(device=True, inline=True)
    def uniform_range(start, end):
        if VARLEN:
            return warp_min_i32(start), warp_min_i32(end)
        return start, end

    return SequenceSteps(locate, _rows if varlen else _all_rows, position, row_step,
                         uniform_range)


@functools.lru_cache(maxsize=None)
def make_packed_rows(rows):
    """``PackedRows(element, put, position)``: how a kernel addresses its Q, K, V and O by
    (head, row, k), for plain (head, rows, d) arrays, or with ``rows`` for the packed
    (total, heads, d) arrays as they are (module docstring):

    element(A, head, row, k) -> A[head, row, k], with rows A[row, head, k]
    put(A, head, row, k, x)     stores x there
    position(A, head, row, S, d) -> that element's flat position at k = 0 (ptx.flat_load):
        (head * S + row) * d, with rows (row * heads + head) * d
    """
    from .smem import U

    ROWS = rows

    @cuda.jit(device=True, inline=True)
    def element(A, head, row, k):
        if ROWS:
            return A[U(row), U(head), U(k)]
        return A[U(head), U(row), U(k)]

    @cuda.jit(device=True, inline=True)
    def put(A, head, row, k, x):
        if ROWS:
            A[U(row), U(head), U(k)] = x
        else:
            A[head, row, k] = x

    @cuda.jit(device=True, inline=True)
    def position(A, head, row, S, d):
        if ROWS:
            return (row * A.shape[1] + head) * d
        return (head * S + row) * d

    return PackedRows(element, put, position)
