"""Which of the installed transformers' text model types trace? Writes docs/hf-coverage.md.

    python scripts/bench_hf_coverage.py                 # ~15 min on 2 cores
    python scripts/bench_hf_coverage.py --out /tmp/cov.md --types llama bert

Every model type with a causal-LM, masked-LM or seq2seq-LM class in the installed transformers, and every
multimodal one with an image-text-to-text class (forecast through its language model), is built from its
config class's defaults with its layer counts set to 2 and traced for one training step (batch 2, sequence
128, forward, loss, backward, AdamW). A type that fails at 2 layers in a way a layer count can cause is tried
again at 8, then at its config's own layer count: hybrid models place their attention layers by index
(Qwen3-Next every 4th, Jamba from the 5th, Bamba's list of indices), and two layers can hold none. A causal LM
or multimodal type that traces is also traced for one generation step with a KV cache at the same layer count
(column ``decode step``), and a type with an image encoder (a ``vision_config``) that traces is traced for one
inference pass with one image per sequence (``images=1``: its image encoder on fixed-size pixel values, the image
tokens among the positions; column ``images``, with the tokens an image fills). Each failure is put in one class by
its message:

- ``config``: the config class's own defaults do not build a model (a field left None, a check of
  transformers' that its defaults fail); a user's real config.json sets those fields.
- ``not text``: the model takes no token ids (audio, multimodal without a language model in its text_config).
- ``data-dependent``: the model reads a value of its input back to the host (a count, a size, expert routing
  by ``nonzero`` / ``tolist``), which a trace of shapes cannot follow.
- ``timeout``: no trace within the time limit (a big default config on the torch reference path).
- ``other``: anything else (the message says what).

Nothing here is a forecast's accuracy; it checks what a user's config can be traced from.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import neusight  # noqa: E402
from neusight.cli.common import quiet_third_party_logs  # noqa: E402
from neusight.e2e_eval import markdown_table  # noqa: E402
from neusight.util import atomic_write_text  # noqa: E402

OUT = REPO / "docs" / "hf-coverage.md"
BATCH, SEQ = 2, 128
LAYERS = (2, 8, None)   # None: the config's own layer count
# failures a layer count can cause: no attention layer among the first few, per-layer lists of another length
LAYER_COUNT_FAILURE = (r"only contain LinearAttention|Validation|does not support the setting|index out of range|"
                       r"layer indices|set of layer types")
TIMEOUT_S = 120
DECODERS = ("causal LM", "multimodal")   # kinds whose generation step (kv_cache=) is tried too
DECODE_CACHE = 127
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers")
CLASSES = (
    ("config", r"could not build|is not a transformers config type|Validation|does not support the setting|"
               r"has no attribute|NoneType|must be int|KeyError|expects split_sizes|only contain LinearAttention"),
    ("not text", r"no token vocabulary|rather than token ids|exactly one of input_ids|no model class"),
    ("data-dependent", r"read back|nonzero|data-dependent|Cannot copy out of meta"),
    ("timeout", r"no trace within"),
)


class _Timeout(BaseException):   # not an Exception: the tracer turns those into TraceErrors
    pass


_TIMED_OUT = [False]


def _alarm(*_: Any) -> None:
    _TIMED_OUT[0] = True   # whatever the interrupted code turns the exception into, the row says "timeout"
    raise _Timeout()


@contextlib.contextmanager
def _time_limit() -> Iterator[None]:
    """At most TIMEOUT_S seconds for the block: then _Timeout, and _TIMED_OUT set (whatever the interrupted code
    turns the exception into)."""
    signal.signal(signal.SIGALRM, _alarm)
    _TIMED_OUT[0] = False
    signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)


def model_types() -> dict[str, str]:
    """model_type -> the kind of class that makes it a text model here."""
    from transformers.models.auto import modeling_auto as ma

    kinds: dict[str, str] = {}
    for attr, kind in (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal LM"), ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                       "masked LM"), ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq LM"),
                       ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "multimodal")):
        for t in getattr(ma, attr, {}):
            kinds.setdefault(t, kind)
    return dict(sorted(kinds.items()))


def _config(model_type: str, layers: int | None) -> Any:
    """The config class's defaults with every layer count set to ``layers`` (None: as they are). Per-layer lists
    of the default length (``layer_types``, ...) are left out, so the config makes them for the new count."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    if layers is None:
        return defaults

    def shrunk(cfg: Any) -> dict[str, Any] | None:
        counts = {k: getattr(cfg, k) for k in LAYER_FIELDS if isinstance(getattr(cfg, k, None), int)}
        if not counts:
            return None
        d = {k: v for k, v in cfg.to_dict().items()
             if not (isinstance(v, list) and len(v) in counts.values() and len(v) > layers)}
        return {**d, **{k: layers for k in counts}}

    top = shrunk(defaults)
    if top is not None:
        return AutoConfig.for_model(model_type, **{k: v for k, v in top.items() if k != "model_type"})
    text = getattr(defaults, "text_config", None)
    sub = shrunk(text) if text is not None else None
    return defaults if sub is None else AutoConfig.for_model(model_type, text_config=sub)


def classify(message: str) -> str:
    for name, pattern in CLASSES:
        if re.search(pattern, message):
            return name
    return "other"


def decode_step(model_type: str, layers: int | None) -> str:
    """Whether one generation step with a KV cache traces (batch 2, one new token after DECODE_CACHE cached ones)
    at the layer count the training step traced at: "yes", "refused" (an InputError: the model is no decoder-only
    causal LM with a cache, said in one line) or "no: <the failure>"."""
    from neusight.errors import InputError

    try:
        with _time_limit():
            neusight.trace(_config(model_type, layers), batch_size=BATCH, seq_len=1, kv_cache=DECODE_CACHE)
    except _Timeout:
        return f"no: no trace within {TIMEOUT_S} s"
    except InputError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return (f"no: no trace within {TIMEOUT_S} s" if _TIMED_OUT[0] else
                f"no: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
    return "yes"


def _has_vision(model_type: str) -> bool:
    """Whether the type's config defaults have an image encoder's config (``vision_config``)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.for_model(model_type), "vision_config", None) is not None


def image_step(model_type: str, layers: int | None) -> str:
    """Whether an inference pass with one image per sequence traces (batch 2, 512 text tokens after the image's),
    at the layer count the training step traced at (the image encoder at its config's own): "yes: <n> tokens" or
    "no: <the failure>" (for the encoders images= refuses, transformers' reason)."""
    try:
        with _time_limit():
            g = neusight.trace(_config(model_type, layers), batch_size=BATCH, images=1)
    except _Timeout:
        return f"no: no trace within {TIMEOUT_S} s"
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        if _TIMED_OUT[0]:
            return f"no: no trace within {TIMEOUT_S} s"
        why = re.search(r"alone \((.*)\); images= covers", str(e))
        return f"no: {(why[1] if why else type(e).__name__ + ': ' + str(e).splitlines()[0])[:80]}"
    return f"yes: {g.seq_len - 512} tokens"


def try_one(model_type: str, kind: str = "") -> dict:
    row: dict[str, Any] = {"model_type": model_type}
    message = ""
    for layers in LAYERS:
        if message and not re.search(LAYER_COUNT_FAILURE, message):
            break   # the layer count is not what failed: another count fails the same way
        t = time.perf_counter()
        try:
            with _time_limit():
                g = neusight.trace(_config(model_type, layers), batch_size=BATCH, seq_len=SEQ, mode="training",
                                   optimizer="adamw")
        except _Timeout:
            message = f"no trace within {TIMEOUT_S} s"
            continue
        except Exception as e:  # noqa: BLE001 - a row per model type, the failure is the finding
            message = (f"no trace within {TIMEOUT_S} s" if _TIMED_OUT[0] else
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        seconds = time.perf_counter() - t
        return {**row, "traces": "yes", "layers": layers or "default", "kernels": len(g.kernels),
                "unmodeled": " ".join(sorted({op.removeprefix("aten.").split(".")[0] for op in g.unmodeled})),
                "decode step": decode_step(model_type, layers) if kind in DECODERS else "",
                "images": image_step(model_type, layers) if _has_vision(model_type) else "",
                "trace s": seconds, "class": "", "first note / failure": g.notes[0][:110]}
    return {**row, "traces": "no", "class": classify(message), "first note / failure": message[:160]}


def render(df: pd.DataFrame, seconds: float, version: str) -> str:
    ok = df[df["traces"] == "yes"]
    lines = ["# Hugging Face coverage: which transformers text model types trace", "",
             f"Generated by `python scripts/bench_hf_coverage.py` in {seconds:.0f} s with transformers {version} "
             "(its docstring says how); regenerate it, do not edit it.", "",
             f"{len(ok)} of {len(df)} model types trace a training step (batch {BATCH}, sequence {SEQ}) from their "
             "config class's defaults at 2 or 8 layers, or at the config's own layer count.", ""]
    counts = df.groupby(["kind", "traces"]).size().unstack(fill_value=0).reset_index()
    lines += [markdown_table(counts, index=False), ""]
    gaps = ok["unmodeled"].fillna("").str.split()
    ops = pd.Series([op for row in gaps for op in row], dtype=object).value_counts()
    whole = f"{int((gaps.str.len() == 0).sum())} of the {len(ok)} that trace have a kernel model for every aten op " \
            "they run"
    if len(ops):
        whole += ("; the others run ops with none, each charged as one memory-bound kernel reading its inputs and "
                  "writing its outputs at zero FLOPs (`Graph.unmodeled`, column `unmodeled`): "
                  + ", ".join(f"`{op}` ({n})" for op, n in ops.items()) + " (model types running each)")
    lines += [whole + ".", ""]
    steps = ok[ok["kind"].isin(DECODERS)]["decode step"].fillna("")
    lines += [f"A generation step with a KV cache (batch {BATCH}, one new token after {DECODE_CACHE} cached ones, "
              f"at the same layer count; causal LMs and multimodal models): {int((steps == 'yes').sum())} of the "
              f"{len(steps)} of those kinds that trace trace it, {int((steps == 'refused').sum())} are refused with "
              "one line (no decoder-only causal LM with a cache: encoder-decoders, models without cache support), "
              f"{int(steps.str.startswith('no').sum())} fail (column `decode step`).", ""]
    pictures = ok["images"].fillna("")
    pictures = pictures[pictures != ""]
    lines += [f"An inference pass with one image per sequence (`images=1`, batch {BATCH}, 512 text tokens after the "
              f"image's): {int(pictures.str.startswith('yes').sum())} of the {len(pictures)} types with an image "
              "encoder (a `vision_config`) that trace trace it; the others' image encoders take more than fixed-size "
              "pixel values (image sizes, patch grids, tiles, a second prompt) or fail as the column says (column "
              "`images`).", ""]
    failed = df[df["traces"] == "no"]
    if len(failed):
        by = failed.groupby("class")["model_type"].apply(lambda s: ", ".join(s)).reset_index()
        by.columns = ["failure class (docstring)", "model types"]
        lines += ["Failures by class:", "", markdown_table(by, index=False), ""]
    shown = df.copy()
    shown["trace s"] = shown["trace s"].map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
    for col in ("layers", "kernels"):   # counts, or "default" layers
        shown[col] = shown[col].map(lambda v: "" if pd.isna(v) else v if isinstance(v, str) else f"{int(v)}")
    lines += [markdown_table(shown.fillna(""), index=False), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--types", nargs="*", help="only these model types")
    args = ap.parse_args()
    quiet_third_party_logs()
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    kinds = model_types()
    if args.types:
        kinds = {t: kinds.get(t, "?") for t in args.types}
    t0 = time.perf_counter()
    rows = []
    for i, (t, kind) in enumerate(kinds.items()):
        rows.append({"kind": kind, **try_one(t, kind)})
        print(f"[{i + 1}/{len(kinds)}] {t}: {rows[-1]['traces']} {rows[-1].get('class', '')}", flush=True)
    cols = ["model_type", "kind", "traces", "layers", "kernels", "unmodeled", "decode step", "images", "trace s",
            "class", "first note / failure"]
    df = pd.DataFrame(rows).reindex(columns=cols)
    text = render(df, time.perf_counter() - t0, transformers.__version__)
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
