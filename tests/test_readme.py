"""The README's model table and command list stay true."""

from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_lists_every_supported_model_type_with_its_tier():
    from mlxbun.profile import supported_model_types

    for model_type, tier in supported_model_types().items():
        assert f"| `{model_type}` | {tier} |" in README, f"README model table lacks {model_type}"


def test_readme_command_table_and_the_cli_match_both_ways():
    """Every command the CLI registers has a row in the README's command table, and every row
    names a command `mlxbun --help` lists (the parser as users get it, nothing patched in)."""
    import re

    from mlxbun.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    registered = set(sub.choices)
    table = README[README.index("## Commands"):README.index("## Python API")]
    rows = set(re.findall(r"^\| `mlxbun (\w+)", table, re.M))
    assert registered == rows, (f"registered, not in the README table: {sorted(registered - rows)}; "
                                f"in the table, not registered: {sorted(rows - registered)}")
