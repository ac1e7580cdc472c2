"""The results table: every measurement as one row of an embedded SQLite database.

    from mlxbun.results import open_results
    store = open_results()                       # $MLXBUN_RESULTS or the user cache dir
    run = store.new_run("kv-quant", model=model, params={"bits": 4})
    run.record("decode_tps", 41.2, "tok/s")
    store.load(experiment="kv-quant")            # pandas DataFrame
"""

from mlxbun.results.identity import environment, model_identity
from mlxbun.results.store import (
    COLUMNS,
    SCHEMA_VERSION,
    ResultsError,
    ResultsStore,
    Run,
    check_results,
    default_results_path,
    open_results,
    record,
)

__all__ = [
    "COLUMNS", "SCHEMA_VERSION", "ResultsError", "ResultsStore", "Run", "default_results_path", "environment",
    "check_results", "model_identity", "open_results", "record",
]
