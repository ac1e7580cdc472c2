"""port_bringup.ipynb: bring a checkpoint up on the universal graph and explain the verdict.

`bringup(model)` runs `mlxbun port`'s steps (coverage, header audit, live mlx-lm oracle, bit-exact
gate, manifest entry), then a layer-by-layer diff and the greedy trajectory diff with top-k, and
`mlxbun explain`'s listing of the forward; rows go to the results table (experiment
"port_bringup"). `Bringup.require_pass()` is what the notebook ends with: a failed or refused port
fails the notebook headless.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.config import load_model_config
from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import optional_tokenizer
from mlxbun.explain import explain
from mlxbun.factory import audit_dry_run, check_target_coverage
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.parity.layer_diff import layer_diff
from mlxbun.parity.oracle import run_trajectory, varied_prompt_ids
from mlxbun.parity.port import port_one, resolve_targets
from mlxbun.parity.trajectory_diff import compare_trajectories

__all__ = ["Bringup", "bringup"]


@dataclass
class Bringup:
    """Everything port_bringup.ipynb shows for one checkpoint (side a of the diffs: mlxbun,
    side b: mlx-lm, the reference)."""

    target: str
    path: Path
    port: Any  # mlxbun.parity.port.PortResult: coverage / audit / trajectory / verdict summary
    coverage: Any = None  # CoverageReport (None when the profile refused first)
    audit: Any = None  # AuditReport from safetensors headers
    layer_diff: Any = None  # LayerDiff (None when refused)
    trajectory: Any = None  # TrajectoryDiff, a = mlx-lm (base), b = mlxbun
    explanation: Any = None  # `mlxbun explain`'s listing of the forward (None when refused)
    manifest: dict | None = None  # the golden manifest entry as written
    manifest_path: str | None = None
    run_id: str | None = None
    tokenizer: Any = field(default=None, repr=False)  # the checkpoint's, for token texts (None: ids only)

    @property
    def verdict(self) -> str:
        return self.port.verdict

    def require_pass(self) -> None:
        """Refuse unless the port passed (bit-exact): what the notebook ends with, so a failed or
        refused bring-up fails `mlxbun lab run` instead of rendering a red table."""
        if self.port.verdict != "pass":
            where = f" (first divergence: {self.port.first_divergence['path']})" if self.port.first_divergence else ""
            raise MlxbunError(f"{self.target}: port {self.port.verdict}: {self.port.reason}{where}")

    def coverage_table(self):
        """One row per config key: how the universal graph treats it."""
        import pandas as pd

        rows = []
        c = self.coverage
        if c is not None:
            rows += [(k, "understood", "") for k in c.understood]
            rows += [(k, "harmless", "") for k in c.harmless]
            rows += [(k, "ignored", why) for k, why in c.ignored.items()]
            rows += [(k, "unknown (neutral value)", "") for k in c.unknown]
            rows += [(k, "offending", why) for k, why in c.offending.items()]
        return pd.DataFrame(rows, columns=["key", "status", "note"])

    def audit_table(self):
        """One row per tensor: consumed / dropped (with the rule) / missing / unconsumed / mismatched."""
        import pandas as pd

        rows = []
        a = self.audit
        if a is not None:
            rows += [(n, "consumed", "") for n in a.consumed]
            rows += [(n, "dropped", why) for n, why in a.dropped.items()]
            rows += [(n, "missing", "") for n in a.missing]
            rows += [(n, "unconsumed", "") for n in a.unconsumed]
            rows += [(m.name, "mismatched", f"want {m.want}, have {m.have}") for m in a.mismatched]
        return pd.DataFrame(rows, columns=["tensor", "status", "note"])

    def steps_table(self):
        """The port's steps and verdict as a two-column table."""
        import pandas as pd

        p = self.port
        rows = [("target", p.target), ("model_type", p.model_type), ("dtype", p.dtype),
                ("coverage", p.coverage), ("audit", p.audit), ("trajectory", p.trajectory),
                ("max |diff|", p.max_abs_diff), ("verdict", p.verdict), ("reason", p.reason)]
        if p.first_divergence:
            rows.append(("first divergence", p.first_divergence.get("path")))
        if p.note:
            rows.append(("note", p.note))
        return pd.DataFrame(rows, columns=["step", "result"]).set_index("step")

    def heatmap(self, step: int | None = None):
        """Units x sub-steps -> max |mlxbun - mlx-lm| (rows with no comparable cell dropped)."""
        if self.layer_diff is None:
            raise MlxbunError(f"{self.target}: no layer diff ({self.port.verdict}: {self.port.reason})")
        return self.layer_diff.heatmap(step).dropna(how="all")

    def states(self):
        """A hybrid's recurrent states after each diffed step: per layer and slot, both sides' L2
        norm and max |mlxbun - mlx-lm| (empty for a model without recurrent layers)."""
        if self.layer_diff is None:
            raise MlxbunError(f"{self.target}: no layer diff ({self.port.verdict}: {self.port.reason})")
        return self.layer_diff.state_table


def bringup(model: str = "zoo:llama", *, variant: str = "float32", decode_steps: int = 8, prompt_len: int = 24,
            diff_decode_steps: int = 2, top_k: int = 5, goldens_dir=None, results_path=None,
            record: bool = True) -> Bringup:
    """Port one checkpoint (`mlxbun port`'s steps: coverage, header audit, live mlx-lm oracle,
    bit-exact gate, manifest entry), then explain the verdict: a layer-by-layer diff of the
    prefill and `diff_decode_steps` decode steps, and the greedy trajectory diff with top-k.

    `goldens_dir=None` writes the manifest entry to a temporary directory (shown, not kept).
    """
    if decode_steps < 1 or prompt_len < 2 or diff_decode_steps < 0:
        raise MlxbunError("decode_steps must be >= 1, prompt_len >= 2 and diff_decode_steps >= 0")
    target = resolve_targets([str(model)], variants=(variant,))[0]
    tmp = None if goldens_dir is not None else tempfile.mkdtemp(prefix="mlxbun-goldens-")
    try:
        port = port_one(target, decode_steps=decode_steps, prompt_len=prompt_len, goldens_dir=goldens_dir or tmp)
        manifest = json.loads(Path(port.manifest).read_text()) if port.manifest else None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Bringup(target=target.label, path=target.path, port=port, manifest=manifest,
                  manifest_path=port.manifest if goldens_dir is not None else None)
    config = None
    with contextlib.suppress(MlxbunError):  # a refusal is reported by `port`; the tables stay empty
        config = load_model_config(target.path)
        out.coverage = check_target_coverage(config, target.path)
        out.audit = audit_dry_run(target.path, config)
        out.explanation = explain(target.path)
    if port.verdict != "refused" and config is not None:
        candidate, oracle = open_runtime(target.path, "mlxbun"), open_runtime(target.path, "mlx-lm")
        # the prompt the gate used: a varied trajectory where one exists (see varied_prompt_ids)
        prompt, ot = varied_prompt_ids(oracle, config.vocab_size, length=prompt_len, decode_steps=decode_steps)
        ct = run_trajectory(candidate, prompt, decode_steps)
        out.tokenizer = optional_tokenizer(target.path)
        out.trajectory = compare_trajectories(ot, ct, tokenizer=out.tokenizer, k=top_k)
        out.layer_diff = layer_diff(candidate, oracle, prompt, ot.greedy_ids[:diff_decode_steps])
    params = {"target": target.label, "variant": target.variant, "decode_steps": decode_steps,
              "prompt_len": prompt_len, "verdict": port.verdict}
    with recording("port_bringup", model=target.path, params=params, results_path=results_path,
                   record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            rows = [("verdict_pass", float(port.verdict == "pass"), None, {"reason": port.reason})]
            if port.max_abs_diff is not None:
                rows.append(("max_abs_diff", port.max_abs_diff, None))
            if out.coverage is not None:
                rows.append(("coverage_keys", len(out.coverage.understood), "keys"))
            if out.audit is not None:
                rows.append(("tensors_consumed", len(out.audit.consumed), "tensors"))
            if out.layer_diff is not None:
                diffs = [r["max_abs_diff"] for r in out.layer_diff.records if r["max_abs_diff"] is not None]
                rows.append(("layer_diff_max", max(diffs, default=math.nan), None))
                recs = out.layer_diff.records
                both = [r for r in recs if r["a"] is not None and r["b"] is not None]
                rows.append(("modules_differing", sum(not r["equal"] for r in both), "outputs"))
                rows.append(("modules_one_side", len(recs) - len(both), "outputs"))
                state_diffs = [s["max_abs_diff"] for s in out.layer_diff.states]
                if state_diffs:  # a hybrid: its recurrent states, compared after each step
                    rows.append(("state_diff_max", max((math.nan if d is None else d for d in state_diffs)),
                                 None, {"slots": len(state_diffs)}))
            if out.trajectory is not None and out.trajectory.first_divergence is not None:
                rows.append(("trajectory_first_divergence", out.trajectory.first_divergence, "step"))
            run.record_many(rows)
    return out


