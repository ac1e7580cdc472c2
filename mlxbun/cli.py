"""`mlxbun` command line: one subcommand module per command under mlxbun/commands/.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed args, returning an exit code). User mistakes are
`MlxbunError`s and print as one line; bad arguments print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Order is the order `mlxbun --help` lists them.
COMMAND_MODULES = ["zoo", "import_gguf", "convert", "ls", "port", "explain", "generate", "kv_plan", "bench", "tp_check", "lab", "results"]


class VersionAction(argparse.Action):
    """`mlxbun --version`: mlxbun (and its git revision), mlx, mlx-lm, the backend and the device, as
    the results table records them (`mlxbun.results.identity.environment()`); exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from mlxbun.results.identity import environment

        env = environment()
        device = env["device"] + (f" ({env['device_name']})" if env["device_name"] else "")
        print(f"mlxbun {env['mlxbun_version']} ({env['revision']})\nmlx {env['mlx_version']}\n"
              f"mlx-lm {env['mlx_lm_version']}\nbackend {env['backend']}\ndevice {device}")
        parser.exit(0)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (no usage dump)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mlxbun", description="mlxbun: a research workbench for language-model inference on MLX.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the versions of mlxbun, mlx and mlx-lm, the backend and the device, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"mlxbun.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mlxbun.errors import MlxbunError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2 if args.command is None and argv is None and len(sys.argv) <= 1 else 0
    try:
        if getattr(args, "offline", False):  # commands/hub_flags.py
            from mlxbun.hub import go_offline

            go_offline()
        return int(args.func(args) or 0)
    except MlxbunError as e:
        print(f"mlxbun {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mlxbun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`mlxbun port ... --json | head`): stop quietly, as `cat` does;
        # stdout goes to /dev/null so the interpreter's last flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
