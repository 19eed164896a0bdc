"""FP8 training and weight-only quantized decoding as public benchmarks timed them, against the forecast with
``fp8=True`` / ``weight_quant=``. Writes docs/low-precision.md.

    python scripts/bench_lowprecision_public.py                  # about 1 min on 2 cores
    python scripts/bench_lowprecision_public.py --out /tmp/low-precision.md

No FP8 or quantized kernel is in the dataset, so these few published numbers are the only check of those
forecasts. Each number is copied from its source (named in the table), timed by others on machines and software
we do not control: read them as a range, not as truth. Nothing here is fitted to them. The runs are not the
forecast's runs either: torchao's decode benchmark runs its own gpt-fast Llama, compiled with CUDA graphs (the
forecast: the Hugging Face model with ``fused=True``, SDPA attention, a static KV cache written in place as
gpt-fast's is, GPU time only); torchtitan's training runs
on 8 H100s with FSDP2 and selective activation checkpointing (the forecast: one GPU's step without either). So
the comparable numbers are the speed-ups over each source's own BF16 run, and the absolute ones are shown for
what they are.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
TORCHAO_QUANT = ("github.com/pytorch/ao@03d01adcbc:torchao/quantization/README.md, 'Benchmarks' (single A100, "
                 "batch 1, its _models/llama generate.py)")
TORCHAO_FLOAT8 = ("github.com/pytorch/ao:torchao/float8/README.md, 'Performance' (8 x H100, batch 1, seq 8192, "
                  "torch.compile, FSDP2, per-op SAC; median tokens / s)")


@dataclass(frozen=True)
class Decode:
    model: str
    technique: str            # "bf16", "int8", "int4"
    tokens_per_s: float


@dataclass(frozen=True)
class Train:
    model: str
    technique: str            # "bf16", "fp8"
    tokens_per_s: float


# torchao's table names the GPU "A100" (later versions of the README: "NVIDIA-A100-80GB", without the form factor);
# forecast on the SXM4 80 GB part (the PCIe one has 5 % less bandwidth). Its int4 rows use groups of 64 inputs (the
# forecast: 128).
DECODE_GPU = "a100-sxm4-80gb"
DECODES = (
    Decode("llama-2-7b", "bf16", 107.38), Decode("llama-2-7b", "int8", 170.83), Decode("llama-2-7b", "int4", 201.14),
    Decode("llama-3-8b", "bf16", 95.64), Decode("llama-3-8b", "int8", 153.03), Decode("llama-3-8b", "int4", 180.80),
)
TRAIN_GPU = "h100-sxm5-80gb"
TRAINS = (Train("llama-3-8b", "bf16", 6150.0), Train("llama-3-8b", "fp8", 7689.5))   # fp8: tensorwise, float8 all-gather


def forecast() -> tuple[pd.DataFrame, pd.DataFrame]:
    from neusight.api import predict

    rows = []
    for d in DECODES:
        # a decode step in the middle of torchao's generation (a short prompt, up to 200 new tokens)
        p = predict(d.model, DECODE_GPU, batch_size=1, seq_len=1, kv_cache=127, dtype="bfloat16",
                    attn_implementation="sdpa", fused=True, memory=False, static_cache=True,
                    weight_quant=None if d.technique == "bf16" else d.technique)
        rows.append({"model": d.model, "weights": d.technique, "measured tokens/s": d.tokens_per_s,
                     "forecast tokens/s": 1e3 / p.latency_ms})
    dec = pd.DataFrame(rows)
    for col in ("measured", "forecast"):
        base = dec.groupby("model")[f"{col} tokens/s"].transform("first")
        dec[f"{col} speed-up"] = dec[f"{col} tokens/s"] / base
    dec["speed-up error %"] = (dec["forecast speed-up"] / dec["measured speed-up"] - 1) * 100
    rows = []
    for t in TRAINS:
        p = predict(t.model, TRAIN_GPU, batch_size=1, seq_len=8192, mode="training", dtype="bfloat16",
                    attn_implementation="sdpa", fused=True, memory=False, fp8=t.technique == "fp8")
        rows.append({"model": t.model, "linear layers": t.technique, "measured tokens/s per GPU": t.tokens_per_s,
                     "forecast tokens/s (one GPU)": 8192 / p.latency_ms * 1e3})
    tr = pd.DataFrame(rows)
    for col, name in (("measured tokens/s per GPU", "measured"), ("forecast tokens/s (one GPU)", "forecast")):
        tr[f"{name} speed-up"] = tr[col] / tr[col].iloc[0]
    tr["speed-up error %"] = (tr["forecast speed-up"] / tr["measured speed-up"] - 1) * 100
    return dec, tr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "low-precision.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    dec, tr = forecast()
    def two(t: pd.DataFrame) -> pd.DataFrame:   # speed-ups with two decimals
        return t.assign(**{c: t[c].map("{:,.2f}".format) for c in t.columns if c.endswith(" speed-up")})

    text = "\n".join([
        "# FP8 training and quantized decoding against public benchmarks", "",
        f"Generated by `python scripts/bench_lowprecision_public.py` in {time.time() - t0:.0f} s; regenerate it, do "
        "not edit it. The script's docstring says what is compared and why only the speed-ups are comparable. "
        "Nothing is fitted to these numbers.", "",
        f"## Weight-only int8 / int4 decoding, batch 1, on {DECODE_GPU}", "",
        f"Source: {TORCHAO_QUANT}. Forecast: one decode step at context 128 (`weight_quant=int8|int4`, "
        "`fused=true`, SDPA attention, `static_cache=true`); tokens/s = 1 / step time. Speed-ups are over each "
        "side's BF16 row.", "",
        markdown_table(two(dec), index=False), "",
        f"## FP8 training (torchao Float8Linear, tensorwise), on {TRAIN_GPU}", "",
        f"Source: {TORCHAO_FLOAT8}. Forecast: one GPU's training step of batch 1 x 8,192 tokens (`fp8=true`, "
        "`fused=true`, SDPA attention, AdamW), without FSDP's collectives and without activation checkpointing, "
        "which the measured runs have: their absolute tokens/s are lower for that; the speed-up is the comparable "
        "number.", "",
        markdown_table(two(tr), index=False), ""])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
