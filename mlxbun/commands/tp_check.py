"""`mlxbun tp-check MODEL...`: hold a tensor-parallel split to the whole model and to mlx-lm's split.

Run it under a launch of N ranks (`mlx.launch -n 2 --backend ring .venv/bin/mlxbun tp-check
zoo:llama`); rank 0 prints one row per model: greedy ids vs the whole model, the largest logit
difference relative to the largest logit (and the tolerance it is held to), mlx-lm's split bit for
bit where its file has `shard()`, or why the split is refused.
"""

from __future__ import annotations

import json
import sys

from mlxbun.errors import MlxbunError
from mlxbun.names import MODEL_FORMS, VARIANT_ALIASES, ZOO_VARIANTS, comma_items


def register(sub) -> None:
    p = sub.add_parser("tp-check", help="hold a tensor-parallel split (run under mlx.launch) to the whole model "
                                        "and to mlx-lm's split",
                       description="Split each model across the launched ranks and compare it with the whole "
                                   "model (greedy ids equal, logits within a stated tolerance) and with "
                                   "mlx-lm 0.32.2's own split (bit for bit, where its file has shard()). "
                                   "Run as: mlx.launch -n 2 --backend ring .venv/bin/mlxbun tp-check MODEL")
    p.add_argument("targets", nargs="+", metavar="MODEL", help=f"a model ({MODEL_FORMS}) or zoo:all")
    p.add_argument("--variants", default="float32",
                   help=f"zoo targets without @VARIANT: comma-separated of {','.join(ZOO_VARIANTS)} or 'all' "
                        "(each arch's variants this device runs; default float32)")
    p.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps after the prefill (default 8)")
    p.add_argument("--prompt-len", type=int, default=24, help="prompt length in tokens (default 24)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per model")
    p.set_defaults(func=run)


def expand_targets(texts, variants: str) -> list[str]:
    """Model names, with `zoo:all` and variant-less zoo names expanded over `variants`."""
    from mlxbun import zoo
    from mlxbun.names import parse_model
    from mlxbun.zoo.archs import runnable_variants

    chosen = None
    if variants != "all":
        chosen = tuple(VARIANT_ALIASES.get(v, v) for v in comma_items(variants, "--variants"))
        bad = [v for v in chosen if v not in ZOO_VARIANTS]
        if bad or not chosen:
            raise MlxbunError(f"--variants: unknown {bad or variants!r}; choose from {', '.join(ZOO_VARIANTS)} "
                              "or 'all'")
    out = []
    for text in texts:
        spec = parse_model(text)
        if spec.kind != "zoo" or spec.variant:
            out.append(str(spec) if spec.kind == "zoo" else text)
            continue
        for arch in (zoo.ARCHS if spec.value == "all" else (spec.value,)):
            runnable = runnable_variants(arch)
            for v in (runnable if chosen is None else [v for v in chosen if v in runnable]):
                out.append(str(type(spec)("zoo", arch, seed=spec.seed, head_dim=spec.head_dim)
                               .with_options(variant=v)))
    return out


def _fmt(r) -> list[str]:
    rel = "-" if r.relative_diff is None else f"{r.relative_diff:.2g}"
    if r.tolerance is not None and r.max_abs_logit:
        rel += f" (<= {r.tolerance / r.max_abs_logit:.2g})"
    ids = "-" if r.tokens_equal is None else ("equal" if r.tokens_equal else
                                             f"tie at step {r.tie_at}" if r.tie_at is not None else "differ")
    return [r.target, r.dtype or "-", ids, rel, r.mlxlm or "-", r.status]


def _report(results, ranks: int, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    if as_json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
        return
    table = Table(title=f"mlxbun tp-check: split across {ranks} ranks vs whole and vs mlx-lm's split")
    for col in ("model", "dtype", "greedy ids", "max |diff| / max |logit|", "mlx-lm split", "verdict"):
        table.add_column(col)
    style = {"pass": "green", "fail": "red", "refused": "yellow"}
    for r in results:
        row = _fmt(r)
        row[-1] = f"[{style[r.status]}]{r.status}[/]"
        table.add_row(*row)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for r in results:
        if r.reason:
            console.print(f"[{style[r.status]}]{r.target}[/]: {r.reason}")
    console.print(f"{sum(r.status == 'pass' for r in results)}/{len(results)} pass")


def run(args) -> int:
    from mlxbun.parallel import barrier, is_primary, primary_output, world
    from mlxbun.parallel.check import check_tensor_parallel

    if args.decode_steps < 1 or args.prompt_len < 2:
        raise MlxbunError("--decode-steps must be >= 1 and --prompt-len >= 2")
    group = world()
    with primary_output():
        targets = expand_targets(args.targets, args.variants)
        results = [check_tensor_parallel(t, group, decode_steps=args.decode_steps, prompt_len=args.prompt_len)
                   for t in targets]
    if is_primary():
        _report(results, group.size(), args.json)
        sys.stdout.flush()
    # mlx.launch stops every rank once one exits non-zero (a refused target): the others leave
    # only after rank 0 has printed, or it could be stopped before its report is out
    barrier(group)
    return 0 if all(r.status == "pass" for r in results) else 1
