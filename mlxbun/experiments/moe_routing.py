"""moe_routing.ipynb: what an MoE model's routers do over a text, and how far two configurations
of it agree on the experts they choose (experiment "moe_routing").

The text's ids go through mlxbun's graph in one teacher-forced forward (every position sees the
actual previous tokens: what decoding that text computes, all at once) with every router tapped
(`mlxbun.models.taps`: a `Router` returns a `Routing` of the chosen experts, their weights and
the gate logits). Per MoE layer (a dense layer has no router and no row):

- load: how many of the text's tokens each expert takes, counting each of the k slots (a layer's
  load sums to tokens x k); imbalance = the busiest expert's load over the mean load (1: even);
- entropy (nats) of the router's probability distribution p over all E experts, per token
  H = -sum_e p_e ln p_e (0 ln 0 = 0), averaged over the tokens: 0 when one expert holds all the
  mass, ln E when the router is uniform. p per router kind (`ROUTER_PROBS`): the softmax routers
  (softmax_topk, topk_softmax, topk_softmax_f32) p = softmax(logits) over all experts, whether the
  kind takes its softmax before choosing or over the k chosen; the sigmoid router (noaux_tc)
  p = sigmoid(logits) / sum_e sigmoid(logits), the correction bias left out (it moves the
  choice, never the weights; so minimax's sigmoid_corrected, step3p5's sigmoid_eps and Klear's
  sigmoid_biased too); bailing_moe's grouped_score router: softmax or normalized sigmoid as its
  `score` number says, afmoe's scored_grouped as its `score_func`, ernie's f32_act_topk as its
  `act`, laguna's capped_score its normalized score (sigmoid or sqrt(softplus)) of the softcapped
  logits; phimoe's sparsemixer: softmax over all experts (its first round's band, unbanded). In
  float64 from the logits the gate returned;
- top-k mass: sum of p over the k chosen experts, i.e. before any top-k renormalization or
  routed scaling (1 when k = E; the chosen need not be p's top k: noaux_tc chooses with its bias
  and groups);
- weight sum: sum of the weights the block multiplies the chosen experts' outputs by, after
  renormalization and scaling (1 for a renormalizing softmax router, routed_scaling_factor for a
  renormalizing noaux_tc one).

Two sides (e.g. float32 vs q4 weights of one model) over the same ids, per layer: the fraction of
tokens whose chosen expert SET is the same (order ignored), the mean Jaccard overlap
|A & B| / |A | B| of the sets, and the first position where they differ. A flip in one layer
changes what every later layer sees, so the earliest layer with a flip is where the two
configurations part.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.generate import check_token_ids, vocab_size_of
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.models.taps import layer_index_of
from mlxbun.models.universal.kinds import GateAct, RouterKind, ScoreFunc, exhaustive
from mlxbun.models.universal.moe import Router
from mlxbun.parity.forced import eval_ids

__all__ = ["AGREEMENT_COLUMNS", "LAYER_COLUMNS", "LayerRouting", "MoERouting", "ROUTER_PROBS", "RoutingStats",
           "Side", "agreement", "moe_routing", "route"]


def _softmax(logits: np.ndarray, params=None) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _normalized_sigmoid(logits: np.ndarray, params=None) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-logits))
    return s / s.sum(axis=-1, keepdims=True)


def _as_scored(logits: np.ndarray, params) -> np.ndarray:  # grouped_score: its score function
    return (_normalized_sigmoid if params["score"] == "sigmoid" else _softmax)(logits)


def _as_score_func(logits: np.ndarray, params) -> np.ndarray:  # scored_grouped: its score_func
    return (_normalized_sigmoid if params["score_func"] == "sigmoid" else _softmax)(logits)


def _as_activated(logits: np.ndarray, params) -> np.ndarray:  # f32_act_topk: its gate activation
    return (_softmax if params["act"] is GateAct.SOFTMAX else _normalized_sigmoid)(logits)


def _as_capped_score(logits: np.ndarray, params) -> np.ndarray:  # capped_score: softcap, score
    c = params["softcap"]
    capped = np.tanh(logits / c) * c if c > 0.0 else logits
    s = (1.0 / (1.0 + np.exp(-capped)) if params["score_fn"] is ScoreFunc.SIGMOID
         else np.sqrt(np.logaddexp(capped, 0.0)))
    return s / s.sum(axis=-1, keepdims=True)


# router kind -> the probability distribution over all experts its logits stand for ((float64
# logits [N, E], the router's numbers) -> [N, E], rows summing to 1). A new router kind says here
# what its entropy is of.
ROUTER_PROBS = exhaustive(RouterKind, {
    RouterKind.SOFTMAX_TOPK: _softmax,
    RouterKind.TOPK_SOFTMAX: _softmax,
    RouterKind.TOPK_SOFTMAX_F32: _softmax,
    RouterKind.NOAUX_TC: _normalized_sigmoid,
    RouterKind.GROUPED_SCORE: _as_scored,
    RouterKind.SPARSEMIXER: _softmax,
    RouterKind.F32_ACT_TOPK: _as_activated,
    RouterKind.SIGMOID_CORRECTED: _normalized_sigmoid,
    RouterKind.SIGMOID_EPS: _normalized_sigmoid,
    RouterKind.SIGMOID_BIASED: _normalized_sigmoid,
    RouterKind.SIGMOID_SCALED: _normalized_sigmoid,
    RouterKind.SCORED_GROUPED: _as_score_func,
    RouterKind.CAPPED_SCORE: _as_capped_score,
    RouterKind.SOFTMAX_GROUP_GREEDY: _softmax,  # deepseek_v2: the softmax its top-k (group-limited) reads
    RouterKind.SOFTMAX_GROUPED: _softmax,  # mistral4: the float32 softmax its (grouped) top-k reads
})


@dataclass(frozen=True)
class Side:
    """One configuration of a model: a model name (`mlxbun.names`) and, for a zoo model, its
    weight variant (float32, q4, q8, mixed, ...; another model has the weights it has)."""

    model: str = "zoo:qwen3_moe"
    variant: str = "float32"

    @property
    def zoo(self) -> bool:
        return str(self.model).startswith("zoo:")

    @property
    def path(self) -> Path:
        return model_path(self.model, variant=self.variant)

    @property
    def label(self) -> str:
        return str(self.model) + (f"/{self.variant}" if self.zoo else "")

    def as_params(self) -> dict:
        return {"model": str(self.model), "variant": self.variant if self.zoo else None}


@dataclass
class LayerRouting:
    """One MoE layer's routing of the N tokens (rows), as the router's taps recorded it."""

    layer: int
    path: str
    kind: RouterKind
    experts: np.ndarray  # [N, k] the chosen experts
    weights: np.ndarray  # [N, k] what their outputs are multiplied by
    logits: np.ndarray  # [N, E] float64, the gate's logits
    params: Mapping[str, Any] = field(default_factory=dict)  # the router's numbers (RouterKnobs.params)

    @property
    def n_experts(self) -> int:
        return self.logits.shape[-1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[-1]

    def probs(self) -> np.ndarray:
        """[N, E]: the router's distribution over all experts (`ROUTER_PROBS[kind]`)."""
        return ROUTER_PROBS[self.kind](self.logits, self.params)

    def load(self) -> np.ndarray:
        """[E]: tokens routed to each expert, each of the k slots counted (sums to N x k)."""
        return np.bincount(self.experts.reshape(-1), minlength=self.n_experts)

    def entropy(self) -> np.ndarray:
        """[N]: -sum_e p_e ln p_e in nats (0 ln 0 = 0)."""
        p = self.probs()
        return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)

    def topk_mass(self) -> np.ndarray:
        """[N]: the distribution's mass on the chosen experts (before renormalization or scaling)."""
        return np.take_along_axis(self.probs(), self.experts, axis=-1).sum(axis=-1)

    def weight_sum(self) -> np.ndarray:
        """[N]: the sum of the weights the block applies (after renormalization and scaling)."""
        return self.weights.sum(axis=-1)


LAYER_COLUMNS = ["layer", "router", "tokens", "top_k", "experts", "entropy_mean", "entropy_max", "topk_mass_mean",
                 "weight_sum_mean", "load_imbalance", "experts_unused"]


@dataclass
class RoutingStats:
    """One side's routing over the ids, its MoE layers in layer order."""

    side: Side
    layers: list[LayerRouting]

    def table(self):
        """One row per MoE layer (LAYER_COLUMNS); entropy_max = ln E, the uniform router's."""
        import pandas as pd

        rows = []
        for r in self.layers:
            load = r.load()
            rows.append({"layer": r.layer, "router": str(r.kind), "tokens": r.experts.shape[0], "top_k": r.top_k,
                         "experts": r.n_experts, "entropy_mean": float(r.entropy().mean()),
                         "entropy_max": float(np.log(r.n_experts)), "topk_mass_mean": float(r.topk_mass().mean()),
                         "weight_sum_mean": float(r.weight_sum().mean()),
                         "load_imbalance": float(load.max() / load.mean()),
                         "experts_unused": int((load == 0).sum())})
        return pd.DataFrame(rows, columns=LAYER_COLUMNS)

    def load(self):
        """Tokens per expert (each of the k slots counted), a layers x experts DataFrame."""
        import pandas as pd

        width = max(r.n_experts for r in self.layers)
        table = np.full((len(self.layers), width), np.nan)
        for i, r in enumerate(self.layers):
            table[i, :r.n_experts] = r.load()
        return pd.DataFrame(table, index=pd.Index([r.layer for r in self.layers], name="layer"),
                            columns=pd.Index(range(width), name="expert"))


def route(side: Side, ids) -> RoutingStats:
    """`side`'s routers over `ids` (one forward of mlxbun's graph, every router tapped)."""
    path = side.path
    model = open_runtime(path)
    routers = {p: m for p, m in model.named_modules() if isinstance(m, Router)} \
        if isinstance(model, nn.Module) else {}
    if not routers:
        raise MlxbunError(f"{side.label}: no MoE layers ({model.model_type} has no router in mlxbun's graph), "
                          "nothing to route")
    check_token_ids(list(ids), vocab_size_of(model), what=f"{side.label}: the text's ids", error=MlxbunError)
    with model.layers_tap(list(routers)) as taps:
        mx.eval(model(mx.array([list(ids)])))
    layers = []
    for p, router in routers.items():
        (routing,) = taps.tuples[p]  # one forward: one call
        experts = np.array(routing.experts).reshape(-1, router.top_k)
        layers.append(LayerRouting(
            layer=layer_index_of(p), path=p, kind=router.kind, experts=experts.astype(np.int64),
            weights=np.array(routing.weights.astype(mx.float32)).reshape(experts.shape).astype(np.float64),
            logits=np.array(routing.logits.astype(mx.float32)).reshape(len(experts), -1).astype(np.float64),
            params=dict(router.params)))
    return RoutingStats(side, sorted(layers, key=lambda r: r.layer))


AGREEMENT_COLUMNS = ["layer", "tokens", "same_set", "jaccard_mean", "first_flip"]


def agreement(a: RoutingStats, b: RoutingStats):
    """Per MoE layer: the fraction of tokens whose chosen expert set is the same on both sides,
    the mean Jaccard overlap of the sets, the first position where they differ (<NA>: nowhere).
    The sides must route the same tokens through the same layers, experts and k."""
    import pandas as pd

    shape = lambda s: [(r.layer, r.n_experts, r.top_k, r.experts.shape[0]) for r in s.layers]  # noqa: E731
    if shape(a) != shape(b):
        raise MlxbunError(f"{a.side.label} and {b.side.label} route differently: (layer, experts, k, tokens) "
                          f"{shape(a)} vs {shape(b)}")
    rows = []
    for ra, rb in zip(a.layers, b.layers):
        E = ra.n_experts
        ma, mb = np.zeros((len(ra.experts), E), bool), np.zeros((len(rb.experts), E), bool)
        np.put_along_axis(ma, ra.experts, True, axis=-1)
        np.put_along_axis(mb, rb.experts, True, axis=-1)
        same = (ma == mb).all(axis=-1)
        jaccard = (ma & mb).sum(axis=-1) / (ma | mb).sum(axis=-1)
        flips = np.flatnonzero(~same)
        rows.append({"layer": ra.layer, "tokens": len(same), "same_set": float(same.mean()),
                     "jaccard_mean": float(jaccard.mean()), "first_flip": int(flips[0]) if flips.size else pd.NA})
    return pd.DataFrame(rows, columns=AGREEMENT_COLUMNS).astype({"first_flip": "Int64"})


@dataclass
class MoERouting:
    base: RoutingStats
    new: RoutingStats | None  # None: one side, no agreement
    ids: list[int]
    agreement_table: object = None  # `agreement(base, new)` (a DataFrame), None with one side
    run_id: str | None = None

    @property
    def sides(self) -> list[tuple[str, RoutingStats]]:
        return [("base", self.base)] + ([("new", self.new)] if self.new is not None else [])

    def layers(self):
        """Both sides' per-layer tables, one under the other, with a `side` column (base / new)."""
        import pandas as pd

        return pd.concat([s.table().assign(side=name) for name, s in self.sides],
                         ignore_index=True)[["side", *LAYER_COLUMNS]]

    def per_layer(self, column: str = "entropy_mean"):
        """One column of the per-layer tables, a layers x sides DataFrame ("base: LABEL", ...)."""
        import pandas as pd

        if column not in LAYER_COLUMNS[5:]:
            raise MlxbunError(f"per_layer({column!r}): one of {', '.join(LAYER_COLUMNS[5:])}")
        return pd.DataFrame({f"{name}: {s.side.label}": s.table().set_index("layer")[column] for name, s in self.sides})

    def agreement(self):
        """`agreement(base, new)`'s table; refused with one side."""
        if self.agreement_table is None:
            raise MlxbunError("one side only: give moe_routing a `new` side to compare the chosen experts")
        return self.agreement_table

    def flip_order(self):
        """The layers whose chosen expert sets flip, those that agree least first (ties: the
        earlier layer): where the new configuration moves the routing most."""
        t = self.agreement()
        t = t[t["same_set"] < 1]
        return t.sort_values(["same_set", "jaccard_mean", "layer"], kind="stable").reset_index(drop=True)


_STAT_METRICS = (("entropy_mean", "router_entropy", "nats"), ("topk_mass_mean", "topk_mass", None),
                 ("weight_sum_mean", "weight_sum", None), ("load_imbalance", "load_imbalance", None),
                 ("experts_unused", "experts_unused", "experts"))


def _rows(name: str, stats: RoutingStats):
    for row in stats.table().itertuples(index=False):
        for column, metric, unit in _STAT_METRICS:
            yield metric, getattr(row, column), unit, {"side": name, "layer": row.layer}
    for r in stats.layers:
        for e, n in enumerate(r.load()):
            yield "expert_load", int(n), "tokens", {"side": name, "layer": r.layer, "expert": e}


def _agreement_rows(table):
    import pandas as pd

    for row in table.itertuples(index=False):
        yield "same_expert_set", row.same_set, None, {"layer": row.layer}
        yield "expert_jaccard", row.jaccard_mean, None, {"layer": row.layer}
        if not pd.isna(row.first_flip):
            yield "first_flip", row.first_flip, "position", {"layer": row.layer}


def moe_routing(base: Side, new: Side | None = None, *, n_tokens: int = 128, text: str | None = None,
                comparison: str | None = None, allow_identical: bool = False, results_path=None,
                record: bool = True) -> MoERouting:
    """Routing statistics of `base` (and of `new`, with their agreement) over `n_tokens` ids of
    `text` (None: the zoo corpus; repeated as needed), encoded by base's tokenizer; both sides
    route the same ids. A dense model is refused ("no MoE layers"); two sides that are the same
    checkpoint are refused unless `allow_identical` (a self-check: agreement is then 1)."""
    pa = base.path
    if new is not None and new.path == pa and not allow_identical:
        raise MlxbunError(f"both sides are {base.label} at {pa}: nothing would be compared (for a model other "
                          "than the zoo, give the new side its own checkpoint, e.g. a quantized copy)")
    tok = optional_tokenizer(pa)
    if tok is None:
        raise MlxbunError(f"{pa}: no tokenizer to encode the text")
    ids = eval_ids(tok, n_tokens, text)
    a = route(base, ids)
    b = route(new, ids) if new is not None else None
    table = agreement(a, b) if b is not None else None
    out = MoERouting(base=a, new=b, ids=ids, agreement_table=table)
    params = {"comparison": comparison or (f"{base.label} vs {new.label}" if new is not None else base.label),
              "base": base.as_params(), "new": new.as_params() if new is not None else None, "n_tokens": n_tokens,
              "text_sha1": None if text is None else hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]}
    with recording("moe_routing", model=(new or base).path, params=params, results_path=results_path,
                   record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            for name, s in out.sides:
                run.record_many(_rows(name, s))
            if table is not None:
                run.record_many(_agreement_rows(table))
    return out
