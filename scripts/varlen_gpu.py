"""Packed batches on a GPU: agreement with the float64 reference, the same bits as
attention() per sequence, and the time against the same batch padded.

    python scripts/varlen_gpu.py [--parts agreement,bitwise,speed] [--repeats 10]
                                 [--dtypes float16,float32] [--dims 64,128]
                                 [--forward-version V] [--backward-version V]

1. agreement: ``attention_varlen`` and ``attention_varlen_backward`` (the GPU defaults:
   in float16 and bfloat16 forward v10 and backward v9 for plain attention, v7 and v6
   with a variant; in float32 v8 / v9 and backward v6) on packed batches of mixed
   lengths (empty sequences, Sq != Sk, GQA, causal, window, softcap, ALiBi, dropout
   against ``reference.forward_varlen`` with ``numbaflash.dropout_mask``), each sequence
   against ``numbaflash.reference`` in float64 by the bench's rule (``bench._agreement``;
   gradients with the bench's gradient multipliers).
2. bitwise: for each sequence, ``attention_varlen``'s rows are the same bits as
   ``attention()`` of that sequence alone, forward (v7, v8, v9, v10) and backward (v6,
   v9).
3. speed: 64 sequences of 128 to 4096 tokens (drawn once, seed 0), 16 heads, causal and
   not: the packed call against the same batch padded to the longest and run through
   ``attention()`` with a boolean attn_mask that hides the padding (the default kernels,
   which skip the tiles the mask leaves empty), forward and forward + backward; and
   PyTorch SDPA on the padded batch with the same mask, as a user would call it. Memory:
   the packed and padded arrays' bytes. The packed call runs the policy's kernels (each
   line names them) or those named by ``--forward-version`` / ``--backward-version``.

Timing: ``numbaflash.bench.time_ms`` (CUDA events on the default stream, median of
``--repeats`` after 3 warm-ups), one process. Every line is printed as it comes (flush).
"""

import argparse
import sys

import ml_dtypes
import numpy as np
from numba import cuda

import numbaflash
from numbaflash import bench, reference

LENGTHS = (128, 4096)           # the speed part's sequence lengths: uniform in this range
BATCH, HEADS = 64, 16


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _packed(rng, lengths, heads, d, dtype):
    return rng.standard_normal((int(np.sum(lengths)), heads, d)).astype(dtype)


def _device(x):
    """A host array on the device (bfloat16 through its uint16 bits, as Numba copies it)."""
    if x.dtype == ml_dtypes.bfloat16:
        return cuda.to_device(x.view(np.uint16)).view(ml_dtypes.bfloat16)
    return cuda.to_device(x)


def _numba(t):
    """A torch CUDA tensor as numbaflash takes it: bfloat16 through its int16 view."""
    import torch
    if t.dtype == torch.bfloat16:
        return cuda.as_cuda_array(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return t


def _check(got, want, base, dtype, mult):
    c = bench._agreement(np.asarray(got, np.float64), want, base, dtype, mult, None)
    return c["ok"], c["max_err"] / c["bound"] if c["bound"] else 0.0


def agreement():
    rng = np.random.default_rng(3)
    cases = [  # (lengths_q, lengths_k, Hq, Hk, d, dtype, options)
        # plain attention in 16 bits: forward v10 and backward v9 by default
        # (first: a run cut short has checked them)
        ([700, 0, 1500, 33], [700, 90, 1500, 2000], 8, 8, 64, np.float16,
         dict(causal=True)),
        ([513, 129, 1, 1000], [513, 129, 300, 1000], 4, 4, 128, "bfloat16", {}),
        ([700, 0, 1500, 33], [700, 90, 1500, 2000], 8, 8, 64, "bfloat16",
         dict(causal=True)),
        ([700, 0, 1500, 33], [700, 90, 1500, 2000], 8, 8, 128, np.float16, {}),
        ([700, 0, 1500, 33], [700, 90, 1500, 2000], 8, 2, 64, np.float32,
         dict(causal=True)),
        ([1000, 257, 64], [1000, 300, 64], 4, 4, 128, np.float32,
         dict(causal=True, window_size=(200, 0))),
        ([513, 129, 1], [513, 129, 1], 4, 2, 64, np.float16, dict(softcap=20.0)),
        ([800, 300], [800, 600], 4, 4, 96, np.float32, dict(alibi_slopes=True)),
        ([640, 100, 900], [640, 100, 900], 4, 4, 64, np.float32,
         dict(causal=True, dropout_p=0.2, dropout_seed=7)),
    ]
    bad = 0
    for lq, lk, Hq, Hk, d, dtype, options in cases:
        dtype = np.dtype(dtype).type
        options = dict(options)
        if options.get("alibi_slopes"):
            options["alibi_slopes"] = rng.uniform(0.01, 0.2, Hq).astype(np.float32)
        cu_q, cu_k = _cu(lq), _cu(lk)
        q = _packed(rng, lq, Hq, d, dtype)
        k, v = (_packed(rng, lk, Hk, d, dtype) for _ in range(2))
        dout = _packed(rng, lq, Hq, d, dtype)
        tq, tk, tv, tdo = (_device(x) for x in (q, k, v, dout))
        out, lse = numbaflash.attention_varlen(tq, tk, tv, cu_q, cu_k, return_lse=True,
                                               **options)
        grads = numbaflash.attention_varlen_backward(tdo, tq, tk, tv, out, lse, cu_q, cu_k,
                                                     **options)
        out = out.copy_to_host()
        grads = [g.copy_to_host() for g in grads]
        ref = dict(options)
        if "dropout_p" in ref:
            ref["dropout_keep"] = numbaflash.dropout_mask(len(lq), Hq, max(lq), max(lk),
                                                          ref["dropout_p"],
                                                          ref.pop("dropout_seed"))
        if "alibi_slopes" in ref:
            ref["alibi_slopes"] = ref["alibi_slopes"].astype(np.float64)
        causal = ref.pop("causal", False)
        f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
        want, _ = reference.forward_varlen(*f64[:3], cu_q, cu_k, causal, **ref)
        base, _ = reference.forward_varlen(q, k, v, cu_q, cu_k, causal, dtype=dtype, **ref)
        want_g = reference.backward_varlen(f64[3], *f64[:3], cu_q, cu_k, causal, **ref)
        base_g = reference.backward_varlen(dout, q, k, v, cu_q, cu_k, causal, dtype=dtype,
                                           **ref)
        ok, worst = _check(out, want, base, dtype, bench.MULT["out"])
        for name, g, w, b in zip(("dq", "dk", "dv"), grads, want_g, base_g):
            g_ok, g_worst = _check(g, w, b, dtype, bench.MULT[name])
            ok &= g_ok
            worst = max(worst, g_worst)
        bad += not ok
        opts = {key: ("..." if key == "alibi_slopes" else val) for key, val in options.items()}
        print(f"{'OK  ' if ok else 'FAIL'} agreement lengths_q={lq} lengths_k={lk} "
              f"Hq={Hq} Hk={Hk} d={d} {np.dtype(dtype).name} {opts}: max err/bound "
              f"{worst:.3f}", flush=True)
    return bad


def bitwise(forward_versions=None):
    rng = np.random.default_rng(5)
    lq, lk = [300, 0, 129, 1000], [300, 77, 400, 1000]
    bad = 0
    for dtype, version, bwd, d, hk in (
            (np.float16, "v7", "v6", 64, 2), (np.float32, "v8", "v6", 64, 2),
            (np.float32, "v9", "v6", 128, 2), (np.float16, "v10", "v9", 64, 8),
            ("bfloat16", "v10", "v9", 128, 8), ("bfloat16", "v10", "v9", 64, 8)):
        if forward_versions and version not in forward_versions:
            continue
        dtype = np.dtype(dtype).type
        cu_q, cu_k = _cu(lq), _cu(lk)
        q = _packed(rng, lq, 8, d, dtype)
        k, v = (_packed(rng, lk, hk, d, dtype) for _ in range(2))
        dout = _packed(rng, lq, 8, d, dtype)
        t = [_device(x) for x in (q, k, v, dout)]
        out, lse = numbaflash.attention_varlen(*t[:3], cu_q, cu_k, causal=True,
                                               return_lse=True, version=version)
        grads = numbaflash.attention_varlen_backward(t[3], *t[:3], out, lse, cu_q, cu_k,
                                                     causal=True, version=bwd)
        out, lse = out.copy_to_host(), lse.copy_to_host()
        grads = [g.copy_to_host() for g in grads]
        ok = True
        for b in range(len(lq)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if lq[b] == 0:
                continue
            one = [np.ascontiguousarray(np.swapaxes(x, 0, 1))[None] for x in
                   (q[rows], k[keys], v[keys], dout[rows])]
            o1, l1 = numbaflash.attention(*one[:3], causal=True, return_lse=True,
                                          version=version)
            ok &= np.array_equal(np.swapaxes(o1[0], 0, 1), out[rows], equal_nan=True)
            ok &= np.array_equal(l1[0], lse[:, rows], equal_nan=True)
            if lk[b] == 0:
                continue
            g1 = numbaflash.attention_backward(one[3], *one[:3], o1, l1, causal=True,
                                               version=bwd)
            for g, want, at in zip(grads, g1, (rows, keys, keys)):
                ok &= np.array_equal(np.swapaxes(want[0], 0, 1), g[at], equal_nan=True)
        bad += not ok
        print(f"{'OK  ' if ok else 'FAIL'} bitwise forward {version}, backward {bwd}, "
              f"{np.dtype(dtype).name}, d={d}, {hk} K/V heads: each sequence equals "
              f"attention() alone",
              flush=True)
    return bad


def speed(dtypes, dims, repeats, fwd_version=None, bwd_version=None):
    import torch
    import torch.nn.functional as F
    rng = np.random.default_rng(0)
    lengths = rng.integers(LENGTHS[0], LENGTHS[1] + 1, BATCH)
    cu = _cu(lengths)
    S = int(lengths.max())
    total = int(cu[-1])
    print(f"speed: {BATCH} sequences, lengths {LENGTHS[0]}..{LENGTHS[1]} (total {total}, "
          f"longest {S}, padded {BATCH * S}: {total / (BATCH * S):.2f} of the padded rows), "
          f"{HEADS} heads", flush=True)
    valid = np.zeros((BATCH, S), bool)
    for b, n in enumerate(lengths):
        valid[b, :n] = True
    for dtype in dtypes:
        tdt = getattr(torch, dtype)
        for d in dims:
            g = torch.Generator(device="cuda").manual_seed(1)
            q, k, v, dout = (torch.randn((total, HEADS, d), generator=g, device="cuda",
                                         dtype=tdt) for _ in range(4))
            qp, kp, vp, dop = (torch.zeros((BATCH, HEADS, S, d), device="cuda", dtype=tdt)
                               for _ in range(4))
            for b in range(BATCH):
                at = slice(int(cu[b]), int(cu[b + 1]))
                for x, xp in ((q, qp), (k, kp), (v, vp), (dout, dop)):
                    xp[b, :, :lengths[b]] = x[at].transpose(0, 1)
            # what numbaflash reads (bfloat16 through its int16 view); SDPA takes the tensors
            nq, nk, nv, ndo, nqp, nkp, nvp, ndop = (_numba(x) for x in
                                                    (q, k, v, dout, qp, kp, vp, dop))
            packed_bytes = 4 * q.numel() * q.element_size()
            padded_bytes = 4 * qp.numel() * qp.element_size()
            for causal in (False, True):
                # the padding hidden: keys past the sequence, and (causal) the future
                mask = torch.from_numpy(valid[:, None, None, :] & valid[:, None, :, None])
                if causal:
                    mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
                mask = mask.cuda()
                cu_host = cu             # host cu_seqlens: no wait for a device copy

                def packed_fwd():
                    return numbaflash.attention_varlen(nq, nk, nv, cu_host, cu_host,
                                                       max_seqlen_q=S, max_seqlen_k=S,
                                                       causal=causal, return_lse=True,
                                                       version=fwd_version)
                ran = (numbaflash.explain_varlen(
                    nq, nk, nv, cu_host, cu_host, max_seqlen_q=S, max_seqlen_k=S,
                    causal=causal, version=fwd_version).version,
                    numbaflash.explain_varlen_backward(
                    nq, nk, nv, cu_host, cu_host, max_seqlen_q=S, max_seqlen_k=S,
                    causal=causal, version=bwd_version)[-1].version,
                    numbaflash.explain(nqp, nkp, nvp, attn_mask=mask).version,
                    numbaflash.explain_backward(nqp, nkp, nvp, attn_mask=mask)[-1].version)

                def padded_fwd():
                    return numbaflash.attention(nqp, nkp, nvp, attn_mask=mask,
                                                return_lse=True)

                out, lse = packed_fwd()
                outp, lsep = padded_fwd()
                t_pk = _ms(packed_fwd, repeats)
                t_pd = _ms(padded_fwd, repeats)
                t_pk_b = _ms(lambda: numbaflash.attention_varlen_backward(
                    ndo, nq, nk, nv, out, lse, cu_host, cu_host, max_seqlen_q=S,
                    max_seqlen_k=S, causal=causal, version=bwd_version), repeats)
                t_pd_b = _ms(lambda: numbaflash.attention_backward(
                    ndop, nqp, nkp, nvp, outp, lsep, attn_mask=mask), repeats)
                t_sdpa = t_sdpa_fb = float("nan")
                try:
                    qs, ks, vs = (x.clone().requires_grad_(True) for x in (qp, kp, vp))
                    t_sdpa = _ms(lambda: F.scaled_dot_product_attention(
                        qs, ks, vs, attn_mask=mask), repeats)

                    def sdpa_fb():
                        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                        o.backward(dop)
                    t_sdpa_fb = _ms(sdpa_fb, repeats)
                except RuntimeError as e:
                    print(f"  SDPA: {e}", flush=True)
                fb_pk, fb_pd = t_pk + t_pk_b, t_pd + t_pd_b
                print(f"{dtype} d={d} causal={causal} (packed: forward {ran[0]}, backward "
                      f"{ran[1]}; padded: {ran[2]}, {ran[3]}): forward packed {t_pk:.2f} ms, "
                      f"padded "
                      f"+ mask {t_pd:.2f} ms ({t_pd / t_pk:.2f}x), SDPA padded + mask "
                      f"{t_sdpa:.2f} ms ({t_sdpa / t_pk:.2f}x); forward + backward packed "
                      f"{fb_pk:.2f} ms, padded + mask {fb_pd:.2f} ms ({fb_pd / fb_pk:.2f}x), "
                      f"SDPA {t_sdpa_fb:.2f} ms ({t_sdpa_fb / fb_pk:.2f}x); q, k, v, dout "
                      f"{packed_bytes / 2**20:.0f} MiB packed, {padded_bytes / 2**20:.0f} MiB "
                      f"padded", flush=True)
            qp = kp = vp = dop = mask = None        # free the padded batch
            torch.cuda.empty_cache()


def _ms(fn, repeats):
    """Median ms of fn() (``bench.time_ms``), after 3 warm-up calls."""
    return bench.time_ms(fn, repeats=repeats, warmup=3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="agreement,bitwise,speed")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--forward-version", default=None)
    ap.add_argument("--backward-version", default=None)
    ap.add_argument("--bitwise-forward", default=None,
                    help="the bitwise part's cases of these forward versions only (e.g. v10)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    bad = 0
    if "agreement" in parts:
        bad += agreement()
    if "bitwise" in parts:
        bad += bitwise(args.bitwise_forward and args.bitwise_forward.split(","))
    if "speed" in parts:
        speed(args.dtypes.split(","), [int(x) for x in args.dims.split(",")], args.repeats,
              args.forward_version, args.backward_version)
    print(f"{'FAILED' if bad else 'passed'}: {bad} failing case(s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
