"""`mlxbun ls`: the models on this machine, their support tier and whether they fit."""

from __future__ import annotations

import json
import shlex
import sys


def register(sub) -> None:
    p = sub.add_parser("ls", help="list models in the HF hub cache (and given directories)")
    p.add_argument("paths", nargs="*", help="extra checkpoint directories (or folders of them)")
    p.add_argument("--cache", help="hub cache directory (default: huggingface_hub's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


_EMPTY_HINT = """To put a model there, build a tiny one: mlxbun zoo build ARCH --hf-cache --out {cache}
  (`mlxbun zoo list` names the archs; models downloaded from the Hugging Face hub land there too).
To list a checkpoint directory elsewhere: mlxbun ls DIR
A llama.cpp GGUF file becomes one with: mlxbun import gguf FILE --out DIR"""


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def _human_count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from mlxbun.inventory import default_cache_dir, list_models

    entries, warnings = list_models(args.cache, args.paths)
    if args.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    # Piped output (tests, `| less`) gets the full width instead of an 80-column wrap.
    console = Console(width=None if sys.stdout.isatty() else 240)
    where = args.cache or str(default_cache_dir())
    if not entries:
        console.print(f"No models found in {where}" + (f" or {', '.join(args.paths)}" if args.paths else "") + ".")
        console.print(_EMPTY_HINT.format(cache=shlex.quote(where)), markup=False, highlight=False)
    else:
        table = Table(title=f"models ({where})")
        for col in ("repo", "revision", "model_type", "params", "size", "quant", "tier", "fits", "note"):
            table.add_column(col)
        for e in entries:
            table.add_row(
                e.repo, (e.revision or "-")[:10], e.model_type or "?", _human_count(e.parameters),
                _human_bytes(e.size_bytes), e.quantization or "-", e.tier,
                {True: "yes", False: "no", None: "-"}[e.fits_memory], e.reason or "",
            )
        console.print(table)
    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}")
    return 0
