"""The Lab's catalog lines: README headers (Status / Question / Answer) in `mlxbun lab list`, the
summary table of lab/README.md (`mlxbun lab table`, never drifting from the READMEs), `lab run` of an
experiment directory, and its rows recorded under the experiment's name."""

import json

import pytest

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.lab.catalog import experiment_headers, lab_dir, resolve_notebook
from mlxbun.lab.summary import TABLE_BEGIN, TABLE_END, read_header, render_readme, summary_table
from mlxbun.results import open_results
from tests.notebook_files import write_nb

GOOD = "# KV idea\n\nStatus: answered\nQuestion: Does q4 hold?\nAnswer: yes, KLD 0.01 | 4x fewer bytes\n\n## Method\n"


def test_read_header_good_and_bad(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(GOOD)
    h = read_header("idea", p)
    assert (h.title, h.status, h.question, h.answer, h.warning) == \
        ("KV idea", "answered", "Does q4 hold?", "yes, KLD 0.01 | 4x fewer bytes", None)
    p.write_text("# KV idea\nStatus: maybe\nQuestion: q\nAnswer: a\n")
    h = read_header("idea", p)
    assert h.status == "?" and "maybe" in h.warning and str(p) in h.warning
    p.write_text("# KV idea\n\nSome prose first.\n")
    h = read_header("idea", p)
    assert h.status == "?" and "Status" in h.warning and str(p) in h.warning
    p.write_text("# KV idea\nStatus: open\nQuestion: q\n")
    assert "Answer" in read_header("idea", p).warning
    p.write_text("no title\n")
    assert "Title" in read_header("idea", p).warning
    h = read_header("idea", None)
    assert h.status == "?" and "lab/idea" in h.warning


def test_lab_list_shows_headers_and_warns_on_a_bad_readme(lab_dirs, capsys):
    _, lab = lab_dirs
    write_nb(lab / "good" / "good.ipynb")
    (lab / "good" / "README.md").write_text(GOOD)
    write_nb(lab / "bad" / "bad.ipynb")
    (lab / "bad" / "README.md").write_text("# Bad\n\nJust prose.\n")
    assert cli.main(["lab", "list", "--json"]) == 0
    captured = capsys.readouterr()
    rows = {r["name"]: r for r in json.loads(captured.out)}
    assert (rows["good"]["status"], rows["good"]["question"]) == ("answered", "Does q4 hold?")
    assert rows["bad"]["status"] == "?"
    assert str(lab / "bad" / "README.md") in captured.err and "good" not in captured.err
    assert cli.main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert "answered" in out and "Does q4 hold?" in out


def test_summary_table_and_readme_rendering(lab_dirs, capsys):
    _, lab = lab_dirs
    write_nb(lab / "zeta" / "zeta.ipynb")
    (lab / "zeta" / "README.md").write_text(GOOD)
    write_nb(lab / "alpha" / "alpha.ipynb")  # no README: listed with status "?"
    table = summary_table(experiment_headers())
    lines = table.splitlines()
    assert lines[2].startswith("| alpha | ? | - | - |")
    assert lines[3] == ("| zeta | answered | Does q4 hold? | yes, KLD 0.01 \\| 4x fewer bytes | "
                        "[zeta/README.md](zeta/README.md) |")
    readme = lab / "README.md"
    readme.write_text(f"# Lab\n\nGuidance kept.\n\n{TABLE_BEGIN}\n| stale |\n{TABLE_END}\nAfter.\n")
    assert cli.main(["lab", "table", "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli.main(["lab", "table", "--write"]) == 0
    text = readme.read_text()
    assert text.startswith("# Lab\n\nGuidance kept.\n") and text.endswith(f"{TABLE_END}\nAfter.\n")
    assert table in text and "stale" not in text
    assert cli.main(["lab", "table", "--check"]) == 0
    with pytest.raises(MlxbunError, match="markers"):
        render_readme("# Lab\n", [])


def test_the_committed_lab_readme_table_matches_the_experiments(monkeypatch):
    monkeypatch.delenv("MLXBUN_LAB", raising=False)
    readme = lab_dir() / "README.md"
    text = readme.read_text(encoding="utf-8")
    headers = experiment_headers()
    assert not [h.warning for h in headers if h.warning], "every committed experiment has a README header"
    assert render_readme(text, headers) == text, "lab/README.md is stale: run `mlxbun lab table --write`"


def test_lab_run_of_a_directory_records_rows_under_its_name(lab_dirs, tmp_path, monkeypatch, capsys):
    nbs, lab = lab_dirs
    code = ("from mlxbun.lab.recording import recording\n"
            "with recording('some_driver', params={'k': 1}, results_path=results_path) as run:\n"
            "    run.record('answer', 42.0)")
    write_nb(lab / "idea" / "idea.ipynb", code, params="results_path = None")
    write_nb(lab / "idea" / "other.ipynb", "1 / 0", params="results_path = None")  # not the one that runs
    write_nb(nbs / "flow.ipynb", code, params="results_path = None")  # a workflow keeps the driver's name
    db = tmp_path / "r.sqlite"
    monkeypatch.chdir(tmp_path)  # lab/idea is a directory here (tmp_path/lab is the lab)
    assert cli.main(["lab", "run", "lab/idea", "--results", str(db), "--out", "o", "--no-progress"]) == 0, \
        capsys.readouterr().err
    monkeypatch.chdir(nbs)  # elsewhere: lab/idea is found in the lab directory
    assert cli.main(["lab", "run", "lab/idea/", "--results", str(db), "--out", "o", "--no-progress"]) == 0
    assert cli.main(["lab", "run", "flow", "--results", str(db), "--out", "o", "--no-progress"]) == 0
    with open_results(db, create=False) as store:
        lab_rows = store.load(experiment="lab", expand_params=True)
        rows = store.load(metric="answer", expand_params=True)
    assert list(lab_rows["params.notebook"]) == ["idea", "idea", "flow"]
    assert list(rows.experiment) == ["idea", "idea", "some_driver"]
    assert list(rows["params.driver"][:2]) == ["some_driver", "some_driver"]
    assert list(rows["params.lab_run"]) == list(lab_rows.run_id)


def test_a_graduated_experiment_is_its_workflow_with_the_readme_header(lab_dirs, tmp_path, monkeypatch, capsys):
    """lab/<name>/ keeps the README (and results) of an experiment whose notebook moved to notebooks/:
    listed once, as the workflow, with the experiment's header; in the summary table; `lab run lab/<name>`
    runs the moved notebook. A directory elsewhere of the same name does not."""
    nbs, lab = lab_dirs
    write_nb(nbs / "plan.ipynb", "print('moved')", params="results_path = None")
    (lab / "plan").mkdir()
    (lab / "plan" / "README.md").write_text(GOOD.replace("answered", "graduated"))
    assert cli.main(["lab", "list", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "plan"]
    assert len(rows) == 1 and (rows[0]["kind"], rows[0]["status"]) == ("workflow", "graduated")
    assert rows[0]["path"] == str(nbs / "plan.ipynb") and rows[0]["readme"] == str(lab / "plan" / "README.md")
    assert [h.status for h in experiment_headers() if h.name == "plan"] == ["graduated"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lab", "run", "lab/plan", "--results", str(tmp_path / "r.sqlite"), "--out", "o",
                     "--no-progress"]) == 0, capsys.readouterr().err
    assert (tmp_path / "o" / "plan.ipynb").is_file()
    (tmp_path / "elsewhere" / "plan").mkdir(parents=True)
    with pytest.raises(MlxbunError, match="a directory without a notebook"):
        resolve_notebook(tmp_path / "elsewhere" / "plan")
