"""ptxas's numbers for the same kernels in two trees: registers, stack and spill stores
before -> after, for every kernel whose PTX changed (or every kernel with ``-v``).

    (cd OLD && NUMBA_ENABLE_CUDASIM=0 python tests/ptx_check.py --match forward_v --link > old.txt)
    (cd NEW && NUMBA_ENABLE_CUDASIM=0 python tests/ptx_check.py --match forward_v --link > new.txt)
    python lab/sweeps/ptx_compare.py old.txt new.txt [-v]
"""

import json
import sys


def load(path):
    out = {}
    for line in open(path):
        if line.startswith("PTXCHECK "):
            r = json.loads(line[len("PTXCHECK "):])
            out[r["name"]] = r
    return out


def main():
    old, new = load(sys.argv[1]), load(sys.argv[2])
    every = "-v" in sys.argv
    print(f"{'kernel':72s} registers  stack  spill stores")
    for name, a in new.items():
        b = old.get(name)
        if b is None or (b["fingerprint"] == a["fingerprint"] and not every):
            continue
        cells = [f"{b.get(key)}->{a.get(key)}"
                 for key in ("registers", "stack_bytes", "spill_stores")]
        print(f"{name:72s} {cells[0]:10s} {cells[1]:6s} {cells[2]}")


if __name__ == "__main__":
    main()
