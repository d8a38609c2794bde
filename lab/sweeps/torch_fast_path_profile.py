"""cProfile of 3000 numbaflash.torch.attention calls at (1, 1, 128, 64), float32, no grad, on a GPU:
where the Python of a repeated small call goes (the 18 functions with the most own time).

    python3 lab/sweeps/torch_fast_path_profile.py
"""
import cProfile, pstats, torch, numbaflash.torch as nft
q, k, v = (torch.randn(1, 1, 128, 64, device="cuda") for _ in range(3))
with torch.no_grad():
    for _ in range(20): nft.attention(q, k, v)
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3000): nft.attention(q, k, v)
    pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
