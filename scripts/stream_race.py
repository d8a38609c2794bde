"""The side-stream scenario: does numbaflash run on the caller's PyTorch stream?

On a GPU with PyTorch, as a training loop that uses streams would:

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(...)            # other work queued on s first
        q.copy_(q_new); ...               # the inputs written on s
        out = numbaflash.attention(q, k, v, ...)
        result = torch.as_tensor(out, device="cuda").clone()   # read on s

The result is right only if numbaflash's kernels run on ``s``: after the inputs are
written, before the result is read. A kernel on the legacy default stream races with
``s`` (PyTorch's streams do not wait for it). Each trial uses new inputs and compares
with SDPA's result (float32, MATH backend, TF32 off) computed apart on the default
stream; the forward and the backward (dq) are both checked.

    python3 scripts/stream_race.py [--trials 20] [--shape 4 16 1024 64]

Prints one line per trial and a summary; exits 1 if any trial was wrong.
"""

import argparse
import sys

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--shape", type=int, nargs=4, default=(4, 16, 1024, 64),
                    metavar=("B", "H", "N", "D"))
    ap.add_argument("--sleep-cycles", type=int, default=50_000_000,
                    help="GPU cycles of work queued on the side stream before the inputs")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numbaflash

    torch.backends.cuda.matmul.allow_tf32 = False
    B, H, N, D = args.shape
    dev = torch.device("cuda")
    q, k, v, dout = (torch.empty(B, H, N, D, device=dev) for _ in range(4))
    s = torch.cuda.Stream()
    wrong = 0
    for trial in range(args.trials):
        g = torch.Generator(device=dev).manual_seed(trial)
        new = [torch.randn(B, H, N, D, device=dev, generator=g) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(args.sleep_cycles)
            for x, y in zip((q, k, v, dout), new):
                x.copy_(y)
            out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
            got_out = torch.as_tensor(out, device=dev).clone()
            dq, _, _ = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
            got_dq = torch.as_tensor(dq, device=dev).clone()
        torch.cuda.synchronize()
        qr, kr, vr = (x.clone().requires_grad_() for x in new[:3])
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        ref.backward(new[3])
        err_out = (got_out - ref).abs().max().item()
        err_dq = (got_dq - qr.grad).abs().max().item()
        ok = bool(np.isfinite(err_out) and np.isfinite(err_dq) and err_out < 1e-4
                  and err_dq < 1e-3)
        wrong += not ok
        print(f"trial {trial:2d}: max|out - SDPA| = {err_out:.3g}, max|dq - SDPA| = "
              f"{err_dq:.3g}: {'ok' if ok else 'WRONG'}", flush=True)
    print(f"{wrong} of {args.trials} trials wrong (shape {tuple(args.shape)}, causal, "
          f"float32, side stream)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
