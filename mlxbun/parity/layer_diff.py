"""Layer-by-layer comparison of two models on the same ids: a full report, not just the first difference.

Both sides run the same forwards under layer taps (`mlxbun.parity.localize`:
the prefill, then optional one-token decode steps, each side on its own
cache). For every tapped module output, in execution order, the report holds
each side's shape, dtype, mean, std, min and max, and the max |a - b|:

- `LayerDiff.table`: one row per (step, module path, call) - a flat pandas
  DataFrame;
- `LayerDiff.heatmap()`: units (embedding, each block, final norm, head,
  logits) x sub-steps (norm / attention / mlp / ... / output) -> max |diff|,
  ready for `imshow`;
- `LayerDiff.tree`: the same records nested by module path, in the shape of
  transformers' model-addition debugger dump (`module_path`, `outputs`,
  `children`), JSON-ready via `to_json()`;
- `LayerDiff.state_table` / `state_heatmap()`: a hybrid's recurrent states after
  each step (`parity.states`): per layer and slot, both sides' L2 norm and the
  max |a - b|; layers x steps -> max |diff|.

Side "a" is the candidate, side "b" the reference (as in `first_divergence`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from mlxbun.config_reader import json_safe
from mlxbun.models.taps import Taps, block_paths, layer_index_of, substep_of
from mlxbun.parity.compare import bit_equal, max_abs_diff
from mlxbun.parity.localize import merged_order, tapped_steps
from mlxbun.parity.states import cache_layers_of, state_cells, state_records

__all__ = ["LayerDiff", "layer_diff", "summarize"]

LOGITS = "logits"  # the models' own return value (head ops outside the taps included)


def _dtype(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def summarize(x: mx.array | None) -> dict[str, Any] | None:
    """shape, dtype, and float32 mean / std / min / max of one tensor (None stays None)."""
    if x is None:
        return None
    out: dict[str, Any] = {"shape": list(x.shape), "dtype": _dtype(x)}
    if x.size == 0:
        return {**out, "mean": None, "std": None, "min": None, "max": None}
    x32 = x.astype(mx.float32)
    vals = mx.stack([mx.mean(x32), mx.std(x32), mx.min(x32), mx.max(x32)]).tolist()
    return {**out, **dict(zip(("mean", "std", "min", "max"), (float(v) for v in vals)))}


def _record(step: int, order: int, path: str, call: int, xa: mx.array | None, xb: mx.array | None,
            blocks: list[str]) -> dict[str, Any]:
    both = xa is not None and xb is not None
    return {
        "step": step, "order": order, "path": path, "call": call,
        "layer": None if path == LOGITS else layer_index_of(path, blocks),
        "substep": "head" if path == LOGITS else substep_of(path, blocks),
        "a": summarize(xa), "b": summarize(xb),
        "equal": both and bit_equal(xa, xb),
        "max_abs_diff": max_abs_diff(xa, xb) if both else None,
    }


def _compare_step(ta: Taps, tb: Taps, la: mx.array, lb: mx.array, step: int, start: int) -> list[dict[str, Any]]:
    blocks = block_paths([(p, None) for p in set(ta.called()) | set(tb.called())])
    out = []
    for path, k in merged_order(ta, tb):
        xa = ta[path][k] if path in ta and k < len(ta[path]) else None
        xb = tb[path][k] if path in tb and k < len(tb[path]) else None
        if (xb is None and path in ta.observers) or (xa is None and path in tb.observers):
            continue  # a module only mlxbun's tree has (an MoE router): nothing to compare
        out.append(_record(step, start + len(out), path, k, xa, xb, blocks))
    out.append(_record(step, start + len(out), LOGITS, 0, la, lb, blocks))
    return out


@dataclass
class LayerDiff:
    """Per-module statistics of both sides and their max |diff| (see the module docstring)."""

    records: list[dict[str, Any]]  # execution order, all steps
    root_name: str = "Model"
    states: list[dict[str, Any]] = field(default_factory=list)  # recurrent slots after each step
    _blocks: list[str] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------ flat views

    @property
    def table(self):
        """One row per (step, path, call): layer, substep, both sides' stats, max_abs_diff, equal."""
        import pandas as pd

        rows = []
        for r in self.records:
            row = {k: r[k] for k in ("step", "order", "path", "layer", "substep", "call")}
            for side in ("a", "b"):
                s = r[side] or {}
                for stat in ("shape", "dtype", "mean", "std", "min", "max"):
                    v = s.get(stat)
                    row[f"{stat}_{side}"] = tuple(v) if isinstance(v, list) else v
            row["max_abs_diff"] = r["max_abs_diff"]
            row["equal"] = r["equal"]
            rows.append(row)
        df = pd.DataFrame(rows)
        df["layer"] = df["layer"].astype("Int64")
        df["max_abs_diff"] = df["max_abs_diff"].astype("float64")
        return df

    def _unit(self, path: str, paths: set[str]) -> str:
        """The heatmap row of a path: its block, else its outermost tapped ancestor outside the blocks."""
        if path == LOGITS:
            return LOGITS
        for b in self._blocks:
            if path == b or path.startswith(b + "."):
                return b
        ancestors = {".".join(b.split(".")[:i]) for b in self._blocks for i in range(1, b.count(".") + 1)}
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            q = ".".join(parts[:i])
            if q in paths and q not in ancestors:
                return q
        return path

    def heatmap(self, step: int | None = None):
        """Units (rows, execution order) x sub-steps (columns, 'output' last) -> max |diff| over paths and calls.

        A unit is a block (`model.layers.3`) or a module outside the blocks
        (`model.embed_tokens`, `model.norm`, `lm_head`, 'logits'); its own output
        is the 'output' column, its descendants go under their sub-step label.
        NaN where a cell has no module, or where the shapes differ / one side is missing.
        """
        import pandas as pd

        recs = [r for r in self.records if step is None or r["step"] == step]
        paths = {r["path"] for r in recs}
        cells: dict[tuple[str, str], list[float]] = {}
        row_order: dict[str, int] = {}
        col_order: dict[str, int] = {}
        for r in recs:
            unit = self._unit(r["path"], paths)
            col = "output" if r["path"] == unit else r["substep"]
            row_order.setdefault(unit, r["order"])
            col_order.setdefault(col, len(col_order))
            if r["max_abs_diff"] is not None:
                cells.setdefault((unit, col), []).append(r["max_abs_diff"])
        rows = sorted(row_order, key=row_order.get)
        cols = [c for c in sorted(col_order, key=col_order.get) if c != "output"] + (
            ["output"] if "output" in col_order else [])
        df = pd.DataFrame(math.nan, index=pd.Index(rows, name="unit"), columns=pd.Index(cols, name="substep"))
        for (u, c), v in cells.items():
            df.loc[u, c] = max(v)
        return df

    @property
    def state_table(self):
        """One row per (step, layer, slot) of a recurrent state: shapes, dtypes, L2 norms of both
        sides, max_abs_diff, equal. Empty when neither model keeps one."""
        import pandas as pd

        cols = ["step", "layer", "slot", "shape_a", "shape_b", "dtype_a", "dtype_b", "norm_a", "norm_b",
                "max_abs_diff", "equal"]
        return pd.DataFrame(self.states, columns=cols)

    def state_heatmap(self):
        """Recurrent layers (rows) x steps (columns) -> max |diff| over the layer's state slots."""
        import pandas as pd

        cells = state_cells(self.states)
        layers = sorted({k[0] for k in cells})
        steps = sorted({k[1] for k in cells})
        df = pd.DataFrame(math.nan, index=pd.Index(layers, name="layer"), columns=pd.Index(steps, name="step"))
        for (layer, step), v in cells.items():
            df.loc[layer, step] = v
        return df

    def first_difference(self) -> dict[str, Any] | None:
        """The first record (execution order) that is not bit-equal, None if all are."""
        return next((r for r in self.records if not r["equal"]), None)

    # ------------------------------------------------------------ the tree

    @property
    def tree(self) -> dict[str, Any]:
        """Records nested by module path (transformers model-addition-debugger shape)."""
        nodes: dict[str, dict[str, Any]] = {}
        root: dict[str, Any] = {"module_path": f"{self.root_name} (top-level)", "outputs": [], "children": []}
        for r in self.records:
            entry = {"step": r["step"], "call": r["call"], "a": r["a"], "b": r["b"],
                     "max_abs_diff": r["max_abs_diff"], "equal": r["equal"]}
            if r["path"] == LOGITS:
                root["outputs"].append(entry)
                continue
            node = nodes.get(r["path"])
            if node is None:
                node = nodes[r["path"]] = {"module_path": r["path"], "layer": r["layer"], "substep": r["substep"],
                                           "outputs": [], "children": []}
            node["outputs"].append(entry)
        # Children in execution order of their first record: a parent finishes after its children.
        first = {}
        for r in self.records:
            first.setdefault(r["path"], r["order"])
        for path in sorted(nodes, key=first.get):
            parent = _parent_node(path, nodes) or root
            parent["children"].append(nodes[path])
        for node in [root, *nodes.values()]:
            diffs = [o["max_abs_diff"] for o in node["outputs"]]
            node["max_abs_diff"] = None if not diffs or any(d is None for d in diffs) else max(diffs)
            if not node["children"]:
                node.pop("children")
        if self.states:
            root["recurrent_states"] = self.states
        return root

    def to_json(self, path: Any = None, indent: int = 2) -> str:
        """The tree as JSON (NaN/inf statistics as null); written to `path` when given."""
        text = json.dumps(json_safe(self.tree), indent=indent, allow_nan=False)
        if path is not None:
            from pathlib import Path

            Path(path).write_text(text)
        return text


def _parent_node(path: str, nodes: dict[str, dict]) -> dict | None:
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        node = nodes.get(".".join(parts[:i]))
        if node is not None:
            return node
    return None


def _root_name(model: Any) -> str:
    inner = getattr(model, "module", None)
    return type(inner if inner is not None else model).__name__


def layer_diff(model_a: Any, model_b: Any, prompt_ids: Sequence, decode_ids: Sequence | None = None, *,
               paths: Any = "all") -> LayerDiff:
    """Tap both models on the same forwards and report every module output of both sides.

    `paths` is a tap selection (`mlxbun.models.taps.select_paths`): "all"
    (default: every module), None (blocks and their direct children),
    "layers", a list of module paths, or a predicate.
    """
    records: list[dict[str, Any]] = []
    states: list[dict[str, Any]] = []
    layers = cache_layers_of(model_a, model_b)
    all_paths: set[str] = set()
    for step, ta, tb, la, lb, ca, cb in tapped_steps(model_a, model_b, prompt_ids, decode_ids, paths):
        records += _compare_step(ta, tb, la, lb, step, len(records))
        states += state_records(ca, cb, step, layers)
        all_paths |= set(ta.called()) | set(tb.called())
        del ta, tb  # the step's activations are summarized; free them before the next forward
    return LayerDiff(records=records, root_name=_root_name(model_a), states=states,
                     _blocks=block_paths([(p, None) for p in all_paths]))
