"""Render the example pictures of the README into docs/img (regenerate after changing the predictor).

    python scripts/make_examples.py
"""

from __future__ import annotations

import logging
from pathlib import Path

import neusight
from neusight.cli.common import quiet_third_party_logs

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
EXAMPLES = [
    # (file prefix, predict() arguments)
    ("gpt2-large_training_h100_", dict(model="gpt2-large", device="h100-sxm5-80gb", batch_size=4, seq_len=1024,
                                       mode="training", optimizer="adamw")),
    ("resnet50_training_a100_", dict(model="resnet50", device="a100-sxm4-40gb", batch_size=64, mode="training",
                                     optimizer="sgd")),
]


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    quiet_third_party_logs()
    for prefix, kwargs in EXAMPLES:
        p = neusight.predict(**kwargs)
        files = p.plot(OUT, prefix=prefix, formats=("png", "svg"))
        print(f"{prefix}: {p.latency_ms:.1f} ms -> {len(files)} files")


if __name__ == "__main__":
    main()
