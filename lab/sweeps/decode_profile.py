"""One split-KV decode call per dtype at (8, 32, 1, 32768, 128), for Nsight Compute:

    ncu --kernel-name regex:split_kv --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        python lab/sweeps/decode_profile.py float32

Each call runs twice (the first compiles; skip it).
"""
import sys

import torch

import numbaflash

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
splits = int(sys.argv[2]) if len(sys.argv) > 2 else None
q = torch.randn((8, 32, 1, 128), device="cuda", dtype=dtype)
kc = torch.randn((8, 32, 32768, 128), device="cuda", dtype=dtype)
vc = torch.randn((8, 32, 32768, 128), device="cuda", dtype=dtype)
for _ in range(2):
    numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=32768, num_splits=splits)
torch.cuda.synchronize()
