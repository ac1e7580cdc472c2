"""Tensor parallelism (issue 18): models split across 2 (and 3) local ranks over the ring backend.

Every zoo arch (float32: every one splits but the diffusion graphs), a set of dense half-precision and
quantized variants, and both real models go through `mlxbun tp-check` in one launch each: the split
against the whole model (greedy ids equal, logits within the stated tolerance of
`mlxbun.parallel.check`) and against mlx-lm's own split bit for bit wherever mlx-lm's model file has
`shard()`. The families' own variants and refusals are tests/test_tp_moe_mla.py's,
tests/test_tp_hybrid.py's and tests/test_tp_gemma3n.py's. The CLI runs split under `mlx.launch`
(generate, speculative decoding, bench), and the checks that refuse a split run without a launch.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxbun import zoo
from mlxbun.errors import MlxbunError
from mlxbun.models.sharding import ShardingError, repeat_heads, shard_linear
from mlxbun.parallel import ParallelError, tensor_group
from tests.tensor_parallel import (
    FakeGroup,
    assert_split_holds,
    failed_ranks,
    launch,
    launch_json,
    launch_json_once,
    mlxlm_has_shard,
)

# archs whose split is refused, and the words of the refusal (everything else must pass)
REFUSED = {
    "diffusion_gemma": "the diffusion-gemma graph (diffusion_gemma) has no tensor-parallel split; run it in one "
                       "process (--tp 1)",
    "llada2_moe": "has no tensor-parallel split; run it in one process (--tp 1)",
    "rwkv7": "has no tensor-parallel split in mlxbun; run it in one process (--tp 1)",
    "gear": "have no tensor-parallel split in mlxbun; run it in one process (--tp 1)",
    "afm7": "have no tensor-parallel split in mlxbun; run it in one process (--tp 1)",
}

EXTRA_VARIANTS = [  # half precision and quantized splits (q4 / q8 / mixed need heads of 32: group 64)
    "zoo:llama@bfloat16", "zoo:llama@float16", "zoo:qwen3@bfloat16", "zoo:gemma3_text@bfloat16",
    "zoo:mistral@float16", "zoo:phi3@bfloat16", "zoo:llama@q4,head_dim=32", "zoo:qwen3@q8,head_dim=32",
    "zoo:mistral@mixed,head_dim=32", "zoo:ministral3@q4,head_dim=32", "zoo:olmo2@q4,head_dim=32", "zoo:gemma3_text@q8,head_dim=32",
]
QUANT_REFUSED = "zoo:llama@q4"  # heads of 16: a rank's o_proj input is half a quantization group
BAD_NAME = "zoo:qwen2@q4,head_dim=32"  # a target that does not resolve is that target's refusal


@pytest.fixture(scope="module")
def zoo_report(zoo_root, run_tmp):
    rows = launch_json_once(run_tmp, "zoo", ["tp-check", "zoo:all", *EXTRA_VARIANTS, QUANT_REFUSED, BAD_NAME,
                                             "--variants", "float32"], env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    return {r["target"]: r for r in rows}


def _arch(target: str) -> str:
    return target.removeprefix("zoo:").split("@")[0]


@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_every_zoo_arch_splits_or_is_refused_by_name(zoo_report, zoo, arch):
    r = zoo_report[f"zoo:{arch}@float32"]
    assert r["ranks"] == 2
    if arch in REFUSED:
        assert r["status"] == "refused" and REFUSED[arch] in r["reason"], r
        return
    assert r["dtype"] == "float32"
    assert_split_holds(r)  # float32: every greedy id, no tie
    # where mlx-lm shards the arch, its split's logits are mlxbun's, bit for bit
    assert r["mlxlm"] == ("bit-exact" if mlxlm_has_shard(zoo(arch)) else "no shard()")


@pytest.mark.parametrize("target", EXTRA_VARIANTS)
def test_half_precision_and_quantized_splits(zoo_report, target):
    r = zoo_report[target]
    assert_split_holds(r)  # quantized weights: float32 activations; half: twice its own drift
    if _arch(target) in ("llama", "qwen3", "qwen2", "mistral", "ministral3"):
        assert r["mlxlm"] == "bit-exact"


def test_a_target_that_does_not_resolve_is_refused_not_fatal(zoo_report):
    r = zoo_report[BAD_NAME]
    assert r["status"] == "refused" and "has no head_dim setting, so its heads cannot be widened" in r["reason"]


def test_a_quantized_split_off_whole_groups_is_refused(zoo_report):
    r = zoo_report[QUANT_REFUSED]
    assert r["status"] == "refused"
    assert "o_proj: a rank's 32 of 64 input features are not whole quantization groups of 64" in r["reason"]


@pytest.mark.slow
def test_real_models_split_bit_exact_with_mlxlm_where_it_shards(gguf_cache, tmp_path_factory, real):
    env = {"MLXBUN_GGUF_CACHE": str(gguf_cache),
           "MLXBUN_REAL_CACHE": str(tmp_path_factory.getbasetemp().parent / "real-gguf")}
    # gemma3 dequantized (--quant none), as this check's float32 bound was measured on: its Q4_K / Q5_0
    # tensors now import packed, whose CPU matmuls sum in one pass and drift like the reference BLAS
    # (7.65e-6 of the largest logit against the 2^-17 bound; see parallel/check.py)
    _, gemma_dense = real("gemma3", quant="none")
    (gemma,), _ = launch_json(["tp-check", str(gemma_dense)], env=env)  # 4 heads, 1 KV head (repeated)
    assert gemma["status"] == "pass" and gemma["tokens_equal"], gemma
    assert gemma["mlxlm"] == "no shard()"  # mlx-lm's gemma3_text has none
    (smol,), _ = launch_json(["tp-check", "real:smollm2"], ranks=3, env=env)  # 9 heads, 3 KV heads
    assert smol["status"] == "pass" and smol["tokens_equal"], smol
    assert smol["mlxlm"] == "bit-exact" and smol["ranks"] == 3


# ----------------------------------------------------------------------------- the CLI under a launch


def _generate(env, *extra, ranks=2):
    out, done = launch_json(["generate", "--model", "zoo:llama", "--prompt", "Hello there", "--max-tokens", "12",
                             *extra], ranks=ranks, env=env)
    assert not failed_ranks(done), done.stderr
    return out


def test_generate_split_equals_one_process_and_only_rank_0_prints(zoo_root, capsys):
    from mlxbun.cli import main

    env = {"MLXBUN_ZOO_CACHE": str(zoo_root)}
    assert main(["generate", "--model", "zoo:llama", "--prompt", "Hello there", "--max-tokens", "12",
                 "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    split = _generate(env)  # launch_json parses exactly one JSON document: rank 1 printed nothing
    assert split["tokens"] == whole["tokens"] and split["tensor_parallel"] == {"ranks": 2}
    opted_out = _generate(env, "--tp", "1")  # every rank runs the whole model
    assert opted_out["tokens"] == whole["tokens"] and "tensor_parallel" not in opted_out
    spec = _generate(env, "--draft", "ngram:2", "--num-draft", "3")  # the split target verifies drafts
    assert spec["tokens"] == whole["tokens"] and spec["spec"]["drafts"] > 0
    fast = _generate(env, "--fast")  # the compiled decode step traces the all-sums too (L2-fast)
    assert fast["fast"]["fidelity"] == "L2-fast" and "compiled decode step" in fast["fast"]["path"]
    assert fast["tokens"] == whole["tokens"]


def test_generate_refusals_under_a_launch(zoo_root):
    env = {"MLXBUN_ZOO_CACHE": str(zoo_root)}
    done = launch(["generate", "--model", "zoo:llama", "--prompt", "Hi", "--tp", "4"], env=env)
    assert failed_ranks(done) and "--tp 4: this run was launched with 2 ranks" in done.stderr
    done = launch(["generate", "--model", "zoo:diffusion_gemma", "--prompt", "Hi", "--max-tokens", "2"], env=env)
    assert failed_ranks(done) and "diffusion-gemma graph (diffusion_gemma) has no tensor-parallel split" in done.stderr


def test_bench_split_reports_each_ranks_peak_memory(zoo_root, tmp_path):
    db = tmp_path / "results.sqlite"
    rows, done = launch_json(["bench", "--model", "zoo:llama", "--prompt-len", "16", "--gen-len", "4",
                              "--trials", "1", "--results", str(db)], env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    assert not failed_ranks(done), done.stderr
    assert {(r["engine"], r["test"]) for r in rows} == {(e, t) for e in ("mlxbun", "mlx-lm") for t in ("pp16", "tg4")}
    for r in rows:
        assert r["tensor_parallel"] == 2 and len(r["peak_memory_gb_per_rank"]) == 2
        assert all(v > 0 for v in r["peak_memory_gb_per_rank"]) and r["params"]["tp"] == 2
        assert r["checks"]["weights_shared"] and r["checks"]["same_greedy_tokens"]
        assert r["checks"]["prefill_logits_bit_exact"]  # both split, over the same arrays
    from mlxbun.results import open_results

    with open_results(db) as store:  # rank 0 recorded one run (rank 1 none)
        df = store.load("bench")
    assert df["run_id"].nunique() == 1
    assert len(df[df["metric"] == "peak_memory_gb.rank"]) == 8  # 2 engines x 2 tests x 2 ranks


# ----------------------------------------------------------------------------- without a launch


def test_tp_option_resolution_in_one_process():
    assert tensor_group(None) is None and tensor_group(1) is None
    with pytest.raises(ParallelError, match=r"--tp 2: this run is one process; start 2 with `mlx.launch -n 2"):
        tensor_group(2)
    with pytest.raises(ParallelError, match="positive"):
        tensor_group(0)


def test_split_checks_name_the_module_and_sizes():
    with pytest.raises(ShardingError, match=r"blk.o: 6 input features do not split into 4 equal parts"):
        shard_linear(nn.Linear(6, 8), "sharded-to-all", FakeGroup(4), where="blk.o")
    with pytest.raises(ShardingError, match=r"blk.qkv: 24 output features \(fused parts \[8, 8, 8\]\) do not "
                                            r"split into 3"):
        shard_linear(nn.Linear(4, 24), "all-to-sharded", FakeGroup(3), where="blk.qkv", segments=[8, 16])
    q = nn.QuantizedLinear(128, 8, group_size=64, bits=4)
    with pytest.raises(ShardingError, match="a rank's 32 of 128 input features are not whole quantization groups"):
        shard_linear(q, "sharded-to-all", FakeGroup(4), where="blk.down")
    with pytest.raises(ShardingError, match="Embedding is not a Linear"):
        shard_linear(nn.Embedding(4, 4), "all-to-sharded", FakeGroup(2), where="embed")


def test_universal_graph_refuses_heads_that_do_not_split(zoo):
    from mlxbun.factory import open_model

    model = open_model(zoo("llama"))  # 4 heads, 2 KV heads
    with pytest.raises(ShardingError, match=r"model.layers.0.self_attn: 4 attention heads do not split across 3"):
        model.shard(FakeGroup(3))
    one = open_model(zoo("llama"))
    one.shard(FakeGroup(1))  # a group of one changes nothing
    assert one.tensor_group is None


def test_repeated_kv_heads_serve_each_rank_its_query_heads():
    """KV heads fewer than the ranks (1 KV head, 2 ranks): each rank's copy is the head its query
    heads read unsharded."""
    proj = nn.Linear(4, 2 * 3)  # 2 KV heads of width 3
    before = proj.weight
    repeat_heads(proj, heads=2, n=4)  # 4 ranks: each KV head twice
    w = proj.weight.reshape(4, 3, 4)
    for r in range(4):
        assert mx.array_equal(w[r], before.reshape(2, 3, 4)[r // 2]).item()


def test_tp_check_needs_a_launch():
    from mlxbun.parallel.check import check_tensor_parallel

    with pytest.raises(MlxbunError, match="needs a launch of 2 or more ranks"):
        check_tensor_parallel("zoo:llama", FakeGroup(1))
