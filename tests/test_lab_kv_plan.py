"""kv_plan (graduated from lab/kv_plan into notebooks/) runs headless on its small setting (zoo:llama) and
records rows that mean something."""

from __future__ import annotations

from pathlib import Path

import nbformat

from mlxbun import cli
from mlxbun.results import open_results

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab" / "kv_plan"  # the graduated experiment: its README and results; its notebook in notebooks/
NOTEBOOK = ROOT / "notebooks" / "kv_plan.ipynb"


def test_readme_heading_lines():
    lines = (LAB / "README.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2] in ("Status: open", "Status: answered", "Status: graduated")
    assert lines[3].startswith("Question: ") and lines[4].startswith("Answer: ")


def test_notebook_small_setting(tmp_path, capsys):
    db, out = tmp_path / "results.sqlite", tmp_path / "out"
    code = cli.main(["lab", "run", str(NOTEBOOK), "--out", str(out), "--results", str(db),
                     "--no-progress", "-p", "save_dir", str(tmp_path / "saved")])
    assert code == 0, capsys.readouterr().err
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    rows = rows[rows.experiment == "kv_plan"].rename(columns=lambda c: c.removeprefix("params."))
    sens = rows[(rows.part == "sensitivity") & (rows.metric == "kld_mean")]
    assert len(sens) == 2 * 3 and (sens.value > 0).all()  # zoo:llama: 2 layers x bits 8, 4, 2
    assert sens[sens.kv_bits == 2].value.min() > sens[sens.kv_bits == 8].value.max()
    plans = rows[(rows.part == "plan")]
    kld = plans[plans.metric == "kld_mean"].set_index("label").value
    bpt = plans[plans.metric == "bytes_per_token"].set_index("label").value
    budget = plans[plans.metric == "kld_mean"].set_index("label").budget
    assert kld["plain"] == 0 and bpt["uniform q8"] < bpt["plain"]
    for label in [x for x in kld.index if x.startswith("plan <=")]:
        assert kld[label] <= budget[label]  # the searched plan's measured KLD meets its budget
    # the plan within uniform q4's KLD uses no more bytes than uniform q4
    assert bpt["plan <= KLD of uniform q4"] <= bpt["uniform q4"]
    assert {"sensitivity.csv", "plans.csv", "sensitivity.png", "tradeoff.png"} <= {
        p.name for p in (tmp_path / "saved").iterdir()}
    nb = nbformat.read(out / "kv_plan.ipynb", 4)
    assert "cache layers can be quantized" in "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
