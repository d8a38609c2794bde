"""Where the host's time goes in one ``attention_with_kvcache`` call on a GPU: cProfile
over 50 decode calls (float16, batch 8, 32 query heads on 8 K/V heads, 32768 cached keys,
d = 128, PyTorch tensors, the default kernel), the 25 functions with the most cumulative
time.

    python3 lab/sweeps/decode_call_profile.py
"""
import cProfile
import pstats
import sys

import torch

import numbaflash

sys.path.insert(0, "scripts")
from decode_gpu import _inputs, _numba  # noqa: E402

q, kc, vc = (_numba(x) for x in _inputs((8, 32, 8, 1, 32768, 128), "float16"))
call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=32768)  # noqa: E731
for _ in range(5):
    call()
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
for _ in range(50):
    call()
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
