"""logit_diff.ipynb: two configurations of a model (weights and/or KV cache) compared with
llama.cpp-style KLD statistics over the same teacher-forced text (experiment "logit_diff")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer, same_weights
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.names import KVSettings
from mlxbun.parity.forced import eval_ids, teacher_forced
from mlxbun.parity.metrics import compare_logits

__all__ = ["LogitDiff", "Side", "logit_diff"]


@dataclass(frozen=True)
class Side:
    """One configuration of a model: checkpoint (a model name; `variant` and `head_dim` are the
    zoo's options and mean nothing for another model, whose weights and heads are what they are),
    engine (mlxbun's graph or mlx-lm's) and KV cache."""

    model: str = "zoo:llama"
    variant: str = "float32"
    head_dim: int | None = None
    engine: str = "mlxbun"
    kv: KVSettings = field(default_factory=KVSettings)

    @property
    def zoo(self) -> bool:
        return str(self.model).startswith("zoo:")

    @property
    def path(self) -> Path:
        return model_path(self.model, variant=self.variant, head_dim=self.head_dim if self.zoo else None)

    @property
    def label(self) -> str:
        name = str(self.model) + (f"/{self.variant}" if self.zoo else "")
        if self.head_dim is not None and self.zoo:
            name += f" hd{self.head_dim}"
        return f"{name} [{self.engine}] kv={self.kv.label}"

    def as_params(self) -> dict:
        return {"model": self.model, "variant": self.variant, "head_dim": self.head_dim, "engine": self.engine,
                "kv": self.kv.label}


@dataclass
class LogitDiff:
    base: Side
    new: Side
    stats: Any  # mlxbun.parity.metrics.KLDStats (new against base)
    ids: list[int]
    prefill: int
    run_id: str | None = None

    def table(self):
        return self.stats.as_table()

    def per_position(self):
        return self.stats.per_position()


def logit_diff(base: Side, new: Side, *, n_tokens: int = 128, prefill: int = 32, comparison: str | None = None,
               text: str | None = None, allow_identical: bool = False, results_path=None,
               record: bool = True) -> LogitDiff:
    """KLD statistics of `new` against `base` over the same text (`text`, None: the zoo corpus),
    teacher-forced as decode (see `mlxbun.parity.forced.teacher_forced`): the first `prefill` ids
    are context, the other positions are scored against the actual next token (so delta-p and
    perplexities are reported too). Two sides that are the same configuration (same checkpoint,
    or two directories holding the same bytes, with the same engine and KV cache: e.g. zoo variants
    asked of a real model) are refused unless `allow_identical` (a self-check: every statistic must
    then be exact)."""
    pa, pb = base.path, new.path
    if (base.engine, base.kv) == (new.engine, new.kv) and not allow_identical:
        if pa == pb:
            raise MlxbunError(f"both sides are {base.label} at {pa}: nothing would be compared (for a model "
                              "other than the zoo, give the new side its own checkpoint, e.g. an `mlxbun "
                              "import gguf --quant none` of the same file)")
        if same_weights(pa, pb):
            raise MlxbunError(f"{pa} and {pb} hold byte-identical config.json and weights: nothing would be "
                              "compared (an `import gguf --quant 4|8` re-quantizes only the tensor types it "
                              "dequantizes; Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K stay as shipped)")
    tok = optional_tokenizer(pa)
    if tok is None:
        raise MlxbunError(f"{pa}: no tokenizer to encode the evaluation text")
    ids = eval_ids(tok, n_tokens, text)
    ra = teacher_forced(open_runtime(pa, base.engine), ids, prefill=prefill, kv=base.kv)
    rb = teacher_forced(open_runtime(pb, new.engine), ids, prefill=prefill, kv=new.kv)
    if ra.logits.shape != rb.logits.shape:
        raise MlxbunError(f"{base.label} and {new.label} give logits of different shapes "
                          f"{tuple(ra.logits.shape)} vs {tuple(rb.logits.shape)}")
    stats = compare_logits(ra.logits, rb.logits, ra.next_tokens)
    out = LogitDiff(base=base, new=new, stats=stats, ids=ids, prefill=prefill)
    params = {"comparison": comparison or f"{base.label} vs {new.label}", "base": base.as_params(),
              "new": new.as_params(), "n_tokens": n_tokens, "prefill": prefill}
    with recording("logit_diff", model=pb, params=params, results_path=results_path, record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            run.record_many(stats.as_rows())
    return out


