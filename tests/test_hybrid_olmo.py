"""olmo_hybrid as a whole model: HF-layout checkpoints load as mlx-lm loads them, the two block
kinds (pre-norm delta net, post-norm attention) and their caches, generation and the recurrent
state equal mlx-lm's, the config knobs mlx-lm reads (linear_allow_neg_eigval, layer_types and its
default, rope_parameters) and the refusals of bad values. The logits of every variant against
mlx-lm are tests/test_universal_dense.py's (manifest)."""

import dataclasses

import mlx.core as mx
import pytest

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.loader import build_model, load_universal
from mlxbun.models.universal.schema import DescriptorError, NormNames
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import tiny_config
from tests.checkpoint_edits import rewrite_checkpoint

G, A = MixerKind.GATED_DELTA_SPLIT_CONV, MixerKind.ATTENTION
IDS = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])


def _oracle(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


@pytest.fixture(scope="module")
def olmo(zoo):
    return zoo("olmo_hybrid")


def _rewrite(src, dst, edit, config=None):
    """A copy of checkpoint `src` as one safetensors file (the hub's metadata), its weights passed
    through `edit`, its config.json updated with `config`."""
    return rewrite_checkpoint(src, dst, edit, config or None, fmt="pt")


def _torch_convs(weights: dict) -> dict:
    """The hub layout of the three depthwise convs: torch's [C, 1, K]."""
    return {k: (v.swapaxes(1, 2) if k.endswith("conv1d.weight") else v) for k, v in weights.items()}


def test_the_two_block_kinds_have_mlx_lms_parameters(olmo):
    model, ref = load_universal(olmo), _oracle(olmo)
    assert [s.mixer for s in model.args.layers] == [G, A, G]
    delta, attn = model.layers[0], model.layers[1]
    assert set(delta) == {"linear_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    assert set(attn) == {"self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"}
    from mlx.utils import tree_flatten

    ours = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert ours == {k: v.shape for k, v in tree_flatten(ref.parameters())}
    assert ours["model.layers.0.linear_attn.q_conv1d.weight"] == (64, 4, 1)  # 2 key heads x 32
    assert ours["model.layers.1.self_attn.q_norm.weight"] == (64,)  # flat: H * hd


def test_a_hub_checkpoint_loads_as_mlx_lm_loads_it(olmo, tmp_path):
    hf = _rewrite(olmo, tmp_path / "hf", _torch_convs)
    ours, ref = load_universal(hf), _oracle(hf)
    assert mx.array_equal(ours(IDS), ref(IDS))
    assert mx.array_equal(ours(IDS), load_universal(olmo)(IDS))  # the swap is lossless


def _fused_conv(weights: dict) -> dict:
    """transformers' save_pretrained layout: q | k | v convs fused into one linear_attn.conv1d."""
    out = {}
    for k, v in weights.items():
        if ".q_conv1d." in k:
            parts = [weights[k.replace("q_conv1d", t)] for t in ("q_conv1d", "k_conv1d", "v_conv1d")]
            out[k.replace("q_conv1d", "conv1d")] = mx.concatenate(parts, axis=0).swapaxes(1, 2)
        elif "_conv1d." not in k:
            out[k] = v
    return out


def test_a_fused_conv_checkpoint_is_refused_as_mlx_lm_refuses_it(olmo, tmp_path):
    from mlxbun.errors import LoadError

    fused = _rewrite(olmo, tmp_path / "fused", _fused_conv)
    with pytest.raises(LoadError, match="missing: model.layers.0.linear_attn.k_conv1d.weight"):
        load_universal(fused)
    with pytest.raises(ValueError, match="linear_attn.conv1d.weight"):
        _oracle(fused)


def test_a_tied_checkpoint_drops_its_lm_head(olmo, tmp_path):
    tied = _rewrite(olmo, tmp_path / "tied", _torch_convs, {"tie_word_embeddings": True})
    ours, ref = load_universal(tied), _oracle(tied)
    assert "lm_head.weight" in ours.audit.dropped and "lm_head" not in ours
    assert mx.array_equal(ours(IDS), ref(IDS))


def test_every_layer_gets_its_cache_and_the_state_is_mlx_lms(olmo):
    model, ref = load_universal(olmo), _oracle(olmo)
    ours, theirs = model.make_cache(), ref.make_cache()
    assert [type(c) for c in ours] == [ArraysCache, KVCache, ArraysCache]
    assert len(ours[0].cache) == 4
    for step in (IDS, IDS[:, :1], IDS[:, 1:2]):
        assert mx.array_equal(model(step, cache=ours), ref(step, cache=theirs))
    q_conv, k_conv, v_conv, state = ours[0].cache
    assert q_conv.shape == k_conv.shape == (1, 3, 64) and v_conv.shape == (1, 3, 64)
    assert state.shape == (1, 4, 16, 32) and state.dtype == mx.float32  # [Hv, Dv, Dk]
    for c, r in ((ours[0], theirs[0]), (ours[2], theirs[2])):
        assert all(mx.array_equal(x, y) for x, y in zip(c.cache, r.cache, strict=True))


def test_linear_allow_neg_eigval_is_read(olmo, tmp_path):
    """beta in [0, 1] instead of [0, 2]: other logits, still mlx-lm's."""
    plain = _rewrite(olmo, tmp_path / "plain", lambda w: w, {"linear_allow_neg_eigval": False})
    ours = load_universal(plain)
    assert mx.array_equal(ours(IDS), _oracle(plain)(IDS))
    assert not mx.array_equal(ours(IDS), load_universal(olmo)(IDS))


def test_layer_types_default_and_rope_theta_follow_mlx_lm():
    from mlx_lm.models.olmo_hybrid import ModelArgs

    cfg = {**tiny_config("olmo_hybrid"), "num_hidden_layers": 5, "layer_types": None,
           "rope_parameters": {"rope_type": "default"}, "rope_theta": 500.0}
    model = build_model(cfg)
    want = ModelArgs.from_dict(cfg)
    assert [s.mixer is A for s in model.args.layers] == [t == "full_attention" for t in want.layer_types]
    assert [s.mixer for s in model.args.layers] == [G, G, G, A, G]
    # rope_parameters without rope_theta: 10000.0, whatever rope_theta says (mlx-lm's post-init)
    assert model.args.layers[3].rope.base == want.rope_theta == 10000.0


@pytest.mark.parametrize("change,needle", [
    ({"layer_types": ["linear_attention", "full_attention"]},
     "'layer_types' has 2 entries for 3 layers"),
    ({"layer_types": ["full_attention"] * 3}, "leaves no gated_delta_split_conv layer"),
    ({"layer_types": "linear_attention"}, "'layer_types' must list every layer's kind name"),
    ({"linear_allow_neg_eigval": "yes"}, "'linear_allow_neg_eigval' must be true or false"),
    ({"layer_norm_epsilon": 0}, "'layer_norm_epsilon' must be a positive number"),
    ({"linear_num_value_heads": 3}, "'linear_num_value_heads' (3) must be divisible by"),
    ({"linear_conv_kernel_dim": None}, "'linear_conv_kernel_dim' must be a positive integer"),
    ({"rope_parameters": None, "rope_theta": None}, "'rope_theta' is null"),
    ({"rope_parameters": [10000.0]}, "'rope_parameters' must be an object"),
])
def test_bad_configs_refuse_naming_the_key(change, needle):
    with pytest.raises(ConfigError) as e:
        build_model({**tiny_config("olmo_hybrid"), **change})
    assert needle in str(e.value)


def test_coverage_reads_the_hub_config():
    cfg = tiny_config("olmo_hybrid")
    report = check_coverage("olmo_hybrid", cfg)
    assert report.ok and "linear_allow_neg_eigval" in report.understood
    assert "A_log" in report.ignored["linear_a_log_min"]
    odd = {**cfg, "layer_types": ["linear_attention", "mamba", "linear_attention"]}
    assert "'mamba'" in check_coverage("olmo_hybrid", odd).offending["layer_types"]
    gelu = check_coverage("olmo_hybrid", {**cfg, "hidden_act": "gelu"})
    assert "runs only 'silu'" in gelu.offending["hidden_act"]


def test_the_hybrid_block_knobs_are_checked_with_the_row():
    row = DESCRIPTORS["olmo_hybrid"]
    with pytest.raises(DescriptorError, match="hybrid.mixer_block and hybrid.mixer_norms"):
        dataclasses.replace(row, hybrid=dataclasses.replace(row.hybrid, mixer_norms=None))
    with pytest.raises(DescriptorError, match="slot\\(s\\) pre_mlp that hybrid.mixer_norms leaves unnamed"):
        dataclasses.replace(row, hybrid=dataclasses.replace(row.hybrid, mixer_norms=NormNames(pre_mlp=None)))
    with pytest.raises(DescriptorError, match="'type_list' needs hybrid.layer_types"):
        dataclasses.replace(row, hybrid=dataclasses.replace(row.hybrid, layer_types=()))
    with pytest.raises(DescriptorError, match="hybrid.mixer_norms must be a NormNames"):
        dataclasses.replace(row, hybrid=dataclasses.replace(row.hybrid, mixer_norms="input_layernorm"))


def test_explain_shows_both_block_kinds():
    from mlxbun.explain import explain

    text = explain("olmo_hybrid").text()
    assert "post-norm on the attention layers, pre-norm on the gated_delta_split_conv layers" in text
    assert "h = h + post_attention_layernorm(self_attn(h))" in text
    assert "h = h + linear_attn(input_layernorm(h))" in text
    assert "h = h + mlp(post_attention_layernorm(h))" in text
    assert "beta = sigmoid(b_proj(x)) * 2.0" in text and "cache slot 3" in text


@pytest.mark.parametrize("rollback", ["mixers", "model"])
def test_speculative_greedy_equals_plain_decoding(olmo, zoo, rollback):
    """Every drafter kind, k = 1..6: the four-slot recurrent caches roll back exactly."""
    from mlxbun.generate import stream_generate
    from mlxbun.speculative import DraftModelDrafter, LayerSkipDrafter, NGramDrafter, speculative_generate
    from tests.hybrid_models import IdTokenizer

    tok, prompt = IdTokenizer(), [(7 * i * i + 3 * i) % 256 for i in range(12)] * 2
    target, draft = load_universal(olmo), load_universal(zoo("olmo_hybrid", seed=1))
    # the zoo's EOS (id 2) masked out: every run makes max_tokens
    no_eos = [lambda tokens, logits: mx.where(mx.arange(logits.shape[-1]) == 2, -mx.inf, logits)]
    plain = [r.token for r in stream_generate(target, tok, prompt, max_tokens=12, logits_processors=no_eos)]
    assert len(plain) == 12
    drafters = {"ngram": NGramDrafter, "self:1": lambda: LayerSkipDrafter(1),
                "model@seed1": lambda: DraftModelDrafter(draft)}
    for name, make in drafters.items():
        for k in range(1, 7):
            got = [r.token for r in speculative_generate(target, tok, prompt, drafter=make(), num_draft=k,
                                                         max_tokens=12, rollback=rollback,
                                                         logits_processors=no_eos)]
            assert got == plain, (name, k)
