"""The README's model table and command list stay true."""

from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_lists_every_supported_model_type_with_its_tier():
    from mlxbun.profile import supported_model_types

    for model_type, tier in supported_model_types().items():
        assert f"| `{model_type}` | {tier} |" in README, f"README model table lacks {model_type}"


def test_readme_lists_every_cli_command():
    from mlxbun.cli import COMMAND_MODULES

    for name in COMMAND_MODULES:
        assert f"`mlxbun {name}" in README, f"README command table lacks `mlxbun {name}`"
