"""Fused attention kernels (flash / cuDNN) as FlashAttention-3's paper timed them on an H100, against the forecast
of a traced ``F.scaled_dot_product_attention``. Writes docs/attention-public.md.

    python scripts/bench_attention_public.py                 # about 10 s on 2 cores
    python scripts/bench_attention_public.py --out /tmp/attention-public.md

No fused attention kernel is in the dataset: the forecast takes the batched-GEMM model's utilization for their
GEMMs (tiled as flash kernels are, the backward's query-gradient partial sums in its traffic:
neusight.predictor.features) and adds the softmax's exponentials and FP32 work at their spec rates
(neusight.tiles.softmax_seconds_per_score). These published speeds are the only check of that. Source: Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, "FlashAttention-3" (arXiv 2407.08608, 2024),
the forward and backward speed figures on an H100 80GB SXM5 in FP16: every batch holds 16k tokens (batch = 16,384
/ sequence), the hidden size is 2,048 (32 heads of 64 or 16 of 128), FLOPs counted as ours are (forward 4 x seq^2
x head dim x heads per sequence, halved when causal; backward 2.5x). The numbers were read off the figures' bar
labels (via text extractions of the figures), so read them to a few TFLOP/s. The backward figures are without the
causal mask only. The head dim 256 figure is left out: its extraction does not say which mask it is.

The comparison is against cuDNN's kernels, the ones PyTorch's SDPA runs on Hopper once its bundled cuDNN is 9.15
or newer (PyTorch 2.11 on; pytorch/pytorch#138522 made it opt-in before); FlashAttention-2 (SDPA's flash kernel
on Ampere, and on Hopper before that) and FlashAttention-3 are shown beside it. The forecast runs through
``neusight.predict`` like any model (a training step of a module that is one SDPA call), kernel times as in a
model. Nothing here is fitted to these numbers, but the model's form was chosen while they were at hand (the
rates and instruction counts are hardware and algorithm facts, not tuned). Before it (a fused attention as its
score GEMM with the reduction stretched to all of its FLOPs, no softmax time, no partial sums) the same points
were 28.8 % off on average (forward 30.3 %, backward 25.8 %; long forward sequences +20 %, long backward +40 %).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
GPU = "h100-sxm5-80gb"
SOURCE = ("Shah et al., FlashAttention-3, arXiv 2407.08608 (2024): attention forward / backward speed figures, "
          "H100 80GB SXM5, FP16")
TOKENS, HIDDEN = 16384, 2048
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# (pass, head dim, causal) -> TFLOP/s per sequence length of SEQS, for (FlashAttention-2, cuDNN, FlashAttention-3)
PUBLISHED = {
    ("forward", 64, False): ((282, 306, 318, 321, 322, 324), (335, 373, 395, 408, 412, 413),
                             (333, 392, 460, 476, 496, 497)),
    ("forward", 64, True): ((180, 229, 262, 284, 295, 299), (225, 288, 334, 363, 379, 388),
                            (197, 265, 371, 420, 460, 473)),
    ("forward", 128, False): ((309, 350, 362, 368, 370, 370), (497, 574, 617, 609, 600, 595),
                              (467, 565, 625, 638, 646, 648)),
    ("forward", 128, True): ((191, 260, 298, 319, 333, 335), (315, 410, 484, 518, 529, 539),
                             (292, 423, 521, 579, 602, 616)),
    ("backward", 64, False): ((198, 238, 264, 279, 287, 291), (266, 348, 395, 417, 432, 433),
                              (272, 363, 422, 453, 472, 474)),
    ("backward", 128, False): ((214, 260, 291, 310, 318, 322), (305, 408, 465, 499, 518, 516),
                               (316, 424, 501, 542, 559, 561)),
}


def attention_module(heads: int, causal: bool):
    """A module that is one SDPA call over its input's heads (q = k = v), with a weight so that it trains."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, hidden = x.shape
            q = (x * self.scale).view(b, s, heads, hidden // heads).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, q, q, is_causal=causal)
            return out.transpose(1, 2).reshape(b, s, hidden)

    return Attention()


def forecast() -> pd.DataFrame:
    from neusight.api import predict
    from neusight.kernels.base import ATTENTION_BWD_KERNEL, ATTENTION_KERNEL

    rows = []
    for head in (64, 128):
        for causal in (False, True):
            for i, seq in enumerate(SEQS):
                p = predict(attention_module(HIDDEN // head, causal), GPU, batch_size=TOKENS // seq,
                            mode="training", optimizer=None, dtype="float16", memory=False,
                            input_shapes=[(seq, HIDDEN)])
                k = p.kernels
                for pass_, name in (("forward", ATTENTION_KERNEL), ("backward", ATTENTION_BWD_KERNEL)):
                    pub = PUBLISHED.get((pass_, head, causal))
                    if pub is None:
                        continue
                    kern = k[k["kernel"] == name]
                    tflops = kern["flops"].sum() / kern["latency_ms"].sum() / 1e9
                    rows.append({"pass": pass_, "head dim": head, "causal": "yes" if causal else "no", "seq": seq,
                                 "batch": TOKENS // seq, "FlashAttention-2": pub[0][i], "cuDNN": pub[1][i],
                                 "FlashAttention-3": pub[2][i], "forecast": tflops,
                                 "error % (vs cuDNN)": (tflops / pub[1][i] - 1) * 100,
                                 "forecast utilization %": 100 * float(kern["utilization"].iloc[0])})
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    err = "error % (vs cuDNN)"
    g = df.groupby(["pass", "head dim", "causal"], sort=False)
    out = g.agg(points=(err, "size"), mean_signed=(err, "mean"), mean_abs=(err, lambda s: s.abs().mean()))
    long = df[df["seq"] >= 4096].groupby(["pass", "head dim", "causal"], sort=False)[err].mean()
    out["seq >= 4k mean signed"] = long
    return out.rename(columns={"mean_signed": "mean signed error %", "mean_abs": "mean abs error %"}).reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "attention-public.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    df = forecast()
    err = df["error % (vs cuDNN)"]
    fwd, bwd = df[df["pass"] == "forward"], df[df["pass"] == "backward"]
    text = "\n".join([
        "# Fused attention kernels against published speeds (H100)", "",
        f"Generated by `python scripts/bench_attention_public.py` in {time.time() - t0:.0f} s; regenerate it, do not "
        "edit it. The script's docstring says where the numbers come from and what the forecast does. Nothing is "
        "fitted to them.", "",
        f"Source: {SOURCE}. Forecast: `neusight.predict` of a training step of one `scaled_dot_product_attention` "
        f"call on {GPU}, FP16, batch x sequence = {TOKENS:,} tokens, hidden {HIDDEN:,}; TFLOP/s of its forward and "
        "backward attention kernels as timed in a model. Positive error: the forecast is faster than cuDNN.", "",
        f"- All {len(df)} points: mean absolute error {err.abs().mean():.1f} % against cuDNN (signed "
        f"{err.mean():+.1f} %).",
        f"- Forward ({len(fwd)}): mean absolute {fwd['error % (vs cuDNN)'].abs().mean():.1f} %, signed "
        f"{fwd['error % (vs cuDNN)'].mean():+.1f} %; sequences of 4k and longer signed "
        f"{fwd.loc[fwd['seq'] >= 4096, 'error % (vs cuDNN)'].mean():+.1f} %.",
        f"- Backward ({len(bwd)}): mean absolute {bwd['error % (vs cuDNN)'].abs().mean():.1f} %, signed "
        f"{bwd['error % (vs cuDNN)'].mean():+.1f} %; sequences of 4k and longer signed "
        f"{bwd.loc[bwd['seq'] >= 4096, 'error % (vs cuDNN)'].mean():+.1f} %.", "",
        markdown_table(summary(df), index=False, signed=["mean signed error %", "seq >= 4k mean signed"]), "",
        "TFLOP/s per point:", "",
        markdown_table(df, index=False, signed=["error % (vs cuDNN)"]), ""])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
