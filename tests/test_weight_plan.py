"""Mixed per-module weight plans (mlxbun/experiments/weight_plan.py): the predicate, bits per
weight, in-memory application undone, and the written checkpoint loading back to the same logits."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxbun.errors import MlxbunError
from mlxbun.experiments.weight_plan import (
    WeightPlan,
    applied,
    apply_plan,
    bits_per_weight,
    quantizable_modules,
    quantize_with_plan,
)
from mlxbun.locate import open_runtime

IDS = mx.array([[1, 5, 9, 2, 7, 3, 11, 4]])


def test_predicate_defaults_overrides_and_refusals():
    plan = WeightPlan(4, 64).with_high(["a"], label="x")
    lin = nn.Linear(128, 8)
    assert plan.predicate("b", lin) is True
    assert plan.predicate("a", lin) == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert plan.predicate("a", nn.RMSNorm(8)) is False
    assert plan.predicate("b", nn.Linear(96, 8)) is False  # 64 does not divide 96
    assert plan.label == "x" and plan.spec("a") == (8, 64)
    with pytest.raises(MlxbunError, match="bits"):
        WeightPlan(bits=7)
    with pytest.raises(MlxbunError, match="group_size"):
        WeightPlan(group_size=48)
    with pytest.raises(MlxbunError, match=r"overrides\['m'\]"):
        WeightPlan(overrides={"m": (8, 17)})


def test_bits_per_weight_counts_scales_and_float_params():
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.RMSNorm(64))
    assert bits_per_weight(model, None) == 16.0
    n_w, n = 128 * 64, 128 * 64 + 64
    assert bits_per_weight(model, WeightPlan(4, 64)) == pytest.approx((n_w * 4.5 + 64 * 16) / n)
    assert bits_per_weight(model, WeightPlan(4, 32)) == pytest.approx((n_w * 5.0 + 64 * 16) / n)
    high = WeightPlan(4, 64).with_high(["layers.0"])
    assert bits_per_weight(model, high) == pytest.approx((n_w * 8.5 + 64 * 16) / n)


def test_applied_quantizes_then_restores(zoo):
    m = open_runtime(zoo("llama"))
    ref = m(IDS)
    paths = list(quantizable_modules(m))
    plan = WeightPlan(4, 64).with_high(paths[:2])
    with applied(m, plan):
        mods = dict(m.named_modules())
        assert isinstance(mods[paths[2]], (nn.QuantizedLinear, nn.QuantizedEmbedding))
        assert mods[paths[0]].bits == 8 and mods[paths[2]].bits == 4
        q = m(IDS)
    assert not mx.array_equal(q, ref)
    assert mx.array_equal(m(IDS), ref)  # float modules back
    with pytest.raises(MlxbunError, match="not quantizable"):
        apply_plan(m, WeightPlan().with_high(["model.nope"]))


def test_quantize_with_plan_writes_a_checkpoint_that_loads_to_the_same_logits(zoo, tmp_path):
    src = zoo("llama")
    m = open_runtime(src)
    paths = list(quantizable_modules(m))
    plan = WeightPlan(4, 64).with_high(paths[-3:])
    with applied(m, plan):
        expected = m(IDS)
    out = quantize_with_plan(src, plan, tmp_path / "mixed")
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 64
    assert {k for k, v in q.items() if isinstance(v, dict)} == set(paths[-3:])
    assert all(q[p]["bits"] == 8 for p in paths[-3:])
    assert (out / "tokenizer.json").is_file()
    loaded = open_runtime(out)
    assert mx.array_equal(loaded(IDS), expected)
    with pytest.raises(MlxbunError, match="out_dir"):
        quantize_with_plan(src, plan, out)
    with pytest.raises(MlxbunError, match="already quantized"):
        quantize_with_plan(out, plan, tmp_path / "again")
