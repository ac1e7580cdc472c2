"""One rank of tests/test_tp_moe_mla.py's launch: `check_tensor_parallel` on every target given,
rank 0 writing the results as one JSON list to the file named first.

    mlx.launch -n 2 --backend ring --python .venv/bin/python tests/tp_moe_mla_worker.py OUT.json TARGET...

A target that does not open (the same error on every rank) is recorded as "error" with its text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

from mlxbun.errors import MlxbunError
from mlxbun.parallel.check import check_tensor_parallel


def main(out: str, targets: list[str]) -> None:
    group = mx.distributed.init()
    rows = []
    for target in targets:
        try:
            rows.append(check_tensor_parallel(target, group).as_dict())
        except MlxbunError as e:
            rows.append({"target": target, "ranks": group.size(), "status": "error", "reason": str(e)})
    if group.rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
