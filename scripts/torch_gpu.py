"""numbaflash.torch on a GPU, with CUDA tensors: what tests/test_torch.py checks on CPU
tensors in the simulator, plus the side stream and the costs of the layer.

    python3 scripts/torch_gpu.py [--calls 300] [--parts gradchecks,side_stream,training,overhead,layout]

Prints one line per check and a summary table last:

1. gradcheck in float64 on CUDA tensors: plain, causal with Sq > Sk, softcap with a
   window (torch.autograd.gradcheck; fast mode for the last two).
2. The side stream: inside ``with torch.cuda.stream(s):`` q, k, v are written by a chain
   of in-place ops, numbaflash.torch.attention and its backward run, and the results are
   read on ``s``; each of 20 trials is compared with SDPA MATH in float64 (wrong: an
   error above 1 % of the largest value, which rounding never reaches and a race does).
3. A tiny model (one causal attention layer and a linear head, float32, TF32 off) trained
   20 SGD steps with numbaflash.torch.scaled_dot_product_attention and with PyTorch's
   SDPA (its default backend): the largest relative difference of the two loss curves.
4. Overhead at (1, 1, 128, 64), float32, forward only: the median wall time of one call
   with a synchronize after it, over ``--calls`` calls, for the raw launch of the kernel
   (preallocated tensors, parameter words built once), numbaflash.attention on the
   tensors, numbaflash.torch.attention without and with autograd, and
   F.scaled_dot_product_attention (default backend). Targets: the torch layer at most
   1.5x the raw launch and at most 2x SDPA's call.
5. flash-attn's layout at (2, 4096, 16, 64), float32 and float16: flash_attn_func on
   (b, s, h, d) tensors and flash_attn_varlen_func on their (b * s, h, d) views (a packed
   batch of equal lengths, read in place) against attention on (b, h, s, d) ones, median
   of 20 timed with CUDA events.
"""

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import numbaflash
import numbaflash.torch as nft

DEV = "cuda"


def gradchecks():
    rows = []
    for name, (Sq, Sk), options, fast in (
            ("plain", (16, 16), {}, False),
            ("causal, Sq > Sk", (20, 13), {"causal": True}, True),
            ("softcap + window", (16, 16), {"softcap": 5.0, "window_size": (4, 2)}, True)):
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(1, 2, Sq, 8, dtype=torch.float64, device=DEV, generator=g)
        k, v = (torch.randn(1, 2, Sk, 8, dtype=torch.float64, device=DEV, generator=g)
                for _ in range(2))
        args = [x.requires_grad_() for x in (q, k, v)]
        ok = torch.autograd.gradcheck(lambda a, b, c: nft.attention(a, b, c, **options),
                                      args, fast_mode=fast, raise_exception=False)
        rows.append((f"gradcheck float64, {name}", "pass" if ok else "FAIL"))
        print(rows[-1], flush=True)
    return rows


def side_stream(trials=20, shape=(4, 16, 1024, 64)):
    wrong = 0
    s = torch.cuda.Stream()
    for t in range(trials):
        with torch.cuda.stream(s):
            q, k, v, do = (torch.empty(shape, device=DEV) for _ in range(4))
            for i, x in enumerate((q, k, v, do)):     # a chain of in-place ops on s
                x.fill_(0.0).add_(torch.randn(shape, device=DEV)).mul_(1.0 + 0.1 * t + i)
            for x in (q, k, v):
                x.requires_grad_()
            out = nft.attention(q, k, v, causal=True)
            dq, = torch.autograd.grad(out, q, do)
            out_host, dq_host = out.detach().cpu(), dq.cpu()      # read on s
        s.synchronize()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
            ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
            rdq, = torch.autograd.grad(ref, q64, do.double())
        # relative to the largest value: float32 rounding gives 1e-6 to 1e-4 here, a read
        # of inputs not yet written (or results not yet computed) the order of the values
        e_out = ((out_host.double() - ref.detach().cpu()).abs().max()
                 / ref.detach().abs().max().cpu()).item()
        e_dq = ((dq_host.double() - rdq.cpu()).abs().max() / rdq.abs().max().cpu()).item()
        bad = not (e_out < 1e-2 and e_dq < 1e-2)
        wrong += bad
        print(f"side stream trial {t:2d}: max|out - ref| / max|ref| {e_out:.2e}, "
              f"max|dq - ref| / max|ref| {e_dq:.2e}{': WRONG' if bad else ''}", flush=True)
    return [("side stream (torch layer, fwd + bwd)", f"{wrong} of {trials} wrong")]


class Tiny(torch.nn.Module):
    def __init__(self, sdpa, D=64, H=4):
        super().__init__()
        self.sdpa, self.H = sdpa, H
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)
        return self.proj(self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D))


def loss_curve(sdpa, steps=20):
    torch.manual_seed(0)
    model = Tiny(sdpa).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(4, 128, 64, device=DEV, generator=g)
    y = torch.randn(4, 128, 64, device=DEV, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def training():
    torch.backends.cuda.matmul.allow_tf32 = False     # the linear layers in float32 too
    want = loss_curve(F.scaled_dot_product_attention)
    got = loss_curve(nft.scaled_dot_product_attention)
    diff = np.max(np.abs(got - want) / np.abs(want))
    print(f"loss curves: numbaflash.torch {got[0]:.6f} -> {got[-1]:.6f}, SDPA "
          f"{want[0]:.6f} -> {want[-1]:.6f}", flush=True)
    return [("tiny model, 20 steps: max relative loss difference", f"{diff:.2e}")]


def wall_ms(fn, calls):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def raw_launch(q, k, v, **options):
    """The raw launch of the kernel numbaflash.torch.attention(q, k, v, **options) runs
    (no autograd): on preallocated tensors, with the parameter words built once (what any
    caller pays at least); a function of no arguments."""
    nft._FAST.clear()
    with torch.no_grad():
        nft.attention(q, k, v, **options)
    (fast,) = nft._FAST.values()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device)
    words = (*nft._tensor_words(q, fast.q3), *nft._tensor_words(k, fast.k3),
             *nft._tensor_words(v, fast.k3), *nft._tensor_words(out, fast.q3),
             *nft._tensor_words(lse, fast.l2), *fast.before_seed, *nft._NO_SEED,
             *fast.after_seed)
    stream = nft._torch_stream(q.device)
    return lambda: fast.direct.launch_words(words, stream, q.device.index)


def overhead(calls):
    q, k, v = (torch.randn(1, 1, 128, 64, device=DEV) for _ in range(3))
    api = wall_ms(lambda: numbaflash.attention(q, k, v), calls)
    with torch.no_grad():
        layer = wall_ms(lambda: nft.attention(q, k, v), calls)
        sdpa = wall_ms(lambda: F.scaled_dot_product_attention(q, k, v), calls)
        raw = wall_ms(raw_launch(q, k, v), calls)
    graded = [x.clone().requires_grad_() for x in (q, k, v)]
    layer_grad = wall_ms(lambda: nft.attention(*graded), calls)
    return [("overhead (1,1,128,64): raw kernel launch, ms", f"{raw:.4f}"),
            ("overhead: numbaflash.attention on the tensors, ms", f"{api:.4f}"),
            ("overhead: numbaflash.torch.attention, no grad, ms", f"{layer:.4f}"),
            ("overhead: numbaflash.torch.attention, inputs requiring grad, ms",
             f"{layer_grad:.4f}"),
            ("overhead: F.scaled_dot_product_attention, ms", f"{sdpa:.4f}"),
            ("overhead: torch layer (no grad) / raw launch (target <= 1.5)",
             f"{layer / raw:.2f}"),
            ("overhead: torch layer (no grad) / SDPA (target <= 2)", f"{layer / sdpa:.2f}"),
            ("overhead: torch layer (grad) / SDPA", f"{layer_grad / sdpa:.2f}")]


def event_ms(fn, repeats=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def layout():
    B, S, H, d = 2, 4096, 16, 64
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEV)
    rows = []
    for dtype in (torch.float32, torch.float16):
        name = str(dtype).replace("torch.", "")
        q, k, v = (torch.randn(B, S, H, d, device=DEV, dtype=dtype) for _ in range(3))
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        packed = [x.view(B * S, H, d) for x in (q, k, v)]   # the same memory, no copy
        with torch.no_grad():
            bshd = event_ms(lambda: nft.flash_attn_func(q, k, v))
            inplace = event_ms(lambda: nft.flash_attn_varlen_func(*packed, cu, cu, S, S))
            bhsd = event_ms(lambda: nft.attention(qh, kh, vh))
        rows += [(f"layout (2,4096,16,64) {name}: flash_attn_func (b,s,h,d), ms",
                  f"{bshd:.3f}"),
                 (f"layout {name}: flash_attn_varlen_func on its (b*s,h,d) view, ms",
                  f"{inplace:.3f}"),
                 (f"layout {name}: attention (b,h,s,d), ms", f"{bhsd:.3f}"),
                 (f"layout {name}: (b,s,h,d) / (b,h,s,d) (target <= 1.05)",
                  f"{bshd / bhsd:.3f}"),
                 (f"layout {name}: varlen view / (b,h,s,d)", f"{inplace / bhsd:.3f}")]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--parts", default="gradchecks,side_stream,training,overhead,layout",
                        help="which of the five parts to run, comma-separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("scripts/torch_gpu.py needs PyTorch with a CUDA GPU")
    parts = dict(gradchecks=gradchecks, side_stream=side_stream, training=training,
                 overhead=lambda: overhead(args.calls), layout=layout)
    rows = []
    for name in args.parts.split(","):
        rows += parts[name]()
    print()
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
