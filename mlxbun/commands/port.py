"""`mlxbun port TARGET...`: coverage, audit, oracle, gate, verdict, manifest entry."""

from __future__ import annotations

import json
import sys

from mlxbun.errors import MlxbunError
from mlxbun.commands.hub_flags import add_offline
from mlxbun.names import MODEL_FORMS, VARIANT_ALIASES, ZOO_VARIANTS, comma_items


def register(sub) -> None:
    p = sub.add_parser("port", help="bring a checkpoint up on the universal graph and gate it bit-exact vs mlx-lm")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help=f"a model ({MODEL_FORMS}) or zoo:all")
    p.add_argument("--variants", default="all",
                   help=f"zoo targets: comma-separated of {','.join(ZOO_VARIANTS)} or 'all' (default: all, "
                        "the ones this device runs: mlx's CPU backend runs unquantized MoE experts in "
                        "float32 only)")
    p.add_argument("--decode-steps", type=int, default=16, help="greedy decode steps after the prefill (default 16)")
    p.add_argument("--prompt-len", type=int, default=40, help="prompt length in tokens (default 40)")
    goldens = p.add_mutually_exclusive_group()
    goldens.add_argument("--goldens", metavar="DIR",
                         help="where manifest entries go (default: goldens/ when run in the mlxbun checkout, "
                              "else none)")
    goldens.add_argument("--no-goldens", action="store_true", help="do not write manifest entries")
    p.add_argument("--check-values", action="store_true",
                   help="the weight audit also reads every tensor's values: NaN/inf tensors refuse the target "
                        "(default: headers only)")
    p.add_argument("--cache", help="hub cache directory for repo-id targets")
    add_offline(p)
    p.add_argument("--zoo-cache", help="where zoo checkpoints are built (default ~/.cache/mlxbun/zoo)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per checkpoint")
    p.set_defaults(func=run)


def _variants(text: str) -> tuple[str, ...] | None:
    if text == "all":
        return None  # each arch's variants this device runs
    chosen = tuple(VARIANT_ALIASES.get(v, v) for v in comma_items(text, "--variants"))
    bad = [v for v in chosen if v not in ZOO_VARIANTS]
    if bad or not chosen:
        raise MlxbunError(f"--variants: unknown {bad or text!r}; choose from {', '.join(ZOO_VARIANTS)} or 'all'")
    return chosen


def _fmt_diff(d) -> str:
    return "-" if d is None else ("0 (bit-exact)" if d == 0 else f"{d:.3g}")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from mlxbun.parity.port import checkout_goldens, port_one, resolve_targets

    if args.decode_steps < 1 or args.prompt_len < 2:
        raise MlxbunError("--decode-steps must be >= 1 and --prompt-len >= 2")
    goldens_dir = None if args.no_goldens else (args.goldens or checkout_goldens())
    err = Console(stderr=True)
    with err.status("preparing targets (building zoo checkpoints if needed)..."):
        targets = resolve_targets(args.targets, variants=_variants(args.variants),
                                  zoo_root=args.zoo_cache, cache_dir=args.cache)
    results = []
    with Progress(console=err, transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("porting", total=len(targets))
        for t in targets:
            progress.update(task, description=f"{t.label} {t.variant or ''}")
            results.append(port_one(t, decode_steps=args.decode_steps, prompt_len=args.prompt_len,
                                    goldens_dir=goldens_dir, check_values=args.check_values))
            progress.advance(task)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        table = Table(title="mlxbun port: mlxbun vs mlx-lm 0.32.2")
        for col in ("target", "arch", "dtype/quant", "coverage", "audit", "trajectory", "max |diff|", "verdict"):
            table.add_column(col)
        style = {"pass": "green", "fail": "red", "refused": "yellow"}
        for r in results:
            table.add_row(r.target, r.model_type or "?", r.dtype or "-", r.coverage, r.audit, r.trajectory,
                          _fmt_diff(r.max_abs_diff), f"[{style[r.verdict]}]{r.verdict}[/]")
        console = Console(width=None if sys.stdout.isatty() else 240)
        console.print(table)
        for r in results:
            if r.verdict != "pass":
                where = f" first divergence: {r.first_divergence['path']}" if r.first_divergence else ""
                console.print(f"[{style[r.verdict]}]{r.target} {r.dtype}[/]: {r.reason}{where}")
            if r.note:
                console.print(f"{r.target}: note: {r.note}")
        n_pass = sum(r.verdict == "pass" for r in results)
        console.print(f"{n_pass}/{len(results)} bit-exact")
    if goldens_dir is None and not args.no_goldens:
        print("mlxbun port: no golden manifests written: not run in the mlxbun checkout "
              "(pass --goldens DIR to write them)", file=sys.stderr)
    return 0 if all(r.verdict == "pass" for r in results) else 1
