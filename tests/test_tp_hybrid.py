"""Tensor parallelism (issue 18) for the hybrids' recurrent mixers (lfm2's ShortConv; the gated
DeltaNets of qwen3_next, qwen3_5 and olmo_hybrid; Mamba2 in mamba2, nemotron_h, granitemoehybrid and
falcon_h1) and for gemma4, over local ranks of the ring backend.

Every hybrid and gemma4 zoo arch splits in float32 under tests/test_tensor_parallel.py's
`tp-check zoo:all` (qwen3_5 and qwen3_5_moe bit-exact with mlx-lm's split: their files are the only
hybrid ones with `shard()`). Here, through `tests/tensor_parallel.py`:
- one 2-rank `mlxbun tp-check` over the half-precision and quantized variants whose split fits: the
  zoo's, and checkpoints built here off the zoo (config keys over the tiny config), widened so that
  a rank's part of each mixer's out_proj, attention's o_proj and the experts' down projection is
  whole quantization groups of 64, and mamba2 with one B / C group (repeated to both ranks, the
  gated norm's squares all-summed across them); the zoo's quantized variants, whose splits fall off
  whole groups, refused naming the module;
- one 4-rank `tp-check`: mamba2's 2 B / C groups repeated to 4 ranks (each norm group summed over a
  pair of ranks), gemma4's 2 KV heads repeated, qwen3_5's 2 key heads refused;
- speculative decoding of a split hybrid (`mlxbun generate --draft self:1` under a launch): the
  one-process plain decode's tokens, with rejected rounds rolled back on every rank;
- without a launch: a split that cannot be made is refused naming the module and sizes before
  anything changes, and `repeat_rows` repeats one fused segment's groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxbun.factory import open_model
from mlxbun.locate import locate
from mlxbun.models.sharding import ShardingError, repeat_rows
from tests.tensor_parallel import (
    GROUPS_OF_64,
    FakeGroup,
    assert_split_holds,
    launch_json,
    launch_json_once,
    mlxlm_has_shard,
    named_report,
    once,
    param_shapes,
)

ZOO_VARIANTS = (  # the zoo's half / quantized hybrid variants whose split fits (hidden 64: q4 on mamba2's
    # 128-wide mixer, on heads of 32 where the arch reads head_dim)
    "zoo:gemma4_text@bfloat16", "zoo:gemma4_text@float16", "zoo:lfm2@bfloat16", "zoo:qwen3_5@float16",
    "zoo:qwen3_5@bfloat16", "zoo:olmo_hybrid@bfloat16", "zoo:mamba2@float16", "zoo:granitemoehybrid@bfloat16",
    "zoo:falcon_h1@bfloat16", "zoo:lfm2-vl@float16", "zoo:mamba2@q4", "zoo:mamba2@q8", "zoo:mamba2@mixed",
    "zoo:falcon_h1@q4,head_dim=32", "zoo:gemma4_text@q4,head_dim=32",
)
_WIDE_GDN = {"linear_value_head_dim": 32, "head_dim": 32}  # out_proj and o_proj over 128 features
_WIDE_EXPERTS = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
OFF_ZOO = {  # name: (arch, quant, {key: value} over the tiny config; "text_config" merged into its own)
    "qwen3_5@q4-wide": ("qwen3_5", 4, {"text_config": _WIDE_GDN}),
    "qwen3_5_moe@q4-wide": ("qwen3_5_moe", 4, {"text_config": {**_WIDE_GDN, **_WIDE_EXPERTS}}),
    "qwen3_next@q4-wide": ("qwen3_next", 4, {**_WIDE_GDN, **_WIDE_EXPERTS}),
    "olmo_hybrid@q4-wide": ("olmo_hybrid", 4, _WIDE_GDN),
    "lfm2@q4-wide": ("lfm2", 4, {"hidden_size": 128, "block_dim": 128, "block_auto_adjust_ff_dim": False}),
    "lfm2_moe@q4-wide": ("lfm2_moe", 4, {"hidden_size": 128, "moe_intermediate_size": 128}),
    "nemotron_h@q4-wide": ("nemotron_h", 4, {"head_dim": 32, "moe_intermediate_size": 128,
                                             "moe_shared_expert_intermediate_size": 128}),
    "granitemoehybrid@q4-wide": ("granitemoehybrid", 4, {"hidden_size": 128}),
    "gemma4@q4-wide": ("gemma4", 4, {"text_config": {"head_dim": 32, "moe_intermediate_size": 128}}),
    "mamba2@one-group": ("mamba2", None, {"n_groups": 1}),
}
REFUSED = {  # the zoo's quantized hybrids: a rank's part of a mixer's (or the experts') input is 32 of 64
    "zoo:lfm2@q4": f"model.layers.0.conv.out_proj: a rank's 32 of 64 input features are {GROUPS_OF_64}",
    "zoo:qwen3_5@q4": f"language_model.model.layers.0.linear_attn.out_proj: a rank's 32 of 64 input features "
                      f"are {GROUPS_OF_64}",
    "zoo:olmo_hybrid@q4": f"model.layers.0.linear_attn.o_proj: a rank's 32 of 64 input features are {GROUPS_OF_64}",
    "zoo:nemotron_h@q4": f"backbone.layers.1.mixer.switch_mlp.fc2: a rank's 32 of 64 input features are {GROUPS_OF_64}",
    "zoo:gemma4@q4,head_dim=32": "language_model.model.layers.0.experts.switch_glu.down_proj: a rank's 32 of 64 "
                                 f"input features are {GROUPS_OF_64}",
}
FOUR_RANKS = ("zoo:mamba2", "zoo:gemma4_text")
FOUR_RANKS_REFUSED = {
    "zoo:qwen3_5": "language_model.model.layers.0.linear_attn: 2 key heads do not split across 4 ranks",
}
SPEC_PROMPT = "Hello there Hello there Hello there"


def _build_off_zoo(root, name: str):
    """The checkpoint directory of an off-zoo variant, built afresh under `root`."""
    from mlxbun.zoo.build import build_files, tiny_config, variant

    arch, quant, keys = OFF_ZOO[name]
    if "text_config" in keys:  # a wrapper's text model: its keys over the tiny text_config
        keys = {**keys, "text_config": {**tiny_config(arch)["text_config"], **keys["text_config"]}}
    out = root / name.replace("@", "-")
    shutil.rmtree(out, ignore_errors=True)  # a build an earlier failure left half done
    out.mkdir(parents=True)
    build_files(variant(arch, quant=quant), out, keys)
    return out


@pytest.fixture(scope="module")
def off_zoo(run_tmp):
    """{name: checkpoint directory} of OFF_ZOO, built once for every xdist worker of the run."""
    root = run_tmp / "tp-off-zoo"
    paths = once(run_tmp, "off-zoo", lambda: {name: str(_build_off_zoo(root, name)) for name in OFF_ZOO})
    return {name: Path(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def report(zoo_root, run_tmp, off_zoo):
    """{target: tp-check row} of the 2-rank launch (an off-zoo target under its OFF_ZOO name)."""
    return named_report(run_tmp, "hybrid", zoo_root, [*ZOO_VARIANTS, *REFUSED], off_zoo)


@pytest.fixture(scope="module")
def report_4(zoo_root, run_tmp):
    rows = launch_json_once(run_tmp, "hybrid-4", ["tp-check", *FOUR_RANKS, *FOUR_RANKS_REFUSED], ranks=4,
                            env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    return {r["target"].removesuffix("@float32"): r for r in rows}


def _mlxlm(path) -> str:
    return "bit-exact" if mlxlm_has_shard(path) else "no shard()"


@pytest.mark.parametrize("target", ZOO_VARIANTS)
def test_half_precision_and_quantized_hybrid_splits(report, zoo_root, target):
    r = report[target]
    assert r["ranks"] == 2
    assert_split_holds(r)
    assert r["mlxlm"] == _mlxlm(locate(target, zoo_root=zoo_root)), r  # qwen3_5: bit for bit


@pytest.mark.parametrize("name", OFF_ZOO)
def test_off_zoo_splits_widened_to_whole_quantization_groups(report, off_zoo, name):
    r = report[name]
    config = json.loads((off_zoo[name] / "config.json").read_text())
    assert ("quantization" in config) == (OFF_ZOO[name][1] is not None)
    assert_split_holds(r)
    assert r["mlxlm"] == _mlxlm(off_zoo[name]), r  # qwen3_5 / qwen3_5_moe quantized: bit for bit


@pytest.mark.parametrize("target", REFUSED)
def test_quantized_hybrid_splits_off_whole_groups_are_refused(report, target):
    r = report[target]
    assert r["status"] == "refused" and REFUSED[target] in r["reason"], r


@pytest.mark.parametrize("target", FOUR_RANKS)
def test_groups_and_kv_heads_fewer_than_four_ranks_are_repeated(report_4, target):
    r = report_4[target]
    assert r["ranks"] == 4 and r["mlxlm"] == "no shard()"
    assert_split_holds(r)


def test_key_heads_fewer_than_the_ranks_are_refused(report_4):
    for target, words in FOUR_RANKS_REFUSED.items():
        r = report_4[target]
        assert r["ranks"] == 4 and r["status"] == "refused" and words in r["reason"], r


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "lfm2"])  # gated DeltaNet, Mamba2 + MoE, ShortConv
def test_speculative_decoding_of_a_split_hybrid_is_plain_decoding(zoo_root, monkeypatch, capsys, arch):
    """The split target verifies drafts of its own first block: rejected rounds with accepted drafts
    before the miss roll every rank's mixer states back (replayed tokens beyond one a round), and
    the tokens are the one-process plain decode's."""
    from mlxbun.cli import main

    args = ["generate", "--model", f"zoo:{arch}", "--prompt", SPEC_PROMPT, "--max-tokens", "16", "--json"]
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    assert main(args) == 0
    whole = json.loads(capsys.readouterr().out)
    split, _ = launch_json([*args[:-1], "--draft", "self:1", "--num-draft", "3"],
                           env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    spec = split["spec"]
    assert split["tensor_parallel"] == {"ranks": 2}
    assert split["tokens"] == whole["tokens"]
    assert spec["replays"] > 0 and spec["accepted_tokens"] > 0
    assert spec["replayed_tokens"] > spec["replays"], spec  # some rejected round kept accepted drafts


# ----------------------------------------------------------------------------- without a launch



@pytest.mark.parametrize("target, child, ranks, words", [
    ("zoo:qwen3_5", "linear_attn", 4, r"^x: 2 key heads do not split across 4 ranks$"),
    ("zoo:olmo_hybrid", "linear_attn", 4, r"^x: 2 key heads do not split across 4 ranks$"),
    ("zoo:mamba2", "mixer", 3, r"^x: 8 heads do not split across 3 ranks$"),
    ("zoo:lfm2", "conv", 3, r"^x.in_proj: 192 output features \(fused parts \[64, 64, 64\]\) do not split into 3 "
                            r"equal parts \(tensor-parallel group of 3\)$"),
    ("zoo:gemma4_text", "self_attn", 3, r"^x: 4 attention heads do not split across 3 ranks$"),
    # every split but out_proj's fits: nothing changed when out_proj is refused
    ("zoo:qwen3_5@q4", "linear_attn", 2, r"^x.out_proj: a rank's 32 of 64 input features are not whole"),
    ("zoo:lfm2@q4", "conv", 2, r"^x.out_proj: a rank's 32 of 64 input features are not whole"),
    ("zoo:olmo_hybrid@q4", "linear_attn", 2, r"^x.o_proj: a rank's 32 of 64 input features are not whole"),
    ("zoo:gemma4@q4,head_dim=32", "experts", 2,
     r"^x.switch_glu.down_proj: a rank's 32 of 64 input features are not whole"),
])
def test_a_mixer_split_is_checked_before_anything_changes(zoo_root, target, child, ranks, words):
    module = open_model(locate(target, zoo_root=zoo_root)).layers[0][child]
    before = param_shapes(module)
    counts = {k: v for k, v in vars(module).items() if isinstance(v, int)}  # heads, widths, groups
    with pytest.raises(ShardingError, match=words):
        module.shard(FakeGroup(ranks), where="x")
    assert param_shapes(module) == before
    assert {k: v for k, v in vars(module).items() if isinstance(v, int)} == counts


def test_the_split_vocabulary_is_checked_before_any_layer_splits(zoo_root):
    model = open_model(locate("zoo:qwen3_5", zoo_root=zoo_root))
    before = param_shapes(model)
    with pytest.raises(ShardingError, match=r"^language_model.lm_head: 512 output features do not split into 3"):
        model.shard(FakeGroup(3))  # the key heads would not split either: the head is checked first
    assert param_shapes(model) == before and model.tensor_group is None


def test_groups_that_neither_split_nor_repeat_are_refused(tmp_path):
    from mlxbun.zoo.build import build_files, variant

    build_files(variant("mamba2"), tmp_path, {"n_groups": 3, "num_heads": 6, "intermediate_size": 96})
    with pytest.raises(ShardingError, match=r"^backbone.layers.0.mixer: 3 B / C groups neither split across 2 "
                                            r"ranks nor repeat to one per rank \(6 heads\)$"):
        open_model(tmp_path).shard(FakeGroup(2))


def test_kv_heads_that_neither_split_nor_repeat_are_refused(tmp_path):
    from mlxbun.zoo.build import build_files, variant

    build_files(variant("gemma4_text"), tmp_path, {"num_attention_heads": 6, "hidden_size_per_layer_input": 12})
    with pytest.raises(ShardingError, match=r"^model.layers.0.self_attn: 2 KV heads neither split across 3 ranks "
                                            r"nor repeat to one per rank$"):
        open_model(tmp_path).shard(FakeGroup(3))


def test_repeat_rows_repeats_each_group_of_one_segment():
    """A fused projection [x | B | C]: B's 2 groups (rows 2-5) each twice for 4 ranks, x and C as
    they were (Mamba2's split with B / C groups fewer than the ranks)."""
    mx.random.seed(0)
    proj = nn.Linear(3, 10)
    w, b = proj.weight, proj.bias
    repeat_rows(proj, 2, 4, (2, 6))
    assert proj.weight.shape == (14, 3) and proj.bias.shape == (14,)
    order = [0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9]
    assert mx.array_equal(proj.weight, w[mx.array(order)]).item()
    assert mx.array_equal(proj.bias, b[mx.array(order)]).item()
