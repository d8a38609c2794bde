"""Hopper's warpgroup mma (wgmma) in TF32 from Numba, on the GPU: are the shared-memory
descriptors right, how exact is 3xTF32 through it, and how much faster than mma.sync is it?

The float32 backward is latency-bound at 2-3 warps a scheduler (lab/journal.md, run 144):
its m16n8k8 fragments, split into TF32 big and small parts, take the registers that more
warps would need. wgmma reads both operands from shared memory through 64-bit
descriptors, so a rung built on it needs no operand fragments. Before such a rung, three
questions, one part each:

  layout      one m64n64k8 wgmma (both operands in shared memory, no swizzle) on inputs
              that TF32 holds exactly, for two placements of the 8 x 16-byte core
              matrices and both readings of the descriptor's two byte offsets; prints
              which reading gives A B^T, and where each accumulator landed otherwise.
  accuracy    3xTF32 through wgmma (big*big, big*small, small*big, the small products in
              their own accumulator) on a 64 x 64 x 32 product of random float32, its
              error against float64 beside a plain float32 sum's.
  rs          the same product with A from registers (the "RS" form: P V and dS K would
              take P and dS from the registers that hold them), for two guesses at
              which thread holds which A element; prints the one that gives A B^T.
  throughput  tensor work per second: wgmma m64nNk8 (N = 32, 64, 128, 256) in a loop on
              tiles held in shared memory, against mma.sync m16n8k8 (what every
              float32 kernel uses now), each on enough blocks to fill the GPU.

    python3 lab/sweeps/wgmma_tf32_gpu.py [--parts layout,accuracy,rs,throughput]

GPU only (sm_90: the kernels compile for sm_90a, which a cc 9.0 device gets by default).
The intrinsics come from scripts/sm90a_probe.py, which checked on the CPU that they
assemble.
"""

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

import sm90a_probe as probe  # noqa: E402
from numbaflash.kernels import ptx  # noqa: E402
from numbaflash.kernels.simulated import tf32_round_finite  # noqa: E402

fence_proxy_async = probe.void_asm("fence.proxy.async.shared::cta;")


# m64nNk8 TF32 with both operands from shared memory (scripts/sm90a_probe.py's)
wgmma_tf32_ss = functools.partial(probe.wgmma_ss, "tf32")
zeros = probe.zeros
WG64 = wgmma_tf32_ss(64)
ZERO32 = zeros(32)
descriptor = probe.descriptor_dev
shared_address = probe.shared_address


def fragment_places(n=64):
    """(row, col) of accumulator i of thread t, as the PTX ISA draws wgmma's D for
    m64nNk8 with float32 accumulators: warp w of the warpgroup holds rows 16w..16w+15;
    per 8 columns j a thread holds (r, c), (r, c+1), (r+8, c), (r+8, c+1) with
    r = lane // 4 and c = 8j + 2 (lane % 4)."""
    rows = np.zeros((128, n // 2), np.int64)
    cols = np.zeros((128, n // 2), np.int64)
    for t in range(128):
        w, lane = divmod(t, 32)
        for i in range(n // 2):
            j, r = divmod(i, 4)
            rows[t, i] = 16 * w + lane // 4 + 8 * (r // 2)
            cols[t, i] = 8 * j + 2 * (lane % 4) + r % 2
    return rows, cols


def place(tile, row_stride, k_stride, words):
    """``tile`` (R x K float32, K-major) laid out as 8-row x 4-word core matrices: core
    (R / 8 index g, K / 4 index h) starts at byte g * row_stride + h * k_stride, its rows
    16 bytes apart. Returns a flat array of ``words`` float32."""
    flat = np.zeros(words, np.float32)
    R, K = tile.shape
    for r in range(R):
        for k in range(K):
            byte = (r // 8) * row_stride + (k // 4) * k_stride + (r % 8) * 16 + (k % 4) * 4
            flat[byte // 4] = tile[r, k]
    return flat


# Both tiles live in one shared array, each at a 128-byte aligned start (the descriptor
# holds the address in 16-byte units; the array itself is only 4-byte aligned).
SLOTS = 8 * 1024 + 32        # 32 KB of float32 + room to align


@cuda.jit(device=True, inline=True)
def aligned_start(S):
    """The first index of S at a 128-byte aligned shared address."""
    return ((128 - (shared_address(S) & numba.uint32(127))) & numba.uint32(127)) // 4


@cuda.jit
def k_layout(a_flat, b_flat, out, lbo, sbo):
    S = cuda.shared.array(SLOTS, numba.float32)
    o = aligned_start(S)
    t = cuda.threadIdx.x
    n = a_flat.shape[0]
    for i in range(t, n, 128):
        S[o + i] = a_flat[i]
        S[o + n + i] = b_flat[i]
    fence_proxy_async()
    cuda.syncthreads()
    base = shared_address(S) + numba.uint32(4) * numba.uint32(o)
    da = descriptor(base, lbo, sbo)
    db = descriptor(base + numba.uint32(4 * n), lbo, sbo)
    probe.wgmma_fence()
    acc = WG64(ZERO32(), da, db, numba.uint32(0))
    probe.wgmma_commit()
    probe.wgmma_wait0()
    for i in range(32):
        out[t, i] = acc[i]


def part_layout():
    print("== layout: one m64n64k8 wgmma, A (64 x 8) and B (64 x 8) K-major, no swizzle")
    rng = np.random.default_rng(0)
    rows, cols = fragment_places()
    found = None
    # A[r] = (r, 1, 0...), B[c] = (1, 64 c, 0...): A B^T[r, c] = r + 64 c, each entry
    # unique and exact, so a misplaced one says where it came from; then random tiles.
    ids_a = np.zeros((64, 8), np.float32)
    ids_b = np.zeros((64, 8), np.float32)
    ids_a[:, 0], ids_a[:, 1] = np.arange(64), 1
    ids_b[:, 0], ids_b[:, 1] = 1, 64 * np.arange(64)
    rand_a = (rng.integers(-8, 9, (64, 8)) / 4).astype(np.float32)
    rand_b = (rng.integers(-8, 9, (64, 8)) / 4).astype(np.float32)
    placements = {"cores along K adjacent (K step 128 B, 8-row step 256 B)": (256, 128),
                  "cores along rows adjacent (K step 1024 B, 8-row step 128 B)": (128, 1024)}
    for label, (row_stride, k_stride) in placements.items():
        for name, (lbo, sbo) in (("LBO = K step, SBO = 8-row step", (k_stride, row_stride)),
                                 ("LBO = 8-row step, SBO = K step", (row_stride, k_stride))):
            worst = 0.0
            for A, B in ((ids_a, ids_b), (rand_a, rand_b)):
                want = A.astype(np.float64) @ B.astype(np.float64).T
                out = cuda.device_array((128, 32), np.float32)
                k_layout[1, 128](cuda.to_device(place(A, row_stride, k_stride, 512)),
                                 cuda.to_device(place(B, row_stride, k_stride, 512)), out,
                                 np.uint32(lbo), np.uint32(sbo))
                got = out.copy_to_host()
                err = float(np.abs(got - want[rows, cols]).max())
                worst = max(worst, err)
                if A is ids_a and err:
                    wrong = np.argwhere(got != want[rows, cols])[:4]
                    where = [(int(t), int(i), float(got[t, i])) for t, i in wrong]
                    print(f"   {label}; {name}: ids misplaced, e.g. (thread, acc, got) {where}")
            ok = worst == 0.0
            print(f"  {label}; {name}: max |err| {worst:g} {'EXACT' if ok else ''}")
            if ok and found is None:
                found = (row_stride, k_stride, lbo, sbo)
    print("  reading that works:", found)
    return found


# --- accuracy: 3xTF32 over K = 32 ------------------------------------------------------------

def make_k_3x(lbo, sbo, k_step_bytes):
    """D = A B^T for 64 x 32 float32 tiles A and B by 3xTF32 on wgmma: big*big into acc,
    the two cross products into their own accumulator (as the mma.sync kernels do),
    summed at the end. The four parts sit in shared memory, 8 KB each (32 KB in all: the
    48 KB of static shared memory a block may have)."""
    @cuda.jit
    def k_3x(parts, out):
        S = cuda.shared.array(4 * 2048 + 32, numba.float32)
        o = aligned_start(S)
        t = cuda.threadIdx.x
        for i in range(t, 4 * 2048, 128):
            S[o + i] = parts[i]
        fence_proxy_async()
        cuda.syncthreads()
        base = shared_address(S) + numba.uint32(4) * numba.uint32(o)
        ab, asm, bb, bs = (base, base + numba.uint32(8192), base + numba.uint32(16384),
                           base + numba.uint32(24576))
        big = ZERO32()
        small = ZERO32()
        probe.wgmma_fence()
        for s in range(4):
            step = numba.uint32(s * k_step_bytes)
            big = WG64(big, descriptor(ab + step, lbo, sbo), descriptor(bb + step, lbo, sbo),
                       numba.uint32(s))
            small = WG64(small, descriptor(asm + step, lbo, sbo),
                         descriptor(bb + step, lbo, sbo), numba.uint32(s))
            small = WG64(small, descriptor(ab + step, lbo, sbo),
                         descriptor(bs + step, lbo, sbo), numba.uint32(1))
        probe.wgmma_commit()
        probe.wgmma_wait0()
        for i in range(32):
            out[t, i] = big[i] + small[i]
    return k_3x


def part_accuracy(found):
    print("== accuracy: 3xTF32 through wgmma, (64 x 32) (64 x 32)^T of random float32")
    if found is None:
        print("  skipped: no descriptor reading was exact")
        return
    row_stride_8, k_stride, lbo, sbo = found
    # A 64 x 32 tile: 8 cores along K; keep the found reading's roles, scaled to K = 32.
    if k_stride == 128:                      # cores along K adjacent
        row_stride, kstep = 8 * 128, 128
    else:                                    # cores along rows adjacent
        row_stride, kstep = 128, 8 * 128
    lbo2, sbo2 = (kstep, row_stride) if lbo == k_stride else (row_stride, kstep)
    kernel = make_k_3x(lbo2, sbo2, 2 * kstep)
    rows, cols = fragment_places()
    rng = np.random.default_rng(1)
    for trial in range(3):
        A = rng.standard_normal((64, 32)).astype(np.float32)
        B = rng.standard_normal((64, 32)).astype(np.float32)
        parts = []
        for X in (A, B):
            big = tf32_round_finite(X)          # the GPU kernels' split, on the host
            small = tf32_round_finite(X - big)
            parts.append((big, small))
        flat = np.concatenate([place(p, row_stride, kstep, 2048)
                               for p in (parts[0][0], parts[0][1], parts[1][0],
                                         parts[1][1])])
        out = cuda.device_array((128, 32), np.float32)
        kernel[1, 128](cuda.to_device(flat), out)
        got = out.copy_to_host()
        want = (A.astype(np.float64) @ B.astype(np.float64).T)[rows, cols]
        f32 = (A @ B.T)[rows, cols]
        scale = np.abs(want).max()
        print(f"  trial {trial}: 3xTF32 wgmma max |err| {np.abs(got - want).max():.3g}, "
              f"float32 matmul {np.abs(f32 - want).max():.3g} (max |D| {scale:.3g})")


# --- A from registers ------------------------------------------------------------------------

WG64_RS = probe.wgmma_tf32_rs


@cuda.jit
def k_rs(a_words, b_flat, out, lbo, sbo):
    S = cuda.shared.array(SLOTS, numba.float32)
    o = aligned_start(S)
    t = cuda.threadIdx.x
    for i in range(t, 512, 128):
        S[o + i] = b_flat[i]
    fence_proxy_async()
    cuda.syncthreads()
    db = descriptor(shared_address(S) + numba.uint32(4) * numba.uint32(o), lbo, sbo)
    probe.wgmma_fence()
    acc = WG64_RS(ZERO32(), a_words[t, 0], a_words[t, 1], a_words[t, 2], a_words[t, 3], db,
                  numba.uint32(0))
    probe.wgmma_commit()
    probe.wgmma_wait0()
    for i in range(32):
        out[t, i] = acc[i]


def a_fragments(A, guess):
    """The (128, 4) words the threads pass as A (64 x 8): warp w holds rows 16w..16w+15,
    as mma.sync m16n8k8 holds its A. "mma order": a0 (r, c), a1 (r + 8, c), a2 (r, c + 4),
    a3 (r + 8, c + 4) with r = lane // 4, c = lane % 4; "columns first": a1 and a2
    swapped."""
    words = np.zeros((128, 4), np.uint32)
    bits = A.astype(np.float32).view(np.uint32)
    for t in range(128):
        w, lane = divmod(t, 32)
        r, c = 16 * w + lane // 4, lane % 4
        places = [(r, c), (r + 8, c), (r, c + 4), (r + 8, c + 4)]
        if guess == "columns first":
            places[1], places[2] = places[2], places[1]
        for i, (row, col) in enumerate(places):
            words[t, i] = bits[row, col]
    return words


def part_rs(found):
    print("== rs: one m64n64k8 wgmma, A from registers, B (64 x 8) from shared memory")
    if found is None:
        print("  skipped: no descriptor reading was exact")
        return None
    row_stride, k_stride, lbo, sbo = found
    rows, cols = fragment_places()
    rng = np.random.default_rng(2)
    A = (rng.integers(-8, 9, (64, 8)) / 4).astype(np.float32)
    B = (rng.integers(-8, 9, (64, 8)) / 4).astype(np.float32)
    want = (A.astype(np.float64) @ B.astype(np.float64).T)[rows, cols]
    works = None
    for guess in ("mma order", "columns first"):
        out = cuda.device_array((128, 32), np.float32)
        k_rs[1, 128](cuda.to_device(a_fragments(A, guess)),
                     cuda.to_device(place(B, row_stride, k_stride, 512)), out,
                     np.uint32(lbo), np.uint32(sbo))
        err = float(np.abs(out.copy_to_host() - want).max())
        print(f"  A fragments in {guess}: max |err| {err:g} {'EXACT' if err == 0 else ''}")
        if err == 0 and works is None:
            works = guess
    return works


# --- throughput ------------------------------------------------------------------------------

def make_k_wgmma_loop(n, iters):
    mma = wgmma_tf32_ss(n)
    zero = zeros(n // 2)
    count = n // 2
    # A: 64 x 32 (8 KB), B: n x 32; cores along K adjacent, 8 cores a row group.
    b_words = n * 32

    @cuda.jit
    def k(out, scale):
        S = cuda.shared.array(2048 + 256 * 32 + 32, numba.float32)
        o = aligned_start(S)
        t = cuda.threadIdx.x
        # (a constant step: a variable one makes Numba divide in 64 bits for the trip
        # count, a call to a ptxas subroutine, and ptxas then serialises every wgmma of
        # the kernel: note C7509, "Extern calls")
        for i in range(t, 2048 + b_words, 128):
            S[o + i] = scale
        fence_proxy_async()
        cuda.syncthreads()
        base = shared_address(S) + numba.uint32(4) * numba.uint32(o)
        acc = zero()
        for it in range(iters):
            probe.wgmma_fence()
            for s in range(4):
                step = numba.uint32(s * 256)
                acc = mma(acc, descriptor(base + step, 128, 1024),
                          descriptor(base + numba.uint32(8192) + step, 128, 1024),
                          numba.uint32(1))
            probe.wgmma_commit()
            probe.wgmma_wait0()
        total = numba.float32(0)
        for i in range(count):
            total += acc[i]
        out[cuda.blockIdx.x * 128 + t] = total
    return k


def make_k_mma_sync_loop(iters, chains):
    """Each warp runs ``chains`` independent m16n8k8 TF32 accumulations, iters times."""
    @cuda.jit
    def k(out, scale):
        t = cuda.threadIdx.x
        a = scale * numba.float32(t % 7)
        c = cuda.local.array((8, 4), numba.float32)
        for j in range(chains):
            for r in range(4):
                c[j, r] = 0
        for it in range(iters):
            for j in range(chains):
                c[j, 0], c[j, 1], c[j, 2], c[j, 3] = ptx.mma_tf32(
                    a, a, a, a, a, a, c[j, 0], c[j, 1], c[j, 2], c[j, 3])
        total = numba.float32(0)
        for j in range(chains):
            total += c[j, 0] + c[j, 1] + c[j, 2] + c[j, 3]
        out[cuda.blockIdx.x * cuda.blockDim.x + t] = total
    return k


def timed(kernel, blocks, threads, repeats=5):
    out = cuda.device_array(blocks * threads, np.float32)
    kernel[blocks, threads](out, np.float32(0.001))
    cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = cuda.event(), cuda.event()
        start.record()
        kernel[blocks, threads](out, np.float32(0.001))
        end.record()
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end))
    return best


def part_throughput():
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    print(f"== throughput: TF32 tensor work a second ({sms} SMs), best of 5 launches")
    iters = 2000
    for n in (32, 64, 128, 256):
        for per_sm in (1, 2):
            try:
                k = make_k_wgmma_loop(n, iters)
                blocks = sms * per_sm
                ms = timed(k, blocks, 128)
                flops = blocks * iters * 4 * 2 * 64 * n * 8
                print(f"  wgmma m64n{n}k8, {per_sm} warpgroup(s) an SM: {ms:.3f} ms, "
                      f"{flops / ms / 1e9:.1f} TFLOP/s", flush=True)
            except Exception as e:      # a shape that does not compile: say so, go on
                print(f"  wgmma m64n{n}k8: failed: {type(e).__name__}: {e}"[:400], flush=True)
    for chains in (2, 4, 8):
        for warps in (4, 8, 16):
            k = make_k_mma_sync_loop(iters, chains)
            blocks = sms * 2
            ms = timed(k, blocks, 32 * warps)
            flops = blocks * warps * iters * chains * 2 * 16 * 8 * 8
            print(f"  mma.sync m16n8k8, {chains} chains a warp, {2 * warps} warps an SM: "
                  f"{ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="layout,accuracy,rs,throughput")
    parts = ap.parse_args().parts.split(",")
    dev = cuda.get_current_device()
    print(f"# {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
          f"cc {dev.compute_capability}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    found = None
    if "layout" in parts or "accuracy" in parts or "rs" in parts:
        found = part_layout()
    if "accuracy" in parts:
        part_accuracy(found)
    if "rs" in parts:
        part_rs(found)
    if "throughput" in parts:
        part_throughput()


if __name__ == "__main__":
    main()
