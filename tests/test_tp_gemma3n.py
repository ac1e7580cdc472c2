"""Tensor parallelism (issue 18) for the dedicated gemma3n graph (`mlxbun/models/gemma3n/`), over
local ranks of the ring backend. mlx-lm's gemma3n has no `shard()`, so the split is held to the
one-process run only (`mlxbun.parallel.check`).

The zoo's float32 gemma3n splits under tests/test_tensor_parallel.py's `tp-check zoo:all`. Here,
through `tests/tensor_parallel.py`:
- one 2-rank `mlxbun tp-check` over the half-precision variants, quantized checkpoints built here off
  the zoo (heads of 32 and hidden widths of 128 / 256, so a rank's part of every o_proj and
  down_proj is whole quantization groups of 64), and the zoo's quantized variants, whose splits fall
  off whole groups, refused naming the module;
- one 4-rank `tp-check`: the 2 KV heads repeated to 4 ranks (the KV-shared layers read them from
  their owner's cache on each rank), the sparse MLPs' statistics over 4 ranks;
- without a launch: the sparse MLP's statistics from per-rank partial sums (what the ranks
  all-sum) against the whole row's; the split's shapes on each rank (a KV-shared layer's heads
  are its owner's); refusals naming the module and sizes before anything in the model changed.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxbun.factory import open_model
from mlxbun.locate import locate
from mlxbun.models.gemma3n import layers as G
from mlxbun.models.sharding import ShardingError
from tests.tensor_parallel import GROUPS_OF_64, FakeGroup, assert_split_holds, launch_json_once, named_report, once, param_shapes

ZOO_VARIANTS = ("zoo:gemma3n@float16", "zoo:gemma3n@bfloat16")
_WIDE = {"head_dim": 32, "intermediate_size": [128, 256, 128, 128, 128]}  # o_proj / down_proj: whole groups
OFF_ZOO = {"gemma3n@q4-wide": (4, _WIDE), "gemma3n@q8-wide": (8, _WIDE)}  # name: (quant, text_config keys)
REFUSED = {  # the zoo's: a rank's part of o_proj is 32 of 64 features, of layer 1's down_proj 96 of 192
    "zoo:gemma3n@q4": f"model.language_model.layers.0.self_attn.o_proj: a rank's 32 of 64 input features are "
                      f"{GROUPS_OF_64}",
    "zoo:gemma3n@q8,head_dim=32": f"model.language_model.layers.1.mlp.down_proj: a rank's 96 of 192 input "
                                  f"features are {GROUPS_OF_64}",
}
LAYERS = "model.language_model.layers"


def _build(root: Path, name: str, quant, keys: dict) -> Path:
    """A gemma3n checkpoint off the zoo: `keys` over the tiny text_config."""
    from mlxbun.zoo.build import build_files, tiny_config, variant

    out = root / name.replace("@", "-")
    shutil.rmtree(out, ignore_errors=True)  # a build an earlier failure left half done
    out.mkdir(parents=True)
    build_files(variant("gemma3n", quant=quant), out,
                {"text_config": {**tiny_config("gemma3n")["text_config"], **keys}})
    return out


@pytest.fixture(scope="module")
def off_zoo(run_tmp):
    root = run_tmp / "tp-gemma3n-off-zoo"
    paths = once(run_tmp, "gemma3n-off-zoo",
                 lambda: {name: str(_build(root, name, q, keys)) for name, (q, keys) in OFF_ZOO.items()})
    return {name: Path(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def report(zoo_root, run_tmp, off_zoo):
    """{target: tp-check row} of the 2-rank launch (an off-zoo target under its OFF_ZOO name)."""
    return named_report(run_tmp, "gemma3n", zoo_root, [*ZOO_VARIANTS, *REFUSED], off_zoo)


@pytest.mark.parametrize("target", [*ZOO_VARIANTS, *OFF_ZOO])
def test_half_precision_and_quantized_gemma3n_splits(report, target):
    r = report[target]
    assert r["ranks"] == 2 and r["mlxlm"] == "no shard()", r
    assert_split_holds(r)  # quantized: float32 activations, every greedy id; half: twice its own drift


@pytest.mark.parametrize("target", REFUSED)
def test_quantized_gemma3n_splits_off_whole_groups_are_refused(report, target):
    r = report[target]
    assert r["status"] == "refused" and REFUSED[target] in r["reason"], r


def test_kv_heads_repeated_to_four_ranks(zoo_root, run_tmp):
    """4 heads, 2 KV heads over 4 ranks: each rank one query head and a copy of the KV head it
    reads; the KV-shared layers read it from their owner's cache on the rank."""
    (r,) = launch_json_once(run_tmp, "gemma3n-4", ["tp-check", "zoo:gemma3n"], ranks=4,
                            env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    assert r["ranks"] == 4 and r["mlxlm"] == "no shard()", r
    assert_split_holds(r)


# ----------------------------------------------------------------------------- without a launch


def _multiplier(sparsity: float = 0.95) -> mx.array:
    return math.sqrt(2.0) * mx.erfinv(mx.array(2 * sparsity - 1))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_sparse_statistics_span_every_ranks_hidden_units(dtype):
    """A sparse MLP split by hidden units: the cutoff's mean and std are the whole row's, from the
    ranks' float32 partial sums (row_sum, then row_square_sum about the summed mean), as the ranks
    all-sum them; with one rank it is gelu_topk op for op. A rank's own units' statistics are not."""
    mx.random.seed(0)
    x = (mx.random.normal((2, 3, 192)) * 2 + 0.4).astype(dtype)
    m = _multiplier()
    whole = G.gelu_topk(x, m).astype(mx.float32)
    one = mx.distributed.init()  # a plain run: a group of one, all_sum the identity
    assert one.size() == 1
    if dtype == mx.float32:
        assert mx.array_equal(G.gelu_topk_over_ranks(x, m, one, 192), G.gelu_topk(x, m)).item()
    for n in (2, 4):
        parts = mx.split(x, n, axis=-1)
        mean = sum(G.row_sum(p) for p in parts) * (1 / 192)
        var = sum(G.row_square_sum(p, mean) for p in parts) * (1 / 192)
        split = mx.concatenate([G._gelu_over_cutoff(p, mean, var, m) for p in parts], axis=-1)
        # float32: the order of the sum alone (a few units in the last place of the inputs);
        # bfloat16: the statistics in float32, where gelu_topk's are bfloat16's (one unit at most)
        tol = (2.0**-21 if dtype == mx.float32 else 2.0**-7) * mx.abs(x).max().item()
        assert mx.abs(split.astype(mx.float32) - whole).max().item() <= tol
        local = mx.concatenate([G.gelu_topk(p, m) for p in parts], axis=-1).astype(mx.float32)
        assert mx.abs(local - whole).max().item() > 5 * tol  # what splitting gelu_topk as it is would do


def test_each_rank_holds_its_heads_and_hidden_units(zoo, zoo_root):
    """FakeGroup(2, 1): rank 1's half of every layer's heads and hidden units; a KV-shared layer's
    heads are those of the layer whose cache it reads; 4 ranks: the 2 KV heads repeated, rank r's
    copy the head its query head reads unsplit."""
    path = zoo("gemma3n")
    whole = open_model(path)
    model = open_model(path)
    model.shard(FakeGroup(2, rank=1))
    args = model.args
    assert model.tensor_group is not None and args.first_kv_shared == 3
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
        assert attn.q_proj.weight.shape == (32, 64) and attn.o_proj.weight.shape == (64, 32)
        width = args.intermediate(i)
        assert mlp.gate_proj.weight.shape == (width // 2, 64) and mlp.down_proj.weight.shape == (64, width // 2)
        assert (mlp._group is not None) and mlp._width == width  # the whole row's width
        k = whole.layers[i].self_attn.k_proj.weight
        assert mx.array_equal(attn.k_proj.weight, k[16:]).item()  # rank 1: KV head 1
        owner = model.layers[args.cache_idx[i]].self_attn
        assert owner.k_proj.weight.shape == attn.k_proj.weight.shape and owner.n_kv_heads == attn.n_kv_heads
    for name in ("altup", "laurel", "per_layer_input_gate", "per_layer_projection"):  # whole on every rank
        assert param_shapes(model.layers[0][name]) == param_shapes(whole.layers[0][name])
    four = open_model(path)
    four.shard(FakeGroup(4, rank=3))
    attn = four.layers[4].self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (1, 1)
    assert mx.array_equal(attn.v_proj.weight, whole.layers[4].self_attn.v_proj.weight[16:]).item()  # head 3 // 2
    with pytest.raises(ShardingError, match="already split across 2 ranks"):
        model.shard(FakeGroup(2))
    one = open_model(path)
    one.shard(FakeGroup(1))  # a group of one changes nothing
    assert one.tensor_group is None and param_shapes(one) == param_shapes(whole)


def _refused_unchanged(model, group, words):
    before = param_shapes(model)
    heads = [(l.self_attn.n_heads, l.self_attn.n_kv_heads) for l in model.layers]
    with pytest.raises(ShardingError, match=words):
        model.shard(group)
    assert param_shapes(model) == before and model.tensor_group is None
    assert [(l.self_attn.n_heads, l.self_attn.n_kv_heads) for l in model.layers] == heads
    assert all(l.mlp._group is None for l in model.layers)


@pytest.mark.parametrize("target, ranks, words", [
    ("zoo:gemma3n", 3, rf"^{LAYERS}.0.self_attn: 4 attention heads do not split across 3 ranks$"),
    ("zoo:gemma3n@q4", 2, rf"^{LAYERS}.0.self_attn.o_proj: a rank's 32 of 64 input features are not whole"),
    # layer 0 splits, layer 1's down_proj does not: refused before layer 0 changed
    ("zoo:gemma3n@q8,head_dim=32", 2, rf"^{LAYERS}.1.mlp.down_proj: a rank's 96 of 192 input features are not "),
])
def test_a_refused_split_leaves_the_model_as_it_was(zoo_root, target, ranks, words):
    _refused_unchanged(open_model(locate(target, zoo_root=zoo_root)), FakeGroup(ranks), words)


@pytest.mark.parametrize("keys, words", [
    ({"num_attention_heads": 6}, rf"^{LAYERS}.0.self_attn: 2 KV heads neither split across 3 ranks nor repeat "),
    ({"num_attention_heads": 6, "num_key_value_heads": 3},
     rf"^{LAYERS}.0.mlp.gate_proj: 128 output features do not split into 3 equal parts"),
])
def test_heads_and_hidden_units_that_do_not_split_are_refused(tmp_path, keys, words):
    _refused_unchanged(open_model(_build(tmp_path, "gemma3n", None, keys)), FakeGroup(3), words)
