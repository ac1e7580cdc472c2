"""Tensor parallelism (issue 18) for the MoE block and multi-head latent attention, 2 local ranks
over the ring backend.

Every MoE / MLA zoo arch splits in float32 under tests/test_tensor_parallel.py's `tp-check zoo:all`
(bit-exact with mlx-lm's split where its file has `shard()`). Here one launch of `mlxbun tp-check`
(through `tests/tensor_parallel.py`) runs the quantized and half-precision variants whose split
fits, held to the whole model (greedy ids equal, logits within the check's tolerance) and to
mlx-lm's split where it shards, and the variants whose split cannot be made, refused by name. The
checks that refuse a split, the head slices of a quantized MultiLinear and the experts' bias share
run without a launch.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest

from mlxbun.locate import locate
from mlxbun.models.multi_linear import MultiLinear
from mlxbun.models.sharding import ShardingError, shard_inplace_all, slice_heads_inplace
from mlxbun.models.switch_layers import SwitchGLU
from tests.tensor_parallel import GROUPS_OF_64, FakeGroup, assert_split_holds, launch_json_once, param_shapes

# the splits that fit a quantized or half-precision variant: olmoe's experts are 128 wide (a rank's
# down input 64, one group of 64); gpt_oss's mxfp4 groups are 32; youtu_llm's o_proj (96 inputs)
# stays unquantized; unquantized half-precision experts do not run on the CPU (gather_mm), dense MLA does
VARIANTS = ("zoo:olmoe@q4,head_dim=32", "zoo:gpt_oss@mxfp4", "zoo:youtu_llm@q4",
            "zoo:minicpm3@bfloat16", "zoo:youtu_llm@float16")
BIT_EXACT_VARIANTS = ("zoo:gpt_oss@mxfp4",)  # mlx-lm's gpt_oss has shard()
REFUSED = {  # the quantized splits that cannot be made, and the words of the refusal
    "zoo:qwen3_moe@q4,head_dim=32": f"model.layers.0.mlp.switch_mlp.down_proj: a rank's 32 of 64 input features are {GROUPS_OF_64}",
    "zoo:dots1@q4,head_dim=32": f"model.layers.1.mlp.experts.down_proj: a rank's 32 of 64 input features are {GROUPS_OF_64}",
    "zoo:deepseek_v3@q4": f"model.layers.0.self_attn.o_proj: a rank's 32 of 64 input features are {GROUPS_OF_64}",
}
TARGETS = (*VARIANTS, *REFUSED)


@pytest.fixture(scope="module")
def report(zoo_root, run_tmp):
    rows = launch_json_once(run_tmp, "moe-mla", ["tp-check", *TARGETS], env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    return {r["target"]: r for r in rows}


@pytest.mark.parametrize("target", VARIANTS)
def test_quantized_and_half_precision_splits(report, target):
    r = report[target]
    assert_split_holds(r)
    assert r["mlxlm"] == ("bit-exact" if target in BIT_EXACT_VARIANTS else "no shard()"), r


@pytest.mark.parametrize("target", REFUSED)
def test_quantized_splits_off_whole_groups_are_refused(report, target):
    r = report[target]
    assert r["status"] == "refused" and REFUSED[target] in r["reason"], r


# ----------------------------------------------------------------------------- without a launch


def _layers(name: str, zoo_root):
    from mlxbun.factory import open_model

    return open_model(locate(name, zoo_root=zoo_root)).layers


def test_moe_split_is_checked_before_any_expert_moves(zoo_root):
    moe = _layers("zoo:qwen3_moe", zoo_root)[0].mlp
    with pytest.raises(ShardingError, match=r"^x.mlp.switch_mlp.gate_proj: 64 output features do not split "
                                            r"into 3 equal parts \(tensor-parallel group of 3\)$"):
        moe.shard(FakeGroup(3), where="x.mlp")
    # gate / up split on 2 ranks, down's input would be half a quantization group: nothing moves
    moe = _layers("zoo:qwen3_moe@q4,head_dim=32", zoo_root)[0].mlp
    before = param_shapes(moe)
    with pytest.raises(ShardingError, match=r"x.mlp.switch_mlp.down_proj: a rank's 32 of 64 input features"):
        moe.shard(FakeGroup(2), where="x.mlp")
    assert param_shapes(moe) == before and moe._tensor_group is None


def test_mla_split_is_checked_before_any_weight_moves(zoo_root):
    for arch in ("deepseek_v2", "deepseek_v3", "mistral4", "deepseek_v32"):
        attn = _layers(f"zoo:{arch}", zoo_root)[0].self_attn
        with pytest.raises(ShardingError, match=r"^x.attn: 4 attention heads do not split across 3 ranks$"):
            attn.shard(FakeGroup(3), where="x.attn")
    attn = _layers("zoo:deepseek_v3@q4", zoo_root)[0].self_attn  # q_b_proj splits, o_proj does not
    before = param_shapes(attn)
    with pytest.raises(ShardingError, match=r"x.attn.o_proj: a rank's 32 of 64 input features"):
        attn.shard(FakeGroup(2), where="x.attn")
    assert param_shapes(attn) == before and attn.num_heads == 4


def test_quantized_multilinear_keeps_its_ranks_heads_exactly():
    """embed_q / unembed_out cut to a rank's heads (codes, scales and biases alike) compute those
    heads' outputs bit for bit."""
    mx.random.seed(0)
    whole = MultiLinear(64, 32, 4).to_quantized(group_size=64, bits=4)
    x = mx.random.normal((1, 4, 3, 64))
    for rank in range(2):
        part = copy.deepcopy(whole)
        slice_heads_inplace(part, FakeGroup(2, rank))
        heads = slice(2 * rank, 2 * rank + 2)
        assert part["weight"].shape[0] == part["scales"].shape[0] == part["biases"].shape[0] == 2
        assert mx.array_equal(part(x[:, heads]), whole(x)[:, heads]).item()


def test_split_experts_sum_to_the_whole_with_the_bias_once():
    """Each rank's experts (gate / up all-to-sharded, down sharded-to-all, down's bias / N), summed
    over the ranks as the block's all-sum does, give the whole experts' output."""
    mx.random.seed(1)
    whole = SwitchGLU(16, 32, 4, bias=True)
    whole.update({name: {"bias": mx.random.normal(whole[name].bias.shape)} for name in ("gate_proj", "up_proj",
                                                                                      "down_proj")})
    x, inds = mx.random.normal((1, 5, 16)), mx.array([[[0, 3], [1, 2], [2, 0], [3, 1], [1, 0]]], dtype=mx.uint32)
    parts = []
    for rank in range(2):
        part = copy.deepcopy(whole)
        shard_inplace_all([(f"e.{c}", part[c], s, seg) for c, s, seg in part.split_pieces()], FakeGroup(2, rank))
        assert part.down_proj.weight.shape == (4, 16, 16) and part.gate_proj.bias.shape == (4, 16)
        parts.append(part(x, inds))
    assert mx.allclose(parts[0] + parts[1], whole(x, inds), rtol=1e-5, atol=1e-6).item()
