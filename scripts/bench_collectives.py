"""The collective model as tables to hold against nccl-tests: writes docs/collectives.md.

    python scripts/bench_collectives.py            # a few seconds, no GPU, no data

For a few GPUs and group layouts, the time `neusight.parallel` forecasts for an all-reduce and an all-gather of
each size (8 B to 8 GiB), with the algorithm and protocol NCCL's cost model picks (`nccl_collective`), and the
two bandwidths nccl-tests prints for the same call: algbw = bytes / time and busbw = algbw x 2 (n - 1) / n for an
all-reduce, (n - 1) / n for an all-gather (nccl-tests' "size" of an all-gather is the gathered buffer, as here).
Anyone with such a machine can run `all_reduce_perf -b 8 -e 8G -f 4 -g 1` (one process per GPU under MPI or
torchrun) and compare row by row; nothing in this table was measured here.

Groups are laid out as a forecast lays them out (`Links.of` for dp = n GPUs, 8 per node, 100 GB/s of network
per GPU between nodes: one 400 Gb/s InfiniBand port each). 8 and 16 H100s are shown twice: as NCCL runs on HGX
H100s by default (all-reduces also as NVLS, through the NVSwitches' NVLink SHARP, and NVLS_TREE across nodes) and
with `NCCL_NVLS_ENABLE=0` (`nvls=False`: rings and trees only), which is also how nccl-tests runs where the fabric
manager offers no multicast.

Last, the one public measurement found to hold the model against (MEASURED): nccl-tests' `all_reduce_perf -b 8 -e
8G -f 2 -g 1` on two nodes of 8 H100 80GB HBM3 each, eight 200 Gb/s network ports per node (Google Cloud A3 Mega:
GPUDirect-TCPXO, not InfiniBand), out-of-place times as published in the GitHub repository
lessizzmore/create-a3mega-ztan-fork (file `ztan-NCCL-test-result`), against the forecast for the same layout
(`internode_gbps=50`: 200 Gb/s per GPU) with and without NVLink SHARP. Whether that run used NVLS_TREE is not
recorded, but its large all-reduces run faster than any ring over those ports could (a ring's bus bandwidth is at
most the node's 200 GB/s of ports one way).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neusight.devices import load_device  # noqa: E402
from neusight.e2e_eval import markdown_table  # noqa: E402
from neusight.parallel import GPUS_PER_NODE, INTERNODE_GBPS, Links, Parallelism, nccl_collective  # noqa: E402
from neusight.util import atomic_write_text  # noqa: E402

OUT = REPO / "docs" / "collectives.md"
SIZES = [2 ** e for e in range(3, 34, 2)]          # 8 B, 32 B, ..., 8 GiB: nccl-tests' -b 8 -e 8G -f 4
LAYOUTS = [("h100-sxm5-80gb", 8, True), ("h100-sxm5-80gb", 8, False), ("h100-sxm5-80gb", 16, True),
           ("h100-sxm5-80gb", 16, False), ("h100-sxm5-80gb", 64, True), ("a100-sxm4-80gb", 8, True),
           ("a100-80gb-pcie", 8, True), ("l4", 4, True)]


def _size(b: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= scale:
            return f"{b // scale} {unit}"
    return f"{b} B"


def table(key: str, n: int, nvls: bool) -> tuple[str, str]:
    device = load_device(key)
    path = Links.of(Parallelism(dp=n), device, GPUS_PER_NODE, INTERNODE_GBPS, nvls=nvls).dp
    rows = []
    for b in SIZES:
        row = {"size": _size(b)}
        for name, passes, factor in (("all-reduce", 2, 2 * (n - 1) / n), ("all-gather", 1, (n - 1) / n)):
            ms, how = nccl_collective(b, n, device, path, passes)
            algbw = b / (ms * 1e-3) / 1e9
            row.update({f"{name} us": f"{ms * 1e3:,.1f}", f"{name} algbw GB/s": f"{algbw:,.2f}",
                        f"{name} busbw GB/s": f"{algbw * factor:,.2f}", f"{name} as": how})
        rows.append(row)
    sharp = ", NVLink SHARP" if path.nvls else ", without NVLink SHARP: nvls=False" if device.nvls else ""
    where = (f"{path.nodes} nodes of {GPUS_PER_NODE}, {path.gbps:g} GB/s per GPU between them{sharp}"
             if path.nodes > 1 else f"one node, {path.gbps:g} GB/s per GPU ({path.kind}{sharp})")
    return f"{n} x {key} ({where})", markdown_table(pd.DataFrame(rows), index=False)


# (bytes, out-of-place us) of that nccl-tests run, a subset of its rows
MEASURED = [(2 ** 20, 203.2), (2 ** 22, 364.6), (2 ** 24, 977.6), (2 ** 26, 1261.6), (2 ** 28, 2360.9),
            (2 ** 30, 6759.0), (2 ** 31, 12646.0), (2 ** 33, 47535.0)]
MEASURED_8B_US = 135.8


def measured_table() -> tuple[str, str]:
    """The table, and a sentence of what it shows (the ratios from 1 GiB on and below it)."""
    device, n = load_device("h100-sxm5-80gb"), 16
    rows, ratios = [], []
    for b, us in MEASURED:
        row = {"size": _size(b), "measured us": f"{us:,.1f}",
               "measured busbw GB/s": f"{b / (us * 1e-6) / 1e9 * 2 * (n - 1) / n:,.1f}"}
        for label, nvls in (("forecast", True), ("forecast nvls=False", False)):
            path = Links.of(Parallelism(dp=n), device, GPUS_PER_NODE, 50.0, nvls=nvls).dp
            ms, how = nccl_collective(b, n, device, path)
            row.update({f"{label} us": f"{ms * 1e3:,.1f}", f"{label} / measured": f"{ms * 1e3 / us:.2f}",
                        f"{label} as": how})
            ratios.append((b, nvls, ms * 1e3 / us))
        rows.append(row)
    large = [r for b, nvls, r in ratios if nvls and b >= 2 ** 30]
    rings = [r for b, nvls, r in ratios if not nvls and b >= 2 ** 30]
    small = [1 / r for b, nvls, r in ratios if nvls and b < 2 ** 30]
    said = (f"From 1 GiB on the forecast with NVLink SHARP (NCCL's NVLS_TREE) is {min(large):.2f}-{max(large):.2f}x "
            f"the measured time, the rings alone {min(rings):.2f}-{max(rings):.2f}x; below 1 GiB the all-reduces ran "
            f"{min(small):.1f}-{max(small):.1f}x slower than forecast: that network's latency ({MEASURED_8B_US:g} us "
            "for 8 bytes) is not InfiniBand's, which the model's constants are.")
    return markdown_table(pd.DataFrame(rows), index=False), said


def main() -> None:
    start = time.time()
    parts = []
    for key, n, nvls in LAYOUTS:
        title, body = table(key, n, nvls)
        parts += [f"## {title}", "", body, ""]
    body, said = measured_table()
    parts += ["## Against a measurement: 16 x H100 80GB HBM3 (2 nodes of 8, 200 Gb/s per GPU between them)", "",
              "nccl-tests' all-reduce on Google Cloud A3 Mega nodes (GPUDirect-TCPXO), as published in the GitHub "
              "repository lessizzmore/create-a3mega-ztan-fork; the script's docstring says more. " + said, "",
              body, ""]
    head = [
        "# Collectives as forecast: all-reduce and all-gather times to hold against nccl-tests", "",
        f"Generated by `python scripts/bench_collectives.py` in {time.time() - start:.1f} s; regenerate it, do not "
        "edit it. What the columns are, and how to compare: the script's docstring. The model: "
        "`neusight.parallel.nccl_collective` (NCCL's cost model of its rings, trees and, on nodes of NVSwitches "
        "with NVLink SHARP, NVLS and NVLS_TREE, with the constants of its `tuning.cc`, at 80 % of each link's one-way "
        "bandwidth). Not measured: no multi-GPU machine was available here. NVLS all-gathers and reduce-scatters and "
        "CollNet are not modelled.", "",
    ]
    atomic_write_text(OUT, "\n".join(head + parts))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
