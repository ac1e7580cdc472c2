"""On the device: lab/draft_model's sweep (issue 29) on the GPU: Qwen2.5-Coder-1.5B-Instruct with the
0.5B drafting, against n-gram lookup and the self-draft, on the lab's code-edit and chat tasks.

    python3 benchmarks/spec_gpu.py --target DIR --draft DIR [--out DIR] [--max-tokens 64] [--ks 2 4 8]

The checkpoints are `mlxbun import gguf FILE --quant none --dtype bfloat16 --out DIR` of the two GGUF
files of tests/real-models.txt, made on the device from the files carried there in parts (the device
takes 64 MiB a call and has no network). Writes spec_gpu.csv (the sweep, as lab/draft_model's
draft_model.csv) and spec_gpu.txt (the lab's readings: best k, model vs lookup) under --out. Greedy
runs are not required to equal plain decoding here: on the GPU a verify of k+1 tokens runs other
matmul kernels than a one-token step, so a near-tie may part them; `same_as_plain` says per run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from mlxbun.experiments import draft_model, spec_acceptance, spec_tasks  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "lab" / "prompt_lookup" / "prompts"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target checkpoint directory")
    p.add_argument("--draft", required=True, help="the draft model's checkpoint directory")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--lookup", default="ngram:3")
    p.add_argument("--self-depth", type=int, default=14)
    p.add_argument("--tasks", nargs="+", default=["code_edit", "chat"])
    p.add_argument("--fast", action="store_true",
                   help="plain and speculative decoding on the fast path (static caches)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drafter = f"model:{args.draft}"
    drafters = [drafter, args.lookup] + ([f"self:{args.self_depth}"] if args.self_depth else [])
    prompts, prompt_format = spec_tasks.task_prompts(args.target, PROMPTS, args.tasks)
    sweep = spec_acceptance.spec_sweep(args.target, drafters, args.ks, prompts=prompts,
                                       prompt_set=spec_tasks.PROMPT_SET, max_tokens=args.max_tokens,
                                       results_path=out / "results.sqlite", experiment="draft_model", fast=args.fast,
                                       extra_params={"prompt_format": prompt_format, "draft": args.draft})
    table = sweep.table()
    table.to_csv(out / "spec_gpu.csv", index=False)
    with pd.option_context("display.float_format", "{:.3f}".format, "display.width", 250, "display.max_rows", 500,
                           "display.max_columns", None):
        text = "\n\n".join(str(t) for t in (table, sweep.per_position(), draft_model.best_k(sweep),
                                            draft_model.model_vs_lookup(sweep, drafter, args.lookup)))
    (out / "spec_gpu.txt").write_text(f"prompt format: {prompt_format}\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
