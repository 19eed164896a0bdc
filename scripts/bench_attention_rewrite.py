"""Which attention chains does torch.compile hand to scaled_dot_product_attention? Inductor itself against the
fusion model's rule (neusight.graph.fusion._attention_rewrites). Writes docs/attention-rewrite.md.

    python scripts/bench_attention_rewrite.py                  # about 10 min on 2 cores (needs a C++ compiler)
    python scripts/bench_attention_rewrite.py --out /tmp/rewrite.md --types bert gpt2 --dtypes bfloat16

For each transformers model type, a one-layer model of its config class with small widths is built with eager
attention, in FP32 and in BF16, and compiled with torch.compile (Inductor) on the CPU: once in eval mode for a
forward pass without gradients, once in train mode (its config's dropout rates) for a forward and backward pass,
on batch 2 x 32 tokens. Inductor's counter ``fuse_attention`` says how many attention chains its pattern rewrite
replaced (a training step's rewrite counts twice). The same config is traced by neusight (inference and a training
step, same shapes and dtype) and the fused kernel table counts the chains the model rewrites. Inductor's patterns
do not depend on the device, so the CPU compile stands for the GPU's. Nothing here is a latency; it checks one rule
of the fusion model against the compiler it models.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "attention-rewrite.md"
TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "albert", "electra", "mpnet", "deberta", "vit",
         "deit", "gpt2", "gpt_neox", "gptj", "bloom", "falcon", "opt", "llama", "mistral", "qwen2", "gemma", "phi",
         "bart", "mbart", "pegasus", "marian", "t5", "switch_transformers")
BATCH, SEQ = 2, 32
WIDTHS = {  # small widths, one layer; every name a config class may use for them
    "layers": (1, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                   "num_decoder_layers")),
    "hidden": (64, ("hidden_size", "n_embd", "d_model", "dim", "embedding_size", "word_embed_proj_dim")),
    "heads": (4, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                  "decoder_attention_heads", "num_key_value_heads")),
    "ffn": (128, ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim")),
    "vocab": (128, ("vocab_size",)),
    "head_dim": (16, ("head_dim", "d_kv")),
}


def small_config(model_type: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    for value, names in WIDTHS.values():
        for name in names:
            if hasattr(cfg, name):
                try:
                    setattr(cfg, name, value)
                except AttributeError:      # a read-only property (derived from the fields set here)
                    pass
    if getattr(cfg, "rotary_dim", None):
        cfg.rotary_dim = WIDTHS["head_dim"][0]
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:WIDTHS["layers"][0]]
    vocab = WIDTHS["vocab"][0]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) >= vocab:
            setattr(cfg, name, vocab - 1)
    return cfg


def _is_image(cfg) -> bool:
    return hasattr(cfg, "image_size") and not hasattr(cfg, "vocab_size")


def inductor_rewrites(cfg, mode: str, dtype: str = "float32") -> int:
    """Chains Inductor's fuse_attention pass rewrote in one compiled forward of ``cfg``'s base model: in eval
    mode without gradients, or in train mode with a backward pass (whose rewrite of a chain counts twice)."""
    from torch._dynamo.utils import counters
    from transformers import AutoModel

    # no cached graph: a cache hit skips the pattern passes, and their counter with them
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    counters.clear()
    torch._dynamo.reset()
    training = mode == "training"
    model = AutoModel.from_config(cfg, attn_implementation="eager", dtype=getattr(torch, dtype)).train(training)
    if _is_image(cfg):
        inputs = {"pixel_values": torch.randn(BATCH, 3, cfg.image_size, cfg.image_size, dtype=getattr(torch, dtype))}
    else:
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
        inputs = {"input_ids": ids, **({"decoder_input_ids": ids} if cfg.is_encoder_decoder else {})}
    with torch.set_grad_enabled(training):
        out = torch.compile(model)(**inputs)
        if training:
            out[0].float().mean().backward()
    return int(counters["inductor"].get("fuse_attention", 0)) // (2 if training else 1)


def model_rewrites(cfg, mode: str, dtype: str = "float32") -> tuple[int, int]:
    """(chains the fusion model rewrites, softmax kernels = attention chains) in neusight's trace of ``cfg``."""
    import neusight
    from neusight.graph.fusion import fused_kernels

    kw = {"image_size": cfg.image_size} if _is_image(cfg) else {"seq_len": SEQ}
    if cfg.is_encoder_decoder:
        kw["head"] = "seq2seq"
    g = neusight.trace(cfg.to_dict(), batch_size=BATCH, mode=mode, attn_implementation="eager", dtype=dtype, **kw)
    fused = fused_kernels(g)
    forward = g.kernels["phase"] == "forward"
    return int((fused["kernel"] == "attention").sum()), int(((g.kernels["family"] == "softmax") & forward).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    quiet_third_party_logs()
    warnings.filterwarnings("ignore")
    import transformers

    t0 = time.time()
    rows = []
    for mt in args.types:
        for dtype, mode in ((dtype, mode) for dtype in args.dtypes for mode in ("inference", "training")):
            row = {"model_type": mt, "dtype": dtype, "mode": mode}
            try:
                cfg = small_config(mt)
                row["inductor rewrites"] = inductor_rewrites(cfg, mode, dtype)
                row["model rewrites"], row["softmax kernels"] = model_rewrites(cfg, mode, dtype)
                row["agree"] = "yes" if row["inductor rewrites"] == row["model rewrites"] else "no"
            except Exception as e:  # noqa: BLE001 - a failure is a row of the table, not the end of the run
                row["agree"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(row, flush=True)
    df = pd.DataFrame(rows, columns=["model_type", "dtype", "mode", "inductor rewrites", "model rewrites",
                                     "softmax kernels", "agree"])
    agree, disagree = int((df["agree"] == "yes").sum()), int((df["agree"] == "no").sum())
    failed = len(df) - agree - disagree
    text = "\n".join([
        "# Inductor's attention rewrite against the fusion model's rule", "",
        f"Generated by `python scripts/bench_attention_rewrite.py` in {time.time() - t0:.0f} s with torch "
        f"{torch.__version__} and transformers {transformers.__version__} (its docstring says how); regenerate it, "
        "do not edit it.", "",
        "One-layer models with small widths, eager attention, FP32 and BF16, batch 2 x 32 tokens, the config's own "
        "dropout rates; "
        "inference: eval mode, no gradients; training: train mode, forward and backward. `inductor rewrites`: "
        "attention chains torch.compile's fuse_attention pass replaced by scaled_dot_product_attention (compiled on "
        "the CPU; a training step's rewrite counts twice in its counter, halved here); `model rewrites`: chains "
        "neusight's fusion model replaces by a fused attention kernel (neusight/graph/fusion.py; in training with "
        "its backward kernel); `softmax kernels`: attention chains in the trace's forward.", "",
        f"The rule agrees with Inductor on {agree} of {len(df)} model types x dtypes x modes and disagrees on "
        f"{disagree}; {failed} could not be compiled on the CPU or traced (the `agree` column says why).", "",
        markdown_table(df, index=False), "",
    ])
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
