"""Speed of ranking every GPU of the library (``neusight-predict device=all``): one training step of GPT-2 Large (batch
4, seq 1024) and one ``generate()`` of Llama-3-8B in BF16 (batch 8, prompt 512, 128 new tokens, SDPA, a static KV
cache) forecast on each GPU from shared traces, in Python (``neusight.rank`` / ``predict_generation_many``, warm
process) and as the whole command (fresh process: imports, Hydra, predictors; the step's also with the memory
remedies of the GPUs it does not fit, ``advise=true``); and the command with ``find_max_batch=true`` (GPT-2 at
sequence 128), which searches each GPU's memory in turn, reusing the probes' traces of the GPUs before it on the
same software path.

    python scripts/bench_rank.py              # prints, and rewrites its section of docs/speed.md (about 5 min)
    python scripts/bench_rank.py --no-write
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_trace import DOC, TITLE, machine  # noqa: E402

import neusight  # noqa: E402
from neusight.cli.common import quiet_third_party_logs  # noqa: E402
from neusight.e2e_eval import write_doc_section  # noqa: E402
from neusight.generation import predict_generation_many  # noqa: E402

STEP = dict(model="gpt2-large", batch_size=4, seq_len=1024, mode="training")
GEN = dict(model="llama-3-8b", batch_size=8, prompt_len=512, new_tokens=128, dtype="bfloat16",
           attn_implementation="sdpa", static_cache=True)
STEP_CLI = ["model=gpt2-large", "device=all", "batch_size=4", "seq_len=1024", "mode=training"]
GEN_CLI = ["model=llama-3-8b", "device=all", "batch_size=8", "seq_len=512", "new_tokens=128", "dtype=bfloat16",
           "attn_implementation=sdpa", "static_cache=true"]
SEARCH_CLI = ["model=gpt2", "device=all", "batch_size=1", "seq_len=128", "find_max_batch=true"]   # a search per GPU


def timed(call):  # -> (seconds, result)
    t = time.perf_counter()
    out = call()
    return time.perf_counter() - t, out


def command_wall(args: list[str]) -> float:
    """The whole ``neusight-predict`` command in a fresh process."""
    exe = Path(sys.executable).with_name("neusight-predict")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([str(exe), *args, f"hydra.run.dir={tmp}"], cwd=tmp, check=True, capture_output=True)
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/speed.md alone")
    args = ap.parse_args(argv)
    quiet_third_party_logs()
    load_before = os.getloadavg()
    neusight.predict("gpt2", "t4", seq_len=32, memory=False)   # imports and the predictor load, outside the timing
    step_s, table = timed(lambda: neusight.rank(devices="all", **STEP))
    gen_s, forecasts = timed(lambda: predict_generation_many(devices="all", **GEN))
    step_cli, gen_cli, search_cli = command_wall(STEP_CLI), command_wall(GEN_CLI), command_wall(SEARCH_CLI)
    advised_cli = command_wall(STEP_CLI + ["advise=true"])     # with the memory remedies of the GPUs it misses
    load_after = os.getloadavg()
    fits = int((table["fits"] == "yes").sum())
    gen_fits = sum(bool(f.memory_fits) for f in forecasts)
    body = f"""## Ranking every GPU of the library (`device=all`)

One run forecast on each of the spec library's GPUs from shared traces (`neusight.api.predict_many`: one trace
per software path the GPUs take), memory included; a warm process (imports and predictor loads done) in
Python, and the whole command in a fresh process.

| run | GPUs | fit in memory | Python (s) | `neusight-predict ... device=all` (s) |
| --- | --- | --- | --- | --- |
| `rank("gpt2-large", "all", batch_size=4, seq_len=1024, mode="training")` | {len(table)} | {fits} | {step_s:.1f} | {step_cli:.1f} |
| `predict_generation_many("llama-3-8b", "all", batch_size=8, prompt_len=512, new_tokens=128, dtype="bfloat16", attn_implementation="sdpa", static_cache=True)` | {len(forecasts)} | {gen_fits} | {gen_s:.1f} | {gen_cli:.1f} |

Commands: `neusight-predict {' '.join(STEP_CLI)}` and `neusight-predict {' '.join(GEN_CLI)}`.
With `advise=true` the step's command also forecasts the memory remedies (`neusight.fit_remedies`) on the
{len(table) - fits} GPUs the step does not fit and ranks those they make it fit on: {advised_cli:.1f} s.
With a largest-batch search on each GPU (one search per GPU; a probe traced for one GPU is reused by the next
on the same software path):
`neusight-predict {' '.join(SEARCH_CLI)}`: **{search_cli:.0f} s**.
Machine: {machine()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (other processes
share these cores, so the times are upper bounds). Regenerate: `python scripts/bench_rank.py`.
"""
    print(body)
    if not args.no_write:
        write_doc_section(DOC, "bench_rank", body, title=TITLE)
        print(f"wrote the bench_rank section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
