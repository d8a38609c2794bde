"""Stress the simulator's warp rendezvous: backward v5 or forward v6/v8/v9 at (2, 2, 37, 29, 8),
bottom-right causal, in a loop, with a short interpreter switch interval and a short poll
of the waiting lanes (both make the thread that opens a barrier wait longer between its
wake-ups, as a loaded CPU does). Prints one line per iteration: ok and its seconds, or the
error. Run from the repository root:

    NUMBA_ENABLE_CUDASIM=1 SWITCH=1e-5 POLL=0.001 python3 lab/sweeps/simulator_stuck_lanes.py bwd 20

Before 1e58f97 the first iteration stopped at a barrier half-way through waking its
threads (lab/runs/2026-12-03/stuck_lanes_pyspy.txt); after it, iterations finish.
"""
import sys, time, os
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, ROOT)
sys.setswitchinterval(float(os.environ.get("SWITCH", "1e-5")))
import numpy as np, numbaflash
import numbaflash.kernels.simulated as S
S._POLL_S = float(os.environ.get("POLL", "0.5"))
from strategies import make_case
from tolerance import to_host
which = sys.argv[1]
for it in range(int(sys.argv[2])):
    t = time.time()
    try:
        if which == "bwd":
            case = make_case(B=2, H=2, Sq=37, Sk=29, d=8, dtype="float32", causal="bottom_right", seed=5*37+8, with_dout=True)
            out, lse = numbaflash.attention(case.q, case.k, case.v, causal="bottom_right", return_lse=True)
            numbaflash.attention_backward(case.dout, case.q, case.k, case.v, to_host(out), to_host(lse), causal="bottom_right", version="v5")
        else:
            case = make_case(B=2, H=2, Sq=37, Sk=29, d=8, causal="bottom_right", seed=8)
            for ver in ("v6", "v8", "v9"):
                numbaflash.attention(case.q, case.k, case.v, causal="bottom_right", version=ver, return_lse=True)
        print(it, "ok", round(time.time()-t, 1), flush=True)
    except Exception as e:
        print(it, "FAIL", repr(e)[:3000], flush=True)
