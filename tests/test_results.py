"""The results table: identity columns, queries, export, concurrent appends, refusal of foreign files, CLI."""

import io
import json
import math
import multiprocessing as mp
import os
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd
import pytest

from mlxbun import cli
from mlxbun.errors import MlxbunError
from mlxbun.results import (
    COLUMNS,
    ResultsError,
    default_results_path,
    environment,
    model_identity,
    open_results,
    record,
)


@pytest.fixture
def db(tmp_path):
    return tmp_path / "results.sqlite"


# ---------------------------------------------------------------- writing and reading


def test_run_rows_carry_identity_params_and_values(db):
    with open_results(db) as store:
        run = store.new_run("kv-quant", model={"type": "llama", "quant": "affine 4-bit g64"},
                            params={"bits": 4, "prompt": {"len": 128}})
        run.record("decode_tps", 41.5, "tok/s")
        run.record("kld_mean", np.float32(0.25), None, bits=8)  # per-row params override the run's
        run.record("peak_mem", mx.array(3), "GB")
        df = store.load()
    assert list(df.columns) == list(COLUMNS)
    assert df["metric"].tolist() == ["decode_tps", "kld_mean", "peak_mem"]
    assert df["value"].tolist() == [41.5, 0.25, 3.0]
    assert df["unit"].tolist()[::2] == ["tok/s", "GB"] and df["unit"].isna().tolist()[1]
    assert [json.loads(p)["bits"] for p in df["params"]] == [4, 8, 4]
    assert df["run_id"].nunique() == 1 and df["experiment"].eq("kv-quant").all()
    row = df.iloc[0]
    from importlib.metadata import version

    assert row["mlx_version"] == mx.__version__ and row["mlx_lm_version"] == version("mlx-lm")
    assert row["backend"] == "cpu" and row["device"] == "cpu:0"
    assert row["revision"].startswith(("git:", "mlxbun-"))
    assert row["cpu_count"] == os.cpu_count() and row["ram_bytes"] > 0 and row["platform"]
    assert row["model_type"] == "llama" and row["model_quant"] == "affine 4-bit g64"
    ts = df["timestamp"]
    assert str(ts.dt.tz) == "UTC" and ts.is_monotonic_increasing
    assert abs(datetime.now(timezone.utc) - ts.iloc[0].to_pydatetime()) < timedelta(minutes=5)


def test_expand_params_and_filters(db):
    store = open_results(db)
    a = store.new_run("spec", model={"model_type": "qwen3"}, params={"draft": "ngram", "k": 3})
    b = store.new_run("bench", model={"model_type": "llama"}, params={"batch": 1})
    for i in range(3):
        a.record("accept_rate", 0.5 + i / 10, step=i)
        b.record("prefill_tps", 100.0 + i)
    mid = datetime.now(timezone.utc)
    b.record("decode_tps", 9.0)

    assert len(store.load()) == 7 and store.count() == 7
    assert store.load(experiment="spec")["metric"].unique().tolist() == ["accept_rate"]
    assert len(store.load(metric=["prefill_tps", "decode_tps"])) == 4
    assert set(store.load(model_type="qwen3")["experiment"]) == {"spec"}
    assert len(store.load(run_id=b.run_id)) == 4
    assert store.load(since=mid)["metric"].tolist() == ["decode_tps"]
    assert store.load(since=mid.isoformat())["metric"].tolist() == ["decode_tps"]
    assert store.load(last=2)["metric"].tolist() == ["prefill_tps", "decode_tps"]  # newest two, oldest first
    assert store.load(experiment="nope").empty

    wide = store.load(experiment="spec", expand_params=True)
    assert wide["params.draft"].tolist() == ["ngram"] * 3
    assert wide["params.step"].tolist() == [0, 1, 2] and wide["params.k"].tolist() == [3, 3, 3]
    with pytest.raises(ResultsError, match="since"):
        store.load(since="yesterday-ish")
    store.close()


def test_record_failure_is_a_nan_row_with_the_message(db):
    with open_results(db) as store:
        run = store.new_run("bench", params={"model": "x"})
        run.record_failure("OOM while allocating 3 GB", phase="prefill")
        df = store.load(expand_params=True)
    assert df["metric"].tolist() == ["error"] and math.isnan(df["value"].iloc[0])
    assert df["params.error"].iloc[0] == "OOM while allocating 3 GB" and df["params.phase"].iloc[0] == "prefill"


def test_one_shot_record_and_default_path(db, tmp_path, monkeypatch):
    run_id = record("smoke", "latency", 12.5, "ms", params={"n": 1}, path=db)
    df = open_results(db).load()
    assert df["run_id"].tolist() == [run_id] and df["value"].tolist() == [12.5]

    env_db = tmp_path / "sub" / "env.sqlite"
    monkeypatch.setenv("MLXBUN_RESULTS", str(env_db))
    assert default_results_path() == env_db
    record("smoke", "latency", 1.0)
    assert env_db.is_file() and len(open_results().load()) == 1

    monkeypatch.delenv("MLXBUN_RESULTS")
    from platformdirs import user_cache_dir

    assert default_results_path() == Path(user_cache_dir("mlxbun")) / "results.sqlite"


def test_bad_measurements_are_refused_by_name(db):
    store = open_results(db)
    run = store.new_run("e")
    with pytest.raises(ResultsError, match="metric 'tps'.*not a real number"):
        run.record("tps", "fast")
    with pytest.raises(ResultsError, match="parameter 'fn'"):
        run.record("tps", 1.0, fn=object())
    with pytest.raises(ResultsError, match="experiment name"):
        store.new_run("  ")
    with pytest.raises(ResultsError, match="parameter 'cb'"):
        store.new_run("e", params={"cb": object()})
    with pytest.raises(ResultsError, match="metric name"):
        run.record("", 1.0)
    assert isinstance(ResultsError("x"), MlxbunError)
    assert store.count() == 0  # nothing half-written
    with pytest.raises(ResultsError, match="no results table"):
        open_results(db.with_name("missing.sqlite"), create=False)


def test_model_identity_of_a_hub_snapshot_and_a_runtime_model(tmp_path):
    from mlxbun.models.mlxlm import load_mlxlm
    from mlxbun.zoo import make_checkpoint

    path = make_checkpoint("llama", tmp_path / "hub", quant=4, hf_cache=True)
    ident = model_identity(path)
    assert ident["model_fingerprint"] == f"hf:mlxbun/tiny-llama-q4@{path.name}"
    assert ident["model_type"] == "llama" and ident["model_quant"] == "affine 4-bit g64"
    assert ident["model_path"] == str(path)
    assert model_identity(load_mlxlm(path)) == ident
    assert model_identity(None) == dict.fromkeys(ident)
    with pytest.raises(MlxbunError, match="unknown key"):
        model_identity({"colour": "red"})
    env = environment()
    assert env["backend"] == "cpu" and env["mlx_version"] == mx.__version__


# ---------------------------------------------------------------- export


def test_export_markdown_and_csv(db):
    store = open_results(db)
    run = store.new_run("exp|pipe", params={"note": "a|b"})
    run.record("m1", 1.0 / 3.0, "s")
    run.record("m2", 2.0)
    md = store.export("md", columns=["experiment", "metric", "value", "unit", "params"])
    lines = md.strip().splitlines()
    assert lines[0] == "| experiment | metric | value | unit | params |"
    assert lines[1] == "|:---|:---|---:|:---|:---|"
    assert lines[2] == '| exp\\|pipe | m1 | 0.333333 | s | {"note": "a\\|b"} |'
    assert len(lines) == 4

    back = pd.read_csv(io.StringIO(store.export("csv")))
    assert list(back.columns) == list(COLUMNS)
    assert back["value"].tolist() == [1.0 / 3.0, 2.0]  # full precision
    assert back["timestamp"].str.contains("T").all()
    assert store.export("csv", metric="m2").count("\n") == 2
    with pytest.raises(ResultsError, match="format"):
        store.export("xlsx")
    with pytest.raises(ResultsError, match="unknown column"):
        store.export("md", columns=["nope"])


# ---------------------------------------------------------------- concurrency


def _writer(path, writer, n, start):
    from mlxbun.results import open_results

    with open_results(path) as store:
        run = store.new_run("concurrent", params={"writer": writer})
        start.wait(60)  # every writer is ready: the appends below race each other
        for i in range(n):
            run.record("i", i, i=i)


def test_concurrent_processes_lose_nothing(db):
    n, writers = 1000, 2
    ctx = mp.get_context("spawn")  # no fork of a process that has mlx threads running
    start = ctx.Barrier(writers)
    procs = [ctx.Process(target=_writer, args=(str(db), w, n, start)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * writers
    df = open_results(db).load(expand_params=True)
    assert len(df) == n * writers
    for w in range(writers):
        assert sorted(df.loc[df["params.writer"] == w, "params.i"]) == list(range(n))
    assert df["id"].is_unique


# ---------------------------------------------------------------- refusing foreign files


def _other_app_db(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.commit()
    conn.close()


def _corrupt_sqlite(path):
    """A real SQLite header followed by garbage pages."""
    _other_app_db(path)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(1)
    data[100:] = rng.integers(0, 256, len(data) - 100, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def _newer_schema(path):
    with open_results(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("UPDATE mlxbun_schema SET version = 99")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()),
     "not an SQLite database"),
    (lambda p: p.write_text("name,value\nx,1\n"), "not an SQLite database"),
    (_other_app_db, "another application.*customers"),
    (_corrupt_sqlite, "corrupt SQLite database"),
    (_newer_schema, "newer"),
], ids=["random-bytes", "csv-file", "other-app-sqlite", "corrupt-sqlite", "newer-schema"])
def test_foreign_files_are_refused_and_left_untouched(tmp_path, make, message):
    path = tmp_path / "results.sqlite"
    make(path)
    before = path.read_bytes()
    with pytest.raises(ResultsError, match=message) as err:
        open_results(path)
    assert str(path) in str(err.value)
    with pytest.raises(ResultsError):
        record("e", "m", 1.0, path=path)
    assert path.read_bytes() == before


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(ResultsError, match="is a directory"):
        open_results(tmp_path)


# ---------------------------------------------------------------- CLI


@pytest.fixture
def run_cli():
    """`mlxbun`'s real entry point (the results command as cli.py registers it)."""
    return cli.main


def test_cli_show_and_export(db, tmp_path, run_cli, capsys):
    store = open_results(db)
    run = store.new_run("cli-exp", model={"model_type": "llama"}, params={"bits": 4})
    for i in range(5):
        run.record("tps", 10.0 + i, "tok/s")
    store.new_run("other").record("x", 1.0)
    store.close()

    assert run_cli(["results", "show", "--results", str(db), "--experiment", "cli-exp", "--last", "2"]) == 0
    out = capsys.readouterr().out
    assert "13" in out and "14" in out and "bits=4" in out and "llama" in out
    assert out.count("tok/s") == 2  # only the newest two rows

    target = tmp_path / "out.csv"
    assert run_cli(["results", "export", "--format", "csv", "--results", str(db), "--metric", "tps",
                    "--out", str(target)]) == 0
    df = pd.read_csv(target)
    assert df["value"].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]

    assert run_cli(["results", "export", "--format", "md", "--results", str(db), "--experiment", "other"]) == 0
    md = capsys.readouterr().out.strip().splitlines()
    assert md[0].startswith("| id | run_id |") and len(md) == 3


def test_cli_missing_and_foreign_files(tmp_path, run_cli, capsys):
    missing = tmp_path / "none.sqlite"
    assert run_cli(["results", "show", "--results", str(missing)]) == 0
    assert "No results table" in capsys.readouterr().out
    assert not missing.exists()
    assert run_cli(["results", "export", "--results", str(missing)]) == 1
    assert "no results table" in capsys.readouterr().err

    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"\x00\x01garbage" * 100)
    assert run_cli(["results", "show", "--results", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an SQLite database" in err and str(bad) in err


def test_model_identity_of_an_mlxbun_graph(zoo):
    """An mlxbun graph is an nn.Module, i.e. a dict: it must be read as a model, not as fields."""
    import mlxbun
    from mlxbun.results.identity import model_identity

    ident = model_identity(mlxbun.open_model(zoo("qwen3", quant=4)))
    assert ident["model_type"] == "qwen3"
    assert ident["model_path"].endswith("tiny-qwen3-q4")
    assert ident["model_quant"] and "4" in ident["model_quant"]
