"""`mlxbun results`: show or export the results table."""

from __future__ import annotations

import json
import sys

# What `show` prints: enough to read a row; `export` gives every column.
SHOW_COLUMNS = ("id", "timestamp (UTC)", "experiment", "model", "metric", "value", "unit", "params", "backend", "run_id")


def _add_filters(p) -> None:
    p.add_argument("--results", metavar="PATH", help="results database (default: $MLXBUN_RESULTS or the user cache)")
    p.add_argument("--experiment", action="append", metavar="E", help="only this experiment (repeatable)")
    p.add_argument("--metric", action="append", metavar="M", help="only this metric (repeatable)")
    p.add_argument("--model-type", action="append", metavar="T", help="only this model_type (repeatable)")
    p.add_argument("--run", action="append", metavar="RUN_ID", help="only this run (repeatable)")
    p.add_argument("--since", metavar="ISO", help="only rows at or after this UTC date/time")


def register(sub) -> None:
    p = sub.add_parser("results", help="show or export the results table")
    rsub = p.add_subparsers(dest="results_command", metavar="ACTION", parser_class=type(p))
    show = rsub.add_parser("show", help="print the newest rows as a table")
    _add_filters(show)
    show.add_argument("--last", type=int, default=25, metavar="N", help="newest N rows (default 25; 0 = all)")
    show.set_defaults(func=run_show)
    export = rsub.add_parser("export", help="write the rows as CSV or Markdown")
    export.add_argument("--format", choices=("csv", "md"), default="md", help="output format (default md)")
    export.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    export.add_argument("--expand-params", action="store_true", help="one column per parameter")
    _add_filters(export)
    export.set_defaults(func=run_export)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _filters(args) -> dict:
    return {"experiment": args.experiment, "metric": args.metric, "model_type": args.model_type,
            "run_id": args.run, "since": args.since}


def _open(args):
    from mlxbun.results import open_results

    return open_results(args.results, create=False)


def _short_params(text: str, width: int = 60) -> str:
    try:
        params = json.loads(text)
        text = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items())
    except (TypeError, ValueError):
        pass
    return text if len(text) <= width else text[: width - 1] + "…"


def run_show(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from mlxbun.results import ResultsError, default_results_path
    from mlxbun.results.export import format_cell

    try:
        store = _open(args)
    except ResultsError as e:
        if "nothing recorded yet" not in str(e):
            raise
        print(f"No results table at {args.results or default_results_path()} yet.")
        return 0
    with store:
        total = store.count()
        df = store.load(**_filters(args), last=args.last or None)
        where = str(store.path)
    console = Console(width=None if sys.stdout.isatty() else 240)
    if df.empty:
        console.print(f"No matching rows in {where} ({total} rows in all).")
        return 0
    table = Table(title=f"results ({where})")
    for col in SHOW_COLUMNS:
        table.add_column(col, justify="right" if col in ("id", "value") else "left")
    for r in df.to_dict("records"):
        r = {k: format_cell(v) if k != "params" else v for k, v in r.items()}  # NaN/None -> ""
        model = " ".join(x for x in (r["model_type"], r["model_quant"]) if x) or "-"
        table.add_row(
            r["id"], r["timestamp"][:19].replace("T", " "), r["experiment"], model, r["metric"],
            r["value"] or "NaN", r["unit"], _short_params(r["params"]),
            "/".join(x for x in (r["backend"], r["device_name"]) if x), r["run_id"],
        )
    console.print(table)
    if args.last and len(df) == args.last and total > len(df):
        console.print(f"(the newest {len(df)} matching rows; --last 0 for all)")
    return 0


def run_export(args) -> int:
    from pathlib import Path

    from mlxbun.errors import MlxbunError

    with _open(args) as store:
        text = store.export(args.format, expand_params=args.expand_params, **_filters(args))
    if args.out:
        out = Path(args.out).expanduser()
        try:
            out.write_text(text)
        except OSError as e:
            raise MlxbunError(f"{out}: cannot write the export ({e.strerror})") from None
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
