"""The README's headline accuracy tables say what the generated documents say: the end-to-end table against
data/accuracy/nvidia.json (written by the same neusight-evaluate run as docs/evaluation.md) and the L4 kernel
table against docs/kernels.md (neusight-evaluate-kernels). Regenerating either without the README fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# README row label -> device key
GPUS = {"P100-PCIE-16GB": "p100-pcie-16gb", "V100-PCIE-32GB": "v100-pcie-32gb", "A100-PCIE-40GB": "a100-pcie-40gb",
        "T4": "t4", "P4": "p4", "L4": "l4"}
FAMILIES = {"linear": "linear", "bmm": "bmm", "elementwise": "elementwise", "softmax": "softmax",
            "layer norm": "layernorm"}


def _section(text: str, title: str) -> str:
    """From a paragraph opening with ``title`` (at the start of a line) to the next bold-led paragraph."""
    start = text.index("\n" + title) + 1
    end = text.find("\n**", start + len(title))
    return text[start:end if end > 0 else None]


def _rows(block: str) -> list[list[str]]:
    """Cells of every markdown table row of ``block`` (header and separator rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()
            if line.startswith("|")]


def _pct(cell: str) -> float | None:
    m = re.match(r"([0-9.]+) %", cell)
    return float(m.group(1)) if m else None


def test_readme_end_to_end_table_matches_the_accuracy_record():
    readme = (REPO / "README.md").read_text()
    records = json.loads((REPO / "data" / "accuracy" / "nvidia.json").read_text())["records"]
    measured = {(r["gpu"], r["mode"]): r["mean_abs_error_pct"] for r in records
                if r["workload"] == "transformer" and not r["fused"] and r["gpu"]}
    checked = 0
    for cells in _rows(_section(readme, "**End to end, NeuSight labels**")):
        label = cells[0].strip("*").replace(" (never seen)", "")
        if label not in GPUS:
            continue
        for mode, cell in (("inference", cells[2]), ("training", cells[3])):
            value = _pct(cell)
            if value is None:
                assert (GPUS[label], mode) not in measured, f"README has no {mode} figure for {label}"
                continue
            assert value == round(measured[(GPUS[label], mode)], 1), (label, mode)
            checked += 1
    assert checked == len(measured) == 8


def test_readme_l4_kernel_table_matches_docs_kernels():
    readme = (REPO / "README.md").read_text()
    kernels = (REPO / "docs" / "kernels.md").read_text()
    # docs/kernels.md's per-family tables: "### <family>" then a row per GPU
    l4 = {}
    for fam in FAMILIES.values():
        block = kernels.split(f"### {fam}\n", 1)[1].split("\n#", 1)[0]
        row = next(c for c in _rows(block) if c[0].startswith("l4"))
        l4[fam] = [float(row[i].strip("*")) for i in (2, 5, 8)]     # NeuSight, roofline, GBR MAPE
    checked = 0
    for cells in _rows(_section(readme, "**Kernels**")):
        if cells[0] in FAMILIES:
            assert [_pct(c) for c in cells[1:4]] == l4[FAMILIES[cells[0]]], cells[0]
            checked += 1
    assert checked == len(FAMILIES)
