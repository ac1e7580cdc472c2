"""A test run refuses to start without its pinned oracles (one line naming the package and the
install step), rather than skipping every test that needs them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _run_with_pins(tmp_path: Path, pins: str) -> subprocess.CompletedProcess:
    """pytest on a one-test project whose conftest is ours and whose oracles.txt is `pins`."""
    (tmp_path / "tests").mkdir()
    shutil.copy(HERE / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copy(HERE.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests" / "oracles.txt").write_text(pins)
    shutil.copy(HERE / "real-models.txt", tmp_path / "tests" / "real-models.txt")
    (tmp_path / "tests" / "test_one.py").write_text("def test_one():\n    pass\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "tests")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("pin,found", [("mlx-vlm==0.0.1", "found 0.7.10"), ("no-such-oracle==1.0", "not installed")])
def test_a_missing_or_wrong_oracle_stops_the_run(tmp_path, pin, found):
    r = _run_with_pins(tmp_path, f"# comment\n{pin}  # why\n")
    assert r.returncode == 4, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    name, version = pin.split("==")
    assert line == (f"ERROR: test oracle {name}=={version} is {found}: "
                    "run `make` (its step: pip install --no-deps -r tests/oracles.txt)")
    assert "passed" not in r.stdout and "skipped" not in r.stdout

