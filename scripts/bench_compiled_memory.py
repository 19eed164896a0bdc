"""Memory of a training step under torch.compile: the forecast (``estimate_memory(..., fused=True)``) against a real
compiled run on this CPU. Writes docs/memory-compiled.md.

    python scripts/bench_compiled_memory.py            # 10-15 min on 2 cores, needs a C++ compiler (Inductor's CPU code)
    python scripts/bench_compiled_memory.py --out /tmp/memory-compiled.md

Each row is a two-layer model of a Hugging Face architecture at width 768 (batch 2, sequence 512, one AdamW step),
in FP32 and in BF16 (the model's dtype, no autocast), run four ways: eager and compiled on the CPU
(``neusight.memory.measure_cpu``, the peak of allocated tensor bytes from the profiler), and forecast eager and fused
(``allocator="exact"``: requested bytes, as the CPU reports them). Figures are the peak above what is resident
before the step (weights, optimizer state, inputs).

What the CPU can and cannot check: Inductor's fusion and its partitioner's choice of what to save for the backward
(the min-cut rematerialization) are the same code on the CPU as on a GPU, so ``neusight.remat``'s emulation of
that min-cut is checked here, with what the compiled backward allocates on its own (a zero gradient per returned
KV-cache tensor, the tied embedding's gradient GEMM run inside its sum, pointwise kernels written in place; the
sum's rewrite is skipped on a GPU where it feeds only pointwise ops, which no row here has). A rewritten attention
chain is not checked: on the CPU,
scaled_dot_product_attention with dropout runs its math backend, which keeps the scores, while a GPU's fused
kernels recompute them (the BERT row shows the CPU's number next to the forecast for the GPU, and is left out of
the error). Nothing is fitted to these numbers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neusight.util import atomic_write_text  # noqa: E402

MiB = 2**20
RUN = dict(batch_size=2, seq_len=512, mode="training")
DTYPES = {"FP32": {}, "BF16": {"dtype": "bfloat16"}}
# (label, config, whether the CPU's compiled run stands for a GPU's)
MODELS = [
    ("GPT-2 (gelu_new)", {"model_type": "gpt2", "n_layer": 2, "n_embd": 768, "n_head": 12, "vocab_size": 2000}, True),
    ("GPT-2 (gelu_pytorch_tanh)", {"model_type": "gpt2", "n_layer": 2, "n_embd": 768, "n_head": 12,
                                   "vocab_size": 2000, "activation_function": "gelu_pytorch_tanh"}, True),
    ("Llama (grouped-query, SwiGLU, RMSNorm)", {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 768,
                                                "num_attention_heads": 12, "num_key_value_heads": 4,
                                                "intermediate_size": 2048, "vocab_size": 2000}, True),
    ("OPT (ReLU)", {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12,
                    "ffn_dim": 3072, "vocab_size": 2000, "word_embed_proj_dim": 768}, True),
    ("BERT, no attention dropout (not rewritten)", {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 768,
                                                    "num_attention_heads": 12, "intermediate_size": 3072,
                                                    "vocab_size": 2000, "attention_probs_dropout_prob": 0.0}, True),
    ("BERT (attention rewritten: CPU math backend vs GPU fused kernel)",
     {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12,
      "intermediate_size": 3072, "vocab_size": 2000}, False),
]


def measure() -> list[dict]:
    import torch
    import torch._functorch.config as functorch_config

    import neusight
    from neusight.memory import estimate_memory, measure_cpu

    torch._inductor.config.fx_graph_cache = False      # compile every time: nothing from an earlier process
    functorch_config.enable_autograd_cache = False
    rows = []
    for (label, cfg, comparable), (dtype, kw) in ((m, d) for m in MODELS for d in DTYPES.items()):
        t = time.time()
        eager = measure_cpu(cfg, **RUN, **kw)
        compiled = measure_cpu(cfg, compiled=True, **RUN, **kw)
        g = neusight.trace(cfg, optimizer="adamw", **RUN, **kw)
        base = eager.resident_bytes
        rows.append({"model": label, "dtype": dtype, "comparable": comparable, "resident": base / MiB,
                     "eager measured": (eager.peak_bytes - base) / MiB,
                     "eager forecast": (estimate_memory(g, allocator="exact").peak_bytes - base) / MiB,
                     "compiled measured": (compiled.peak_bytes - base) / MiB,
                     "fused forecast": (estimate_memory(g, allocator="exact", fused=True).peak_bytes - base) / MiB,
                     "s": time.time() - t})
        print(f"{label} {dtype}: {rows[-1]}", flush=True)
    return rows


def render(rows: list[dict], seconds: float) -> str:
    import torch
    import transformers

    def err(a: float, b: float) -> str:
        return f"{100 * (a - b) / b:+.1f}"

    lines = ["# Memory of a compiled training step: forecast vs a compiled run on the CPU", "",
             f"Generated by `python scripts/bench_compiled_memory.py` in {seconds:.0f} s (torch {torch.__version__}, "
             f"transformers {transformers.__version__}); its docstring says how and what the CPU cannot check. "
             "Regenerate it, do not edit it.", "",
             "MiB above the resident weights, optimizer state and inputs, two layers at width 768, batch 2 x 512, "
             "one AdamW step; BF16 is the model's dtype (no autocast). `eager forecast` is `estimate_memory(g)`, "
             "`fused forecast` `estimate_memory(g, fused=True)` (what `predict(..., fused=True)` reports); errors "
             "are against the compiled run.", "",
             "| model | dtype | eager measured | eager forecast | compiled measured | fused forecast | fused err % | "
             "eager forecast err % vs compiled |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mark = "" if r["comparable"] else " †"
        lines.append(f"| {r['model']}{mark} | {r['dtype']} | {r['eager measured']:.1f} | {r['eager forecast']:.1f} | "
                     f"{r['compiled measured']:.1f} | {r['fused forecast']:.1f} | "
                     f"{err(r['fused forecast'], r['compiled measured'])} | "
                     f"{err(r['eager forecast'], r['compiled measured'])} |")
    ok = [r for r in rows if r["comparable"]]

    def mean_abs(key: str, rows: list[dict]) -> float:
        return sum(abs(r[key] - r["compiled measured"]) / r["compiled measured"] for r in rows) / len(rows) * 100

    def means(key: str) -> str:
        each = ", ".join(f"{d} {mean_abs(key, [r for r in ok if r['dtype'] == d]):.1f} %" for d in DTYPES)
        return f"{mean_abs(key, ok):.1f} % ({each})"

    lines += ["", f"Mean absolute error over the {len(ok)} comparable rows: fused forecast {means('fused forecast')}, "
              f"the eager forecast taken for the compiled run {means('eager forecast')}.", "",
              "† Not comparable: on the CPU, scaled_dot_product_attention with dropout runs its math backend (scores, "
              "softmax and dropout mask kept for the backward); on a GPU the rewritten chain is one fused kernel "
              "that recomputes them, which the fused forecast models. Left out of the mean.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "memory-compiled.md")
    args = ap.parse_args()
    from neusight.cli.common import quiet_third_party_logs

    quiet_third_party_logs()
    t = time.time()
    rows = measure()
    atomic_write_text(args.out, render(rows, time.time() - t))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
