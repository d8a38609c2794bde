"""A roofline of each float32 backward kernel, from Nsight Compute's records (no GPU).

Nsight Compute's roofline section prints a chart, no text, so this reads the numbers a
roofline needs from the text its other sections print (`ncu --set full`, as
`bash lab/sweeps/train_f32_gpu.sh ncu` runs it on backward v6 at (2, 16, 4096, d),
float32, not causal) and does the arithmetic:

- useful FLOPs: each tile product of the kernel counted as 2 Sq Sk d per (batch, head).
  The dK/dV kernel makes four (S, dP, dV, dK) and the dQ kernel three (S, dP, dQ). The
  tensor cores do three times that work (3xTF32: big*big, big*small, small*big);
- DRAM bytes: Nsight's DRAM bandwidth (GB/s) times the kernel's duration, and the DRAM
  peak the record implies (bandwidth / its percentage of peak);
- the TF32 tensor peak at the record's SM clock: 2048 dense TF32 FLOP per clock per SM
  (NVIDIA's H100 SXM figure, 494.7 TFLOP/s at 1.83 GHz on 132 SMs), of which 3xTF32
  leaves a third for useful work.

    python3 lab/sweeps/roofline_from_ncu.py lab/runs/2026-12-07/144_train_f32_ncu_d64.txt \
        lab/runs/2026-12-07/144_train_f32_ncu_d128.txt
"""

import re
import sys

B, H, S = 2, 16, 4096
SMS = 132
TF32_FLOP_PER_CLOCK_SM = 2048
PRODUCTS = {"backward_dkdv_v6": 4, "backward_dq_v6": 3}


def metric(block, name, unit=r"\S+"):
    """The value of the first line of ``block`` with this metric name and unit."""
    found = re.search(r"^\s+" + re.escape(name) + r"\s+" + unit + r"\s+([\d.,]+)\s*$", block,
                      re.M)
    if found is None:
        raise ValueError(f"no {name!r} in the record")
    return float(found.group(1).replace(",", ""))


def kernels(text):
    """(kernel name, its section text) for each kernel the record profiled."""
    parts = re.split(r"^  (?:make_\w+::)?(backward_\w+_v6)\[", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def main(paths):
    print("| kernel | d | ms | useful TFLOP/s | tensor TF32 TFLOP/s | % of TF32 peak "
          "| DRAM MB | DRAM peak TB/s | FLOP / DRAM byte | ridge FLOP / byte | issue slots "
          "busy | eligible warps / scheduler |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        text = open(path).read()
        d = int(re.search(r"_d(\d+)\.txt$", path).group(1))
        for name, block in kernels(text):
            ms = metric(block, "Duration")
            clock = metric(block, "SM Frequency") * 1e9
            dram_gbs = metric(block, "Memory Throughput", "Gbyte/s")
            dram_pct = metric(block, "DRAM Throughput")
            busy = metric(block, "Issue Slots Busy")
            eligible = metric(block, "Eligible Warps Per Scheduler", "warp")
            useful = PRODUCTS[name] * 2 * S * S * d * B * H
            tensor_peak = SMS * TF32_FLOP_PER_CLOCK_SM * clock
            dram_bytes = dram_gbs * 1e9 * ms * 1e-3
            dram_peak = dram_gbs * 1e9 / (dram_pct / 100)
            ridge = (tensor_peak / 3) / dram_peak          # useful FLOPs per byte
            share = 100 * 3 * useful / (ms * 1e-3) / tensor_peak
            print(f"| {name} | {d} | {ms:.2f} | {useful / ms / 1e9:.1f} | "
                  f"{3 * useful / ms / 1e9:.1f} | {share:.1f} "
                  f"| {dram_bytes / 1e6:.0f} | {dram_peak / 1e12:.2f} | "
                  f"{useful / dram_bytes:.0f} | {ridge:.0f} | "
                  f"{busy:.1f} % | {eligible:.2f} |")
    print(f"\nTF32 peak at the records' clock: {SMS} SMs x {TF32_FLOP_PER_CLOCK_SM} FLOP x the "
          "SM frequency Nsight reports (it locks the clock); useful work can reach a third "
          "of it with 3xTF32. The ridge is that third over the DRAM peak the record implies "
          "(above the H100 SXM's 3.35 TB/s of HBM3 by NVIDIA's figure, with which the ridge "
          "would be about 36 FLOP a byte at this clock); either way each kernel does about "
          "40 to 70 times the ridge's work per DRAM byte.")


if __name__ == "__main__":
    main(sys.argv[1:])
