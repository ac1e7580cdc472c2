"""The results table: one embedded SQLite file, one row per measurement.

Every row carries its run's identity (see `identity.py`), the experiment, its
parameters as JSON, and one metric / value / unit. A `Run` captures the
identity once and stamps it on each row it records.

Safety of the file:
- writes are short `BEGIN IMMEDIATE` transactions in WAL mode with a busy
  timeout, so several processes can append at once and none loses a row;
- a file that is not an mlxbun results database (random bytes, another
  format, another application's SQLite db, a newer schema) is refused with a
  `ResultsError` naming the path and is never written to.

Location: the explicit `path`, else `$MLXBUN_RESULTS`, else
`<user cache dir>/mlxbun/results.sqlite`.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from mlxbun.errors import MlxbunError
from mlxbun.results.identity import ENV_COLUMNS, MODEL_COLUMNS, environment, model_identity

__all__ = ["COLUMNS", "SCHEMA_VERSION", "ResultsError", "ResultsStore", "Run", "default_results_path",
           "check_results", "open_results", "record"]

SCHEMA_VERSION = 1
APP_ID = "mlxbun-results"
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 60.0

COLUMNS = ("id", "run_id", "timestamp", "experiment", "metric", "value", "unit", "params",
           *ENV_COLUMNS, *MODEL_COLUMNS)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS mlxbun_schema (
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    created TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    timestamp TEXT NOT NULL,
    experiment TEXT NOT NULL,
    metric TEXT NOT NULL,
    value REAL,
    unit TEXT,
    params TEXT NOT NULL,
    revision TEXT, mlxbun_version TEXT, mlx_version TEXT, mlx_lm_version TEXT,
    backend TEXT, device TEXT, device_name TEXT,
    platform TEXT, cpu TEXT, cpu_count INTEGER, ram_bytes INTEGER,
    model_path TEXT, model_fingerprint TEXT, model_type TEXT, model_quant TEXT
);
CREATE INDEX IF NOT EXISTS measurements_experiment ON measurements (experiment, metric);
CREATE INDEX IF NOT EXISTS measurements_run ON measurements (run_id);
"""
assert all(c in _SCHEMA for c in COLUMNS)


class ResultsError(MlxbunError):
    """The results file is not an mlxbun results database, or a measurement is malformed."""


def default_results_path() -> Path:
    """$MLXBUN_RESULTS, else <user cache dir>/mlxbun/results.sqlite."""
    env = os.environ.get("MLXBUN_RESULTS")
    if env:
        return Path(env).expanduser()
    try:
        from platformdirs import user_cache_dir

        base = Path(user_cache_dir("mlxbun"))
    except ImportError:
        base = Path("~/.cache/mlxbun").expanduser()
    return base / "results.sqlite"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _iso(since: Any) -> str:
    """A filter bound in the stored timestamp format (UTC ISO); naive datetimes are taken as UTC."""
    if isinstance(since, str):
        try:
            since = datetime.fromisoformat(since.replace("Z", "+00:00"))
        except ValueError:
            raise ResultsError(f"since={since!r}: not an ISO date/time") from None
    if hasattr(since, "to_pydatetime"):  # pandas Timestamp
        since = since.to_pydatetime()
    if not isinstance(since, datetime):
        raise ResultsError(f"since={since!r}: give a datetime or an ISO string")
    if since.tzinfo is None:
        since = since.replace(tzinfo=timezone.utc)
    return since.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _jsonable(obj: Any) -> Any:
    """json.dumps fallback: numpy / mlx scalars, paths, sets, dataclass-likes."""
    if isinstance(obj, os.PathLike):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if hasattr(obj, "item") and getattr(obj, "size", 1) == 1:  # numpy / mlx scalar
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _params_json(params: Mapping[str, Any] | None, where: str) -> str:
    if params is None:
        return "{}"
    if not isinstance(params, Mapping):
        raise ResultsError(f"{where}: params must be a mapping, got {type(params).__name__}")
    bad = [k for k in params if not isinstance(k, str)]
    if bad:
        raise ResultsError(f"{where}: parameter names must be strings, got {bad}")
    try:
        return json.dumps(dict(params), sort_keys=True, default=_jsonable)
    except (TypeError, ValueError) as e:
        culprit = next((k for k, v in params.items() if not _dumps_ok(v)), "?")
        raise ResultsError(f"{where}: parameter '{culprit}' is not JSON serializable ({e})") from None


def _dumps_ok(v: Any) -> bool:
    try:
        json.dumps(v, default=_jsonable)
        return True
    except (TypeError, ValueError):
        return False


def _as_value(value: Any, metric: str) -> float:
    try:
        if hasattr(value, "item"):
            value = value.item()
        out = float(value)
    except (TypeError, ValueError):
        raise ResultsError(f"metric '{metric}': value {value!r} is not a real number") from None
    return out


# ---------------------------------------------------------------- opening


def _check_file(path: Path) -> None:
    """Refuse (before any connection) a file that cannot be an SQLite database."""
    if path.is_dir():
        raise ResultsError(f"{path}: is a directory, not a results database file")
    if not path.exists() or path.stat().st_size == 0:
        return  # new (or empty) file: nothing to overwrite
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise ResultsError(f"{path}: cannot read the results database ({e.strerror})") from None
    if head != SQLITE_MAGIC:
        raise ResultsError(f"{path}: not an SQLite database (refusing to use or overwrite it); "
                           "point --results / $MLXBUN_RESULTS at another file")


def _check_schema(conn: sqlite3.Connection, path: Path) -> bool:
    """True when the file already holds the mlxbun schema, False when it is an empty database."""
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.OperationalError as e:  # locked past the timeout, no permission, I/O error
        raise ResultsError(f"{path}: cannot read the results database ({e})") from None
    except sqlite3.DatabaseError as e:  # SQLITE_NOTADB / SQLITE_CORRUPT
        raise ResultsError(f"{path}: corrupt SQLite database ({e}); refusing to use it") from None
    tables.discard("sqlite_sequence")
    if not tables:
        return False
    if "mlxbun_schema" not in tables:
        raise ResultsError(f"{path}: an SQLite database of another application (tables: "
                           f"{', '.join(sorted(tables)[:8])}); refusing to use it as the results table")
    try:
        rows = conn.execute("SELECT app, version FROM mlxbun_schema").fetchall()
    except sqlite3.DatabaseError as e:
        raise ResultsError(f"{path}: corrupt mlxbun_schema table ({e}); refusing to use it") from None
    if len(rows) != 1 or rows[0][0] != APP_ID or "measurements" not in tables:
        raise ResultsError(f"{path}: mlxbun_schema table present but not an mlxbun results database "
                           f"(rows {rows[:3]}, tables {sorted(tables)}); refusing to use it")
    version = rows[0][1]
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ResultsError(f"{path}: results schema version {version} is newer than this mlxbun's "
                           f"({SCHEMA_VERSION}); upgrade mlxbun to read it")
    return True


def _connect(path: Path) -> sqlite3.Connection:
    _check_file(path)
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise ResultsError(f"{path}: cannot open the results database ({e})") from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if not _check_schema(conn, path):
            _create(conn, path)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    except sqlite3.Error as e:
        conn.close()
        raise ResultsError(f"{path}: cannot open the results database ({e})") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _create(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema; a concurrent creator may have won the race, which is fine."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Re-check under the write lock: another process may have created it meanwhile.
            if not _check_schema(conn, path):
                # One statement at a time: executescript() would COMMIT the open transaction first.
                for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                    conn.execute(stmt)
                conn.execute("INSERT INTO mlxbun_schema (app, version, created) VALUES (?, ?, ?)",
                             (APP_ID, SCHEMA_VERSION, _now()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as e:
        raise ResultsError(f"{path}: cannot create the results schema ({e})") from None


# ---------------------------------------------------------------- store


class ResultsStore:
    """An open results database: `new_run(...)` to write, `load(...)` / `export(...)` to read."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        self.path = Path(path).expanduser().absolute()
        if not self.path.exists():
            if not create:
                raise ResultsError(f"{self.path}: no results table there (nothing recorded yet)")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ResultsError(f"{self.path}: cannot create its directory ({e.strerror})") from None
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = _connect(self.path)

    def __repr__(self) -> str:
        return f"ResultsStore({str(self.path)!r})"

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ResultsError(f"{self.path}: the results store is closed")
        return self._conn

    # ------------------------------------------------------------ write

    def new_run(self, experiment: str, *, model: Any = None, params: Mapping[str, Any] | None = None) -> "Run":
        """A run of `experiment`: captures the code/machine/model identity once for all its rows."""
        if not isinstance(experiment, str) or not experiment.strip():
            raise ResultsError(f"experiment name must be a non-empty string, got {experiment!r}")
        _params_json(params, f"experiment '{experiment}'")  # refuse bad params now, not at the first record
        return Run(self, experiment, model=model, params=params)

    def _insert(self, rows: Iterable[dict[str, Any]]) -> list[int]:
        cols = [c for c in COLUMNS if c != "id"]
        sql = f"INSERT INTO measurements ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        ids = []
        with self._lock:
            conn = self.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for row in rows:
                        ids.append(conn.execute(sql, [row.get(c) for c in cols]).lastrowid)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise ResultsError(f"{self.path}: writing a measurement failed ({e})") from None
        return ids

    # ------------------------------------------------------------ read

    def count(self) -> int:
        with self._lock:
            return int(self.conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])

    def load(self, experiment: str | Iterable[str] | None = None, metric: str | Iterable[str] | None = None,
             model_type: str | Iterable[str] | None = None, run_id: str | Iterable[str] | None = None,
             since: Any = None, *, last: int | None = None, expand_params: bool = False):
        """The matching rows (oldest first) as a pandas DataFrame.

        Filters take one value or a list. `since` is a datetime or ISO string
        (naive = UTC). `last` keeps the newest N rows. `expand_params` adds one
        `params.<name>` column per parameter (nested dicts flattened with ".").
        """
        import pandas as pd

        where, args = [], []
        for col, val in (("experiment", experiment), ("metric", metric), ("model_type", model_type),
                         ("run_id", run_id)):
            if val is None:
                continue
            vals = [val] if isinstance(val, str) else list(val)
            where.append(f"{col} IN ({', '.join('?' * len(vals))})")
            args += vals
        if since is not None:
            where.append("timestamp >= ?")
            args.append(_iso(since))
        sql = f"SELECT {', '.join(COLUMNS)} FROM measurements"
        if where:
            sql += " WHERE " + " AND ".join(where)
        if last is not None:
            if int(last) < 0:
                raise ResultsError(f"last={last}: must be >= 0")
            sql = f"SELECT * FROM ({sql} ORDER BY id DESC LIMIT {int(last)})"
        sql += " ORDER BY id"
        with self._lock:
            try:
                rows = self.conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise ResultsError(f"{self.path}: reading results failed ({e})") from None
        df = pd.DataFrame.from_records(rows, columns=list(COLUMNS))
        df["value"] = pd.to_numeric(df["value"], errors="coerce").astype("float64")  # NULL (NaN) -> NaN
        df["timestamp"] = pd.to_datetime(df["timestamp"], utc=True, format="ISO8601")
        if expand_params and len(df):
            expanded = pd.json_normalize([json.loads(p) for p in df["params"]], sep=".")
            expanded.columns = [f"params.{c}" for c in expanded.columns]
            expanded.index = df.index
            df = pd.concat([df, expanded], axis=1)
        return df

    def export(self, fmt: str = "md", *, columns: Iterable[str] | None = None, expand_params: bool = False,
               **filters: Any) -> str:
        """The matching rows as CSV or a Markdown table (filters as in `load`)."""
        from mlxbun.results.export import to_csv, to_markdown

        fmt = fmt.lower()
        if fmt not in ("md", "markdown", "csv"):
            raise ResultsError(f"export format '{fmt}': use 'csv' or 'md'")
        df = self.load(expand_params=expand_params, **filters)
        if columns is not None:
            columns = list(columns)
            unknown = [c for c in columns if c not in df.columns]
            if unknown:
                raise ResultsError(f"unknown column(s) {unknown}; known: {list(df.columns)}")
            df = df[columns]
        return to_csv(df) if fmt == "csv" else to_markdown(df)


class Run:
    """One run of an experiment: identity captured at creation, stamped on every row."""

    def __init__(self, store: ResultsStore, experiment: str, *, model: Any = None,
                 params: Mapping[str, Any] | None = None):
        self.store = store
        self.experiment = experiment
        self.params = dict(params or {})
        started = datetime.now(timezone.utc)
        self.run_id = f"{started:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
        self.identity = {**environment(), **model_identity(model)}

    def __repr__(self) -> str:
        return f"Run({self.run_id}, {self.experiment!r})"

    def _row(self, metric: str, value: float, unit: str | None, params_extra: Mapping[str, Any]) -> dict:
        if not isinstance(metric, str) or not metric.strip():
            raise ResultsError(f"experiment '{self.experiment}': metric name must be a non-empty string, "
                               f"got {metric!r}")
        if unit is not None and not isinstance(unit, str):
            raise ResultsError(f"metric '{metric}': unit must be a string, got {unit!r}")
        params = {**self.params, **params_extra}
        return {"run_id": self.run_id, "timestamp": _now(), "experiment": self.experiment, "metric": metric,
                "value": value, "unit": unit, "params": _params_json(params, f"metric '{metric}'"),
                **self.identity}

    def record(self, metric: str, value: Any, unit: str | None = None, **params_extra: Any) -> int:
        """Append one measurement (extra keyword parameters join the run's params); returns the row id."""
        return self.store._insert([self._row(metric, _as_value(value, metric), unit, params_extra)])[0]

    def record_many(self, rows: Iterable[tuple]) -> list[int]:
        """Append (metric, value[, unit[, params_extra]]) tuples in one transaction."""
        built = []
        for r in rows:
            r = tuple(r)
            metric, value = r[0], r[1]
            unit, extra = (r[2] if len(r) > 2 else None), (r[3] if len(r) > 3 else None)
            built.append(self._row(metric, _as_value(value, metric), unit, extra or {}))
        return self.store._insert(built)

    def record_failure(self, message: str, **params_extra: Any) -> int:
        """A failed measurement: metric "error", value NaN, the message in params["error"]."""
        return self.store._insert([self._row("error", math.nan, None, {**params_extra, "error": str(message)})])[0]


def check_results(path: str | os.PathLike | None = None) -> Path:
    """Refuse, before any work and creating nothing, a results path `open_results` would refuse:
    an existing file is opened (it must be an mlxbun results database); a missing one must be
    creatable (the nearest existing directory above it writable), and is created only when the
    run records. Returns the path."""
    from mlxbun.atomic import unwritable

    p = Path(default_results_path() if path is None else path).expanduser().absolute()
    if p.exists() or p.is_symlink():
        open_results(p, create=False).close()
    elif why := unwritable(p):
        raise ResultsError(f"{p}: cannot create the results database: {why}")
    return p


def open_results(path: str | os.PathLike | None = None, *, create: bool = True) -> ResultsStore:
    """Open (creating when missing, unless create=False) the results database."""
    return ResultsStore(default_results_path() if path is None else path, create=create)


def record(experiment: str, metric: str, value: Any, unit: str | None = None, *, model: Any = None,
           params: Mapping[str, Any] | None = None, path: str | os.PathLike | None = None) -> str:
    """One measurement in one call (a run of one row); returns the run id."""
    with open_results(path) as store:
        run = store.new_run(experiment, model=model, params=params)
        run.record(metric, value, unit)
        return run.run_id
