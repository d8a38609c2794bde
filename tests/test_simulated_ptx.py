"""The tensor-core kernels' primitives against NumPy: on the simulator its stand-ins
(numbaflash/kernels/simulated.py), on a GPU the real instructions (kernels/ptx.py and
Numba's warp shuffles), through the same kernels and the same checks.

Each test launches one block of two warps that hold different data, so a stand-in that
mixed up warps, lanes or fragment positions fails. What is checked:

- ``mma_tf32`` (m16n8k8) and ``mma_f16`` (m16n8k16): D = A B + C for the fragment layouts
  of kernels/ptx.py, against a float64 product of the operands as the tensor cores read
  them (TF32: the top 19 bits of each float32; float16 exactly), within a bound of a few
  float32 roundings of the sum (the GPU adds in its own order; the stand-in once);
- ``tf32_round`` (ties away from zero, NaN and inf kept) and ``tf32_round_finite``
  bit for bit against a NumPy model, ``pack_f16x2`` / ``load_b32`` against NumPy's
  float16 rounding and layout;
- ``exp2_approx`` (within 2 ulps, subnormal results flushed to 0) and ``fmax`` (NaN loses);
- ``warp_min_i32``: every lane gets its own warp's smallest value;
- ``shfl_sync`` and ``shfl_xor_sync``: every lane gets the lane it asked for;
- ``flat_load``, ``load_pair``, ``store_pair``, ``cp_async`` (then ``cp_async_wait_all``
  and a barrier): the elements they name, bit for bit;
- ``ldmatrix_x4`` and ``ldmatrix_x4_trans`` (forward v10): every lane's four registers
  bit for bit against a NumPy model of kernels/ptx.py's layout, from rows stored in a
  shuffled order (so each lane's own row address is what is read); ``cp_async16`` with
  ``cp_async_commit`` and ``cp_async_wait_group``, and ``is_aligned16``.
"""

import time

import numpy as np
import pytest
from numba import cuda

from numbaflash.kernels import ptx, simulating
from tolerance import to_host

WARPS = 2
FULL = 0xFFFFFFFF


def launch(kernel, *arrays):
    """Run ``kernel`` on one block of WARPS warps; NumPy arrays in, NumPy arrays out."""
    dev = [cuda.to_device(a) for a in arrays]
    kernel[1, 32 * WARPS](*dev)
    return [to_host(a) for a in dev]


def tf32_read(x):
    """What the tensor cores read of float32 operands: their top 19 bits, as float64."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(
        np.float32).astype(np.float64)


def rna_tf32(x):
    """cvt.rna.tf32.f32 modelled in NumPy: add half of TF32's last place to the bits,
    clear the 13 low bits; NaN and inf stay."""
    x = np.asarray(x, np.float32)
    bits = (x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where(np.isfinite(x), bits.view(np.float32), x)


def sum_bound(A, B, C):
    """A few float32 roundings of each entry of A B + C, whatever the order of the sum."""
    k = A.shape[1]
    return (k + 2) * np.finfo(np.float32).eps * (np.abs(A) @ np.abs(B) + np.abs(C)) + 1e-30


@cuda.jit
def _mma_tf32_kernel(A, B, C, D):
    tid = cuda.threadIdx.x
    w = tid // 32
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    d0, d1, d2, d3 = ptx.mma_tf32(A[w, g, t], A[w, g + 8, t], A[w, g, t + 4], A[w, g + 8, t + 4],
                                  B[w, t, g], B[w, t + 4, g],
                                  C[w, g, 2 * t], C[w, g, 2 * t + 1], C[w, g + 8, 2 * t],
                                  C[w, g + 8, 2 * t + 1])
    D[w, g, 2 * t] = d0
    D[w, g, 2 * t + 1] = d1
    D[w, g + 8, 2 * t] = d2
    D[w, g + 8, 2 * t + 1] = d3


def test_mma_tf32_is_the_m16n8k8_product():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((WARPS, 16, 8)).astype(np.float32)
    B = rng.standard_normal((WARPS, 8, 8)).astype(np.float32)
    C = rng.standard_normal((WARPS, 16, 8)).astype(np.float32)
    A[1] *= 1000                                    # warp 1: another magnitude
    D = launch(_mma_tf32_kernel, A, B, C, np.full((WARPS, 16, 8), np.nan, np.float32))[3]
    for w in range(WARPS):
        ref = tf32_read(A[w]) @ tf32_read(B[w]) + C[w].astype(np.float64)
        err = np.abs(D[w] - ref)
        assert np.all(err <= sum_bound(tf32_read(A[w]), tf32_read(B[w]), C[w])), (w, err.max())
    # the low 13 bits of an operand are not read: A + (those bits) gives the same D
    A2 = (A.view(np.uint32) | np.uint32(0x1FFF)).view(np.float32)
    D2 = launch(_mma_tf32_kernel, A2, B, C, np.zeros((WARPS, 16, 8), np.float32))[3]
    np.testing.assert_array_equal(D2, D)


@cuda.jit
def _mma_f16_kernel(A, B, C, D):
    tid = cuda.threadIdx.x
    w = tid // 32
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    a0 = ptx.pack_f16x2(A[w, g, 2 * t], A[w, g, 2 * t + 1])
    a1 = ptx.pack_f16x2(A[w, g + 8, 2 * t], A[w, g + 8, 2 * t + 1])
    a2 = ptx.pack_f16x2(A[w, g, 2 * t + 8], A[w, g, 2 * t + 9])
    a3 = ptx.pack_f16x2(A[w, g + 8, 2 * t + 8], A[w, g + 8, 2 * t + 9])
    b0 = ptx.pack_f16x2(B[w, 2 * t, g], B[w, 2 * t + 1, g])
    b1 = ptx.pack_f16x2(B[w, 2 * t + 8, g], B[w, 2 * t + 9, g])
    d0, d1, d2, d3 = ptx.mma_f16(a0, a1, a2, a3, b0, b1,
                                 C[w, g, 2 * t], C[w, g, 2 * t + 1], C[w, g + 8, 2 * t],
                                 C[w, g + 8, 2 * t + 1])
    D[w, g, 2 * t] = d0
    D[w, g, 2 * t + 1] = d1
    D[w, g + 8, 2 * t] = d2
    D[w, g + 8, 2 * t + 1] = d3


def test_mma_f16_is_the_m16n8k16_product():
    rng = np.random.default_rng(2)
    A = rng.standard_normal((WARPS, 16, 16)).astype(np.float32)
    B = rng.standard_normal((WARPS, 16, 8)).astype(np.float32)
    C = rng.standard_normal((WARPS, 16, 8)).astype(np.float32)
    B[1] *= 50
    D = launch(_mma_f16_kernel, A, B, C, np.full((WARPS, 16, 8), np.nan, np.float32))[3]
    for w in range(WARPS):
        a16 = A[w].astype(np.float16).astype(np.float64)    # pack_f16x2 rounds to nearest even
        b16 = B[w].astype(np.float16).astype(np.float64)
        ref = a16 @ b16 + C[w].astype(np.float64)
        err = np.abs(D[w] - ref)
        assert np.all(err <= sum_bound(a16, b16, C[w])), (w, err.max())


@cuda.jit
def _round_kernel(X, R, F):
    i = cuda.threadIdx.x
    R[i] = ptx.tf32_round(X[i])
    F[i] = ptx.tf32_round_finite(X[i])


def test_tf32_rounding_bit_for_bit():
    eps = np.float32(2.0 ** -11)        # a tie at 1 + 2^-11 (TF32's half ulp at 1)
    special = np.array([0.0, -0.0, 1.0, 1 + eps, -(1 + eps), 1 + 3 * eps, 1 + eps / 2,
                        3.0e38, -3.4e38, 1e-40, -1e-45, np.inf, -np.inf, np.nan],
                       np.float32)
    rng = np.random.default_rng(3)
    X = np.concatenate([special, rng.standard_normal(32 * WARPS - special.size).astype(
        np.float32) * np.float32(10) ** rng.integers(-30, 30, 32 * WARPS - special.size)])
    X = X.astype(np.float32)
    _, R, F = launch(_round_kernel, X, np.zeros_like(X), np.zeros_like(X))
    want = rna_tf32(X)
    np.testing.assert_array_equal(np.isnan(R), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(R[finite].view(np.uint32), want[finite].view(np.uint32))
    ok = np.isfinite(X) & (np.abs(X) < 3.39e38)         # the bit trick's domain
    np.testing.assert_array_equal(F[ok].view(np.uint32), want[ok].view(np.uint32))


@cuda.jit
def _softmax_ops_kernel(X, Y, E, M):
    i = cuda.threadIdx.x
    E[i] = ptx.exp2_approx(X[i])
    M[i] = ptx.fmax(X[i], Y[i])


def test_exp2_approx_and_fmax():
    """``exp2_approx``: 2^x within 2 float32 ulps (the GPU's MUFU.EX2), exactly 0 below
    2^-126 (flushed) and for -inf, inf above 2^128, NaN for NaN. ``fmax``: the larger
    value, the other one when either is NaN, bit for bit."""
    special = np.array([0.0, 1.0, -1.0, 10.5, -125.5, -126.5, -140.0, -200.0, 127.9, 128.5,
                        -np.inf, np.inf, np.nan, -0.0], np.float32)
    rng = np.random.default_rng(14)
    X = np.concatenate([special, rng.uniform(-120, 120, 32 * WARPS - special.size)])
    X = X.astype(np.float32)
    Y = rng.standard_normal(X.size).astype(np.float32) * np.float32(50)
    Y[:4] = [np.nan, -np.inf, 5.0, np.nan]
    _, _, E, M = launch(_softmax_ops_kernel, X, Y, np.zeros_like(X), np.zeros_like(X))
    want = np.exp2(X.astype(np.float64))
    normal = np.isfinite(want) & (want >= 2.0 ** -126) & (want < 2.0 ** 128)
    np.testing.assert_allclose(E[normal], want[normal], rtol=2 * 2.0 ** -23, atol=0)
    tiny = ~np.isnan(X) & (want < 2.0 ** -126)
    assert np.all(E[tiny] == 0)
    assert np.all(np.isposinf(E[~np.isnan(X) & (want >= 2.0 ** 128)]))
    assert np.all(np.isnan(E[np.isnan(X)]))
    want_max = np.where(np.isnan(X), Y, np.where(np.isnan(Y), X, np.maximum(X, Y)))
    both = ~(np.isnan(X) & np.isnan(Y))
    np.testing.assert_array_equal(M[both], want_max[both])


@cuda.jit
def _warp_min_kernel(X, M, U):
    i = cuda.threadIdx.x
    M[i] = ptx.warp_min_i32(X[i])
    U[i] = ptx.warp_min_i32(X[i] // 1000 * 0 + 7 + i // 32)   # the same in every lane


def test_warp_min_i32():
    """``warp_min_i32``: each lane gets the smallest value of its own warp (the two warps
    hold different values, negative ones included), and a value every lane holds comes
    back unchanged."""
    rng = np.random.default_rng(15)
    X = rng.integers(-2 ** 31, 2 ** 31 - 1, 32 * WARPS).astype(np.int32)
    X[40] = -2 ** 31
    _, M, U = launch(_warp_min_kernel, X, np.zeros_like(X), np.zeros_like(X))
    want = np.repeat(X.reshape(WARPS, 32).min(axis=1), 32)
    np.testing.assert_array_equal(M, want)
    np.testing.assert_array_equal(U, 7 + np.arange(32 * WARPS) // 32)


@cuda.jit
def _pack_kernel(X, W, Y):
    i = cuda.threadIdx.x
    W[i] = ptx.pack_f16x2(X[2 * i], X[2 * i + 1])
    S = cuda.shared.array(128, np.float16)
    S[2 * i] = X[2 * i]
    S[2 * i + 1] = X[2 * i + 1]
    cuda.syncthreads()
    Y[i] = ptx.load_b32(S, 2 * i)


def test_pack_f16x2_and_load_b32():
    rng = np.random.default_rng(4)
    X = (rng.standard_normal(2 * 32 * WARPS) * 100).astype(np.float32)
    X[:4] = [65519.0, 65520.0, 1e-8, -2.5]          # round to 65504 / overflow to inf / 0
    _, W, Y = launch(_pack_kernel, X, np.zeros(32 * WARPS, np.uint32),
                     np.zeros(32 * WARPS, np.uint32))
    want = X.astype(np.float16).view(np.uint32)     # low half first, as the GPU packs
    np.testing.assert_array_equal(W, want)
    np.testing.assert_array_equal(Y, want)


@cuda.jit
def _shuffle_kernel(X, Src, Xor, OutSrc, OutXor):
    i = cuda.threadIdx.x
    OutSrc[i] = cuda.shfl_sync(FULL, X[i], Src[i])
    OutXor[i] = cuda.shfl_xor_sync(FULL, X[i], Xor[i // 32])


def test_warp_shuffles():
    rng = np.random.default_rng(5)
    n = 32 * WARPS
    X = rng.standard_normal(n).astype(np.float32)
    Src = rng.integers(0, 32, n).astype(np.int32)
    Xor = np.array([1, 6], np.int32)[:WARPS]
    out = launch(_shuffle_kernel, X, Src, Xor, np.zeros(n, np.float32), np.zeros(n, np.float32))
    lane = np.arange(n) % 32
    warp0 = np.arange(n) // 32 * 32
    np.testing.assert_array_equal(out[3], X[warp0 + Src])
    np.testing.assert_array_equal(out[4], X[warp0 + (lane ^ Xor[np.arange(n) // 32])])


@cuda.jit
def _memory_kernel(A, P, Out, Pairs, Copied):
    i = cuda.threadIdx.x
    n = cuda.blockDim.x
    Out[i] = ptx.flat_load(A, 3 * i + 1)
    x, y = ptx.load_pair(P, 2 * i)
    Pairs[2 * i] = y
    Pairs[2 * i + 1] = x
    S = cuda.shared.array(128, np.float32)
    ptx.store_pair(S, 2 * i, y, x)
    R = cuda.shared.array(64, np.float32)
    ptx.cp_async(R, i, A, i)
    ptx.cp_async_wait_all()
    # Wait until every thread's copy has landed and every pair is stored.
    cuda.syncthreads()
    Copied[2 * i] = R[(i + 1) % n]
    Copied[2 * i + 1] = S[2 * ((i + 1) % n)]


def test_loads_stores_and_asynchronous_copies():
    rng = np.random.default_rng(6)
    n = 32 * WARPS
    A = rng.standard_normal((2, n, 3)).astype(np.float32)       # C-contiguous, 3D
    P = rng.standard_normal(2 * n).astype(np.float32)
    out = launch(_memory_kernel, A, P, np.zeros(n, np.float32), np.zeros(2 * n, np.float32),
                 np.zeros(2 * n, np.float32))
    flat = A.reshape(-1)
    i = np.arange(n)
    np.testing.assert_array_equal(out[2], flat[3 * i + 1])
    np.testing.assert_array_equal(out[3].reshape(-1, 2), P.reshape(-1, 2)[:, ::-1])
    # another thread's copy (cp_async) and another thread's stored pair (its y first)
    np.testing.assert_array_equal(out[4][0::2], flat[(i + 1) % n])
    np.testing.assert_array_equal(out[4][1::2], P[2 * ((i + 1) % n) + 1])


def test_loads_past_the_allocation_raise_on_the_simulator():
    """flat_load and the copies read by address (flat_load's n places after A's first): on
    a GPU one past the end of the allocation faults, so the stand-ins raise there; inside
    the allocation, past a view's own span (a packed batch's rows of another sequence), the
    read is allowed, as on a GPU."""
    from numbaflash.kernels import simulated
    A = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    view = A[:, 1:3]                        # rows 1, 2 of each head: the allocation goes on
    assert simulated.flat_load(view, 30) == A.reshape(-1)[4 + 30]
    with pytest.raises(IndexError, match="past the end of its allocation"):
        simulated.flat_load(view, 36)
    with pytest.raises(IndexError, match="past the end of its allocation"):
        simulated.cp_async(np.zeros(1, np.float32), 0, A, 40)
    H = np.zeros(16, np.float16)
    S = np.zeros(8, np.float16)
    with pytest.raises(IndexError, match="past the end of its allocation"):
        simulated.cp_async16(S, 0, H[8:], 8)


# --- the simulator's rendezvous when a lane never comes -----------------------------------
# A warp collective that part of a warp skips is a kernel bug (undefined on a GPU). On the
# simulator it must fail with a message that says so, never wait for ever.

@cuda.jit
def _lane_returns_early_kernel(X, Out):
    i = cuda.threadIdx.x
    if i == 5:
        return
    Out[i] = cuda.shfl_xor_sync(FULL, X[i], 1)


@cuda.jit
def _lane_waits_at_syncthreads_kernel(X, Out):
    i = cuda.threadIdx.x
    if i == 7:
        cuda.syncthreads()
    else:
        Out[i] = cuda.shfl_xor_sync(FULL, X[i], 1)
        cuda.syncthreads()


@pytest.mark.skipif(not simulating(), reason="the simulator's rendezvous (kernels/simulated.py)")
@pytest.mark.parametrize("kernel,lane,where", [(_lane_returns_early_kernel, 5, "finished"),
                                               (_lane_waits_at_syncthreads_kernel, 7,
                                                r"at syncthreads, test_simulated_ptx\.py:\d+")])
def test_a_collective_that_part_of_the_warp_skips_fails_clearly(kernel, lane, where):
    X = np.arange(32, dtype=np.float32)
    with pytest.raises(RuntimeError, match=rf"lanes \['{lane} \({where}\)'\] of warp 0 never "
                                           r"reach it \(lane \d+ waited [\d.]+ s at collective "
                                           r"0, test_simulated_ptx\.py:\d+\)"):
        kernel[1, 32](cuda.to_device(X), cuda.to_device(np.zeros(32, np.float32)))


@cuda.jit
def _barrier_then_shuffle_kernel(X, Out):
    i = cuda.threadIdx.x
    cuda.syncthreads()
    Out[i] = cuda.shfl_xor_sync(FULL, X[i], 1)


class _SlowWakeUps(list):
    """A barrier's waiting threads, woken 20 ms apart: what a loaded CPU does to the
    thread that opens a barrier (it waits for the interpreter between two wake-ups)."""

    def __iter__(self):
        for t in list.__iter__(self):
            yield t
            time.sleep(0.02)


@pytest.mark.skipif(not simulating(), reason="the simulator's rendezvous (kernels/simulated.py)")
def test_lanes_a_barrier_has_yet_to_wake_are_not_called_stuck(monkeypatch):
    """Lanes woken first from a barrier reach the next collective while the opener has
    yet to wake their warp-mates; those are on their way, not stuck (this raised
    "never reach it" under a loaded CPU, before the check read the lanes under the
    block's lock)."""
    from numbaflash.kernels import simulated
    open_barrier = simulated._open_barrier

    def slow_open_barrier(block):
        block.waiting = _SlowWakeUps(block.waiting)
        open_barrier(block)

    monkeypatch.setattr(simulated, "_open_barrier", slow_open_barrier)
    monkeypatch.setattr(simulated, "_POLL_S", 0.005)   # poll often while the wake-ups run
    X = np.arange(64, dtype=np.float32)
    out = cuda.to_device(np.zeros(64, np.float32))
    _barrier_then_shuffle_kernel[1, 64](cuda.to_device(X), out)
    np.testing.assert_array_equal(to_host(out), X[np.arange(64) ^ 1])


# --- ldmatrix and 16-byte copies (forward v10) ----------------------------------------------

ROW_HALVES = 32 * WARPS * 8     # a row of 8 float16 values per thread

@cuda.jit
def _ldmatrix_kernel(X, Where, R, RT):
    """Thread tid stores row tid of X (8 values) at row Where[tid] of a shared array, then
    asks ldmatrix for it: lane 8m + r of a warp gives row r of its matrix m."""
    tid = cuda.threadIdx.x
    S = cuda.shared.array(ROW_HALVES, np.float16, alignment=16)
    for e in range(8):
        S[Where[tid] * 8 + e] = X[tid, e]
    # Wait until every row is stored.
    cuda.syncthreads()
    r0, r1, r2, r3 = ptx.ldmatrix_x4(S, Where[tid] * 8)
    R[tid, 0], R[tid, 1], R[tid, 2], R[tid, 3] = r0, r1, r2, r3
    t0, t1, t2, t3 = ptx.ldmatrix_x4_trans(S, Where[tid] * 8)
    RT[tid, 0], RT[tid, 1], RT[tid, 2], RT[tid, 3] = t0, t1, t2, t3


def ldmatrix_model(M, trans):
    """kernels/ptx.py's layout: M (4, 8, 8) uint16 bits of one warp's four matrices; lane
    (g, t)'s register m holds M[m, g, 2t] | M[m, g, 2t + 1] << 16 (trans: M[m, 2t, g] |
    M[m, 2t + 1, g] << 16). Returns (32, 4) uint32."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for m in range(4):
            lo, hi = (M[m, 2 * t, g], M[m, 2 * t + 1, g]) if trans else (M[m, g, 2 * t],
                                                                         M[m, g, 2 * t + 1])
            out[lane, m] = np.uint32(lo) | (np.uint32(hi) << np.uint32(16))
    return out


def test_ldmatrix_x4_and_trans_give_the_documented_fragments():
    rng = np.random.default_rng(7)
    n = 32 * WARPS
    X = rng.standard_normal((n, 8)).astype(np.float16)
    X[5, 3] = np.nan                             # bits travel as they are, NaN too
    Where = rng.permutation(n).astype(np.int32)  # each lane's row somewhere else
    _, _, R, RT = launch(_ldmatrix_kernel, X, Where, np.zeros((n, 4), np.uint32),
                         np.zeros((n, 4), np.uint32))
    bits = X.view(np.uint16)
    for w in range(WARPS):
        M = bits[32 * w:32 * w + 32].reshape(4, 8, 8)     # matrix m = lanes 8m .. 8m + 7
        np.testing.assert_array_equal(R[32 * w:32 * w + 32], ldmatrix_model(M, False))
        np.testing.assert_array_equal(RT[32 * w:32 * w + 32], ldmatrix_model(M, True))


def test_ldmatrix_fragments_are_mma_operands():
    """The model above is the m16n8k16 B operand (kernels/ptx.py): for M_m rows of keys,
    register 0 of lane (g, t) is B[2t:2t + 2, g] with B = Kj^T; with .trans and M_m rows
    of Vj, B[2t:2t + 2, g] with B = Vj."""
    rng = np.random.default_rng(8)
    K = rng.integers(0, 2 ** 16, (8, 8)).astype(np.uint16)     # 8 keys x 8 columns
    M = np.stack([K] * 4)
    for lane in range(32):
        g, t = divmod(lane, 4)
        word = ldmatrix_model(M, False)[lane, 0]
        assert word == int(K.T[2 * t, g]) | int(K.T[2 * t + 1, g]) << 16
        word = ldmatrix_model(M, True)[lane, 0]
        assert word == int(K[2 * t, g]) | int(K[2 * t + 1, g]) << 16


@cuda.jit
def _copy16_kernel(A, Out, Aligned):
    """Thread tid copies 8 values (its 16 bytes) of A into a shared array asynchronously,
    waits, and after a barrier reads its neighbour's."""
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    S = cuda.shared.array(ROW_HALVES, np.float16, alignment=16)
    ptx.cp_async16(S, tid * 8, A, ((tid * 5) % n) * 8)
    ptx.cp_async_commit()
    ptx.cp_async_wait_group(0)
    # Wait until every thread's copy has landed.
    cuda.syncthreads()
    for e in range(8):
        Out[tid, e] = S[((tid + 1) % n) * 8 + e]
    if tid == 0:
        Aligned[0] = ptx.is_aligned16(A)


def test_cp_async16_copies_sixteen_bytes():
    rng = np.random.default_rng(9)
    n = 32 * WARPS
    A = rng.standard_normal((2, n * 4)).astype(np.float16)      # 2D: flat addressing
    _, Out, Aligned = launch(_copy16_kernel, A, np.zeros((n, 8), np.float16),
                             np.zeros(1, np.bool_))
    src = A.reshape(-1).reshape(-1, 8)
    np.testing.assert_array_equal(Out.view(np.uint16),
                                  src[(((np.arange(n) + 1) % n) * 5) % n].view(np.uint16))
    assert Aligned[0]


@pytest.mark.skipif(not simulating(), reason="the simulator's stand-ins raise where a GPU faults")
def test_misaligned_rows_and_copies_raise_on_the_simulator():
    from numbaflash.kernels import simulated
    S = np.zeros(64, np.float16)
    assert simulated.is_aligned16(S) and not simulated.is_aligned16(S[1:])
    with pytest.raises(ValueError, match="misaligned global"):
        simulated.cp_async16(S, 0, S[1:], 0)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        simulated._row_bits(S, 4)
