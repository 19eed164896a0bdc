"""Speed of planning a multi-GPU run (``neusight-predict gpus=N``, ``neusight.plan_parallel``): every dp x tp x pp
layout of N GPUs, with the micro-batch counts and ZeRO stages, forecast and ranked. Three plans: GPT-3 2.7B
training (FP32, global batch 64, seq 2048) on 8 H100s, Llama-3-70B training (BF16, SDPA, global batch 64, seq 4096)
on 16 H100s, and Llama-3.1-8B at 131,072 tokens (BF16, flash-attn 2, full recompute, sequence parallelism) on 8
H100s with the context-parallel degrees and exchanges searched; in Python (warm process) and the first one as the
whole command.

No multi-GPU measurement is available here: this measures how long a plan takes, not how right it is.

    python scripts/bench_plan.py              # prints, and rewrites its section of docs/speed.md (about 3 min)
    python scripts/bench_plan.py --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_rank import command_wall, timed  # noqa: E402
from bench_trace import DOC, TITLE, machine  # noqa: E402

import neusight  # noqa: E402
from neusight.cli.common import quiet_third_party_logs  # noqa: E402
from neusight.e2e_eval import write_doc_section  # noqa: E402

PLANS = [
    dict(model="gpt3-2.7b", device="h100-sxm5-80gb", gpus=8, batch_size=64, seq_len=2048, mode="training"),
    dict(model="llama-3-70b", device="h100-sxm5-80gb", gpus=16, batch_size=64, seq_len=4096, mode="training",
         dtype="bfloat16", attn_implementation="sdpa"),
    dict(model="llama-3.1-8b", device="h100-sxm5-80gb", gpus=8, batch_size=2, seq_len=131072, mode="training",
         dtype="bfloat16", attn_implementation="flash_attention_2", gradient_checkpointing=True, sp=True, cp="auto",
         cp_comm="auto"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/speed.md alone")
    args = ap.parse_args(argv)
    quiet_third_party_logs()
    load_before = os.getloadavg()
    neusight.predict("gpt2", "h100-sxm5-80gb", seq_len=32, memory=False)   # imports and the predictor load
    rows = []
    for kw in PLANS:
        seconds, plan = timed(lambda kw=kw: neusight.plan_parallel(**kw))
        best = plan.best
        rows.append(f"| `plan_parallel({', '.join(f'{k}={v!r}' for k, v in kw.items())})` | {len(plan.table)} "
                    f"| {len(plan.skipped)} | {len(plan.candidates)} | {int((plan.table['fits'] == 'yes').sum())} | "
                    + ("none fits" if best is None else
                       f"{best['layout']}" + (f" ({best['cp comm']})" if best["cp"] > 1 else "")
                       + f", {int(best['micro-batches'])} micro-batches, ZeRO {int(best['zero'])}"
                       + (f", {best['recompute']} recompute" if best["recompute"] != "no" else "")
                       + f": {best['ms']:,.0f} ms")
                    + f" | {seconds:.1f} |")
    cli = ["model=gpt3-2.7b", "device=h100-sxm5-80gb", "gpus=8", "batch_size=64", "seq_len=2048", "mode=training"]
    cli_s = command_wall(cli)
    load_after = os.getloadavg()
    body = f"""## Planning a multi-GPU run (`gpus=N`)

Every `dp x tp x pp` layout of N GPUs forecast with `neusight.parallel.predict_parallel` (per layout the
micro-batch counts, for mixture-of-experts models the expert-parallel degrees, in training without pipeline stages
the ZeRO stages, and activation recompute where a candidate does not fit without it; with `cp=auto` every
context-parallel degree, and with `cp_comm=auto` each exchange; candidates with the same micro-batch size, tp, ep,
cp and recompute share one trace) and ranked, memory fit first. Warm process in Python.
No multi-GPU measurement is available to check the rankings: this table measures the time a plan takes.

| plan | layouts forecast | left out | candidates | layouts that fit | best | Python (s) |
| --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

The first as a command in a fresh process: `neusight-predict {' '.join(cli)}`: **{cli_s:.1f} s**.
Machine: {machine()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after.
Regenerate: `python scripts/bench_plan.py`.
"""
    print(body)
    if not args.no_write:
        write_doc_section(DOC, "bench_plan", body, title=TITLE)
        print(f"wrote the bench_plan section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
