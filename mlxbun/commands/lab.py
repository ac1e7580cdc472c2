"""`mlxbun lab run | list | table`: execute a lab notebook headless, list the notebooks (their parameters,
a Lab experiment's Status / Question / Answer), or render lab/README.md's summary table."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("lab", help="run the standard notebooks and Lab experiments headless (papermill)")
    lsub = p.add_subparsers(dest="lab_command", metavar="ACTION", parser_class=type(p))
    run = lsub.add_parser("run", help="execute a notebook, write it (+ HTML) and a results row")
    run.add_argument("notebook", metavar="NOTEBOOK",
                     help="a notebook name (see `mlxbun lab list`), a .ipynb path, or an experiment directory "
                          "(lab/NAME runs lab/NAME/NAME.ipynb)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                     help="set a parameter (papermill-style values: 3, 0.5, True, None, [2, 4], text); repeatable")
    run.add_argument("--out", default="lab-runs", metavar="DIR",
                     help="where the executed notebook and its HTML go (default ./lab-runs)")
    run.add_argument("--results", metavar="PATH",
                     help="results database for the notebook's rows and the run's (default: $MLXBUN_RESULTS "
                          "or the user cache)")
    run.add_argument("--timeout", type=float, metavar="S", help="per-cell time limit in seconds (default none)")
    run.add_argument("--kernel", metavar="NAME",
                     help="an installed Jupyter kernel, as `jupyter kernelspec list` names it (default: one "
                          "running this Python)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=run_run)
    ls = lsub.add_parser("list", help="the notebooks in notebooks/ and lab/, with their parameters")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=run_list)
    tab = lsub.add_parser("table", help="lab/README.md's summary table, rendered from the experiments' READMEs")
    tab.add_argument("--write", action="store_true", help="rewrite the table in lab/README.md (else print it)")
    tab.add_argument("--check", action="store_true",
                     help="exit 1 when lab/README.md's table differs from the rendered one")
    tab.set_defaults(func=run_table)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_run(args) -> int:
    from mlxbun.lab.runner import parse_parameters, run_notebook

    params = parse_parameters(args.parameter)
    result = run_notebook(args.notebook, params, out_dir=args.out, results_path=args.results,
                          progress=not args.no_progress, kernel_name=args.kernel, timeout=args.timeout)
    where = f"{result.output}" + (f", {result.html}" if result.html else "")
    if result.ok:
        print(f"{result.name}: ok in {result.duration_s:.1f} s -> {where} (run {result.run_id})")
        return 0
    print(f"mlxbun lab: {result.name} failed after {result.duration_s:.1f} s: {result.error}", file=sys.stderr)
    print(f"executed notebook: {where}; failure recorded in {result.results_path} (run {result.run_id})",
          file=sys.stderr)
    return 1


def _warn(headers) -> None:
    for h in headers:
        if h is not None and h.warning:
            print(f"mlxbun lab: warning: {h.warning}", file=sys.stderr)


def run_list(args) -> int:
    from mlxbun.lab.catalog import lab_dir, list_notebooks, notebooks_dir

    infos = list_notebooks(with_parameters=True)
    _warn(i.header for i in infos)
    if args.json:
        print(json.dumps([{"name": i.name, "kind": i.kind, "path": str(i.path),
                           "readme": None if i.readme is None else str(i.readme),
                           **({"status": i.header.status, "question": i.header.question,
                               "answer": i.header.answer} if i.header is not None else {}),
                           "parameters": {k: {"type": v["inferred_type_name"], "default": v["default"],
                                              "help": v["help"]} for k, v in i.parameters.items()}}
                          for i in infos], indent=2))
        return 0
    if not infos:
        print(f"No notebooks in {notebooks_dir()} or {lab_dir()}.")
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="mlxbun lab notebooks")
    for col in ("name", "kind", "status", "question / answer", "parameters (default)", "path"):
        table.add_column(col)
    for i in infos:
        params = "\n".join(f"{k} = {v['default']}" + (f"  # {v['help']}" if v["help"] else "")
                           for k, v in i.parameters.items()) or "-"
        h = i.header
        qa = "-" if h is None else f"Q: {h.question or '?'}\nA: {h.answer or '?'}"
        table.add_row(i.name, i.kind, "-" if h is None else h.status, escape(qa), escape(params), str(i.path))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def run_table(args) -> int:
    from mlxbun.errors import MlxbunError
    from mlxbun.lab.catalog import experiment_headers, lab_dir
    from mlxbun.lab.summary import render_readme, summary_table

    headers = experiment_headers()
    _warn(headers)
    if not (args.write or args.check):
        print(summary_table(headers))
        return 0
    readme = lab_dir() / "README.md"
    if not readme.is_file():
        raise MlxbunError(f"{readme}: no such file (the lab's README holds the summary table)")
    text = readme.read_text(encoding="utf-8")
    rendered = render_readme(text, headers)
    if args.check:
        if rendered != text:
            print(f"{readme}: the summary table is out of date (run `mlxbun lab table --write`)", file=sys.stderr)
            return 1
        print(f"{readme}: the summary table is up to date")
        return 0
    readme.write_text(rendered, encoding="utf-8")
    print(f"{readme}: summary table of {len(headers)} experiment(s) written")
    return 0
