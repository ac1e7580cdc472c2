"""The universal graph's MoE block (models/universal/moe.py) against mlx-lm 0.32.2's own code.

Routers: every router kind against the mlx-lm block (or gate module, or compiled grouped
selection) it transcribes, on random inputs in float32 / bfloat16 / float16 and with a
quantized gate: the chosen experts (in order) and the combined output bit-exact. The fused
experts are replaced on both sides by the same recorder, so half-precision routing runs on
mlx's CPU backend (whose gather_mm takes float32 only). Then: per-expert Hugging Face
tensors stacked as mlx-lm's sanitize does, routing taps, and MoE rows refused at build.
gpt_oss: its block (router, clamped SwiGLU experts with biases) against mlx-lm's MLPBlock in
float32 / q4 / mxfp4, its HF mxfp4 layout sanitized as mlx-lm does, its layer pattern, and its
attention sinks over the caches (plain and rotating run them; quantized KV refuses as mlx-lm
does; TurboQuant attends through the fused kernel with them).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.errors import LoadError, UnsupportedModelError
from mlxbun.models.universal.loader import audit_checkpoint, build_model, load_universal
from mlxbun.models.universal.moe import MoEBlock, Router, Routing, _group_select
from mlxbun.models.universal.schema import (
    ArchDescriptor,
    DescriptorError,
    LayerKnobs,
    SanitizeRule,
)
from mlxbun.models.universal.schema_moe import (
    MoEKnobs,
    MoENames,
    RouterKnobs,
    SharedKnobs,
)
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo import tiny_config
from tests.checkpoint_edits import rewrite_checkpoint
from tests.dense_oracle import oracle, prompt_ids
from tests.universal_manifest import MANIFEST

MOE_ARCHS = sorted(a for a in MANIFEST if a in DESCRIPTORS and DESCRIPTORS[a].moe is not None)


def _pair(cfg: dict, seed: int = 0):
    """mlx-lm's model for `cfg` with random weights, and mlxbun's graph holding the same ones."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    ref = model_cls(args_cls.from_dict(cfg))
    mx.random.seed(seed)
    params = [(k, (1.0 + 0.1 * mx.random.normal(v.shape)) if "norm" in k else 0.3 * mx.random.normal(v.shape))
              for k, v in tree_flatten(ref.parameters())]
    ref.update(tree_unflatten(params))
    ours = build_model(cfg)
    ours.update(tree_unflatten(params))
    return ref, ours


def _two_layers(cfg: dict) -> dict:
    """The config cut to two layers, per-layer lists (layer_types, is_moe_layer, ...) too
    (nemotron_h's layer count is its layers_block_type's length)."""
    if "text_config" in cfg:  # a VLM wrapper (qwen3_5_moe): its text model's
        return {**cfg, "text_config": _two_layers(cfg["text_config"])}
    if "num_layers" in cfg:  # phixtral: already two layers, named its own way
        return cfg
    n = cfg.get("num_hidden_layers") or len(cfg["layers_block_type"])
    cut = {k: v[:2] for k, v in cfg.items() if isinstance(v, list) and len(v) == n}
    return {**cfg, **cut, "num_hidden_layers": 2}


class _Experts(nn.Module):
    """Stands in for the fused experts on both sides: records the chosen experts and returns a
    deterministic [.., k, D] of x and the expert ids (no gather_mm, so any dtype runs)."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "seen", [])

    def __call__(self, x, indices):
        self.seen.append(indices)
        return mx.expand_dims(x, -2) * (indices[..., None] + 1).astype(x.dtype)


def _moe_blocks(ref, ours, arch):
    d = DESCRIPTORS[arch]
    name = d.moe.names.block or d.names.mlp
    for i, spec in enumerate(ours.args.layers):
        if spec.moe:
            yield i, ref.layers[i][name], ours.layers[i][name]


@pytest.mark.parametrize("gate", ["float", "q4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_and_combine_match_mlx_lm_blocks(arch, dtype, gate):
    cfg = _two_layers(tiny_config(arch))
    ref, ours = _pair(cfg)
    if gate == "q4":  # the gates (and every other Linear) quantized, as a converted checkpoint
        nn.quantize(ref, group_size=32, bits=4)
        nn.quantize(ours, group_size=32, bits=4)
    dt = getattr(mx, dtype)
    cast = getattr(ref, "cast_predicate", lambda _: True)  # mlx-lm's (the names are the same)
    for model in (ref, ours):
        model.update(tree_unflatten([(k, v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating)
                                      else v) for k, v in tree_flatten(model.parameters())]))
    blocks = list(_moe_blocks(ref, ours, arch))
    assert blocks, f"{arch}: no MoE layer in the tiny config"
    switch = DESCRIPTORS[arch].moe.names.switch
    for i, ref_block, our_block in blocks:
        rec_ref, rec_ours = _Experts(), _Experts()
        setattr(ref_block, switch, rec_ref)
        setattr(our_block, switch, rec_ours)
        for shape in [(1, 40, 64), (2, 7, 64), (1, 1, 64)]:
            x = (2.0 * mx.random.normal(shape, key=mx.random.key(sum(shape) + i))).astype(dt)
            expected, got = ref_block(x), our_block(x)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert mx.array_equal(rec_ref.seen[-1], rec_ours.seen[-1]), f"layer {i} {shape}: experts differ"
            assert mx.array_equal(expected, got).item(), f"layer {i} {shape}: combined output differs"
        chosen = {tuple(sorted(t)) for t in rec_ours.seen[0].reshape(-1, rec_ours.seen[0].shape[-1]).tolist()}
        assert len(chosen) > 1, f"{arch} layer {i}: every token routed alike"


@pytest.mark.parametrize("arch", ["granitemoe", "glm4_moe", "dots1", "deepseek"])
def test_router_modules_return_what_mlx_lm_gates_return(arch):
    """Where mlx-lm's router is a module (MoEGate, GraniteMoeTopKGating), ours sits at its path and
    returns its (experts, weights) first."""
    ref, ours = _pair({**tiny_config(arch), "num_hidden_layers": 2}, seed=3)
    d = DESCRIPTORS[arch]
    for i, ref_block, our_block in _moe_blocks(ref, ours, arch):
        router = our_block.router
        assert isinstance(router, Router) and router is our_block[d.moe.names.gate] and not router.observer
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        inds, scores = ref_block[d.moe.names.gate](x)
        routing = router(x)
        assert isinstance(routing, Routing) and routing.logits.shape == (2, 9, our_block.router.n_experts)
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(scores, routing.weights)


@pytest.mark.parametrize("k_nonzero_guard, mlx_lm_fn", [(False, "glm4_moe"), (True, "dots1")])
@pytest.mark.parametrize("top_k, n_group, topk_group, scaling, norm", [
    (2, 1, 1, 1.0, True), (2, 2, 1, 2.5, True), (3, 4, 2, 1.0, False), (1, 2, 1, 1.5, True),
    (4, 4, 3, 2.5, True), (2, 8, 4, 1.0, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_noaux_selection_matches_mlx_lm(k_nonzero_guard, mlx_lm_fn, top_k, n_group, topk_group,
                                                scaling, norm, dtype):
    import importlib

    ref_fn = importlib.import_module(f"mlx_lm.models.{mlx_lm_fn}").group_expert_select
    gates = mx.random.normal((2, 13, 16), key=mx.random.key(top_k * 7 + n_group)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((16,), key=mx.random.key(5))
    want_inds, want = ref_fn(gates, bias, top_k, n_group, topk_group, scaling, norm)
    inds, got = _group_select(gates, bias, top_k, n_group, topk_group, scaling, norm, k_nonzero_guard, False)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


def _router_stub(**fields):
    """What a routing function reads off its Router (top_k, select, params), without a module."""
    from types import SimpleNamespace

    from mlxbun.models.universal.kinds import TopKSelect

    return SimpleNamespace(select=TopKSelect.NEG_FIRST, **fields)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("jitter_eps", [0.01, 0.0, 0.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("ties", [False, True])
def test_sparsemixer_matches_mlx_lm_phimoe(top_k, jitter_eps, dtype, ties):
    """phimoe's sparsemixer: k argmax rounds, each a precise softmax over the band of logits near the
    round's max, the chosen expert masked -inf; experts in pick order and weights bit-exact."""
    from mlx_lm.models.phimoe import sparsemixer

    from mlxbun.models.universal.moe import _sparsemixer

    gates = 2.0 * mx.random.normal((2, 11, 8), key=mx.random.key(top_k + 10 * ties))
    if ties:  # coarse values: equal logits and bands holding several experts
        gates = mx.round(gates * 2) / 2
    gates = gates.astype(getattr(mx, dtype))
    want_inds, want = sparsemixer(gates, top_k=top_k, jitter_eps=jitter_eps)
    inds, got = _sparsemixer(_router_stub(top_k=top_k, params={"jitter_eps": jitter_eps}), gates, None)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


def _blocks_match_in(arch: str, cfg: dict, dtype: str, gate_bits: int | None = None) -> None:
    """Every MoE block of `cfg`'s two models, cast to `dtype` (the gates quantized at `gate_bits`),
    with the recorder for experts: the same experts and combined output as mlx-lm's block."""
    ref, ours = _pair(cfg)
    if gate_bits is not None:
        for model in (ref, ours):
            nn.quantize(model, group_size=64, bits=gate_bits, class_predicate=lambda p, m: p.endswith(".gate"))
    dt = getattr(mx, dtype)
    cast = getattr(ref, "cast_predicate", lambda _: True)  # mlx-lm's (the names are the same)
    for model in (ref, ours):
        model.update(tree_unflatten([(k, v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating)
                                      else v) for k, v in tree_flatten(model.parameters())]))
    switch = DESCRIPTORS[arch].moe.names.switch
    for i, ref_block, our_block in _moe_blocks(ref, ours, arch):
        rec_ref, rec_ours = _Experts(), _Experts()
        setattr(ref_block, switch, rec_ref)
        setattr(our_block, switch, rec_ours)
        x = (2.0 * mx.random.normal((2, 9, 64), key=mx.random.key(i))).astype(dt)
        expected, got = ref_block(x), our_block(x)
        assert mx.array_equal(rec_ref.seen[-1], rec_ours.seen[-1]), f"layer {i}: experts differ"
        assert got.dtype == expected.dtype and mx.array_equal(expected, got).item(), f"layer {i}"


@pytest.mark.parametrize("changes", [
    {"moe_gate_act": "sigmoid"},
    {"moe_intermediate_size": 0, "moe_num_shared_experts": 1},  # experts as wide as the dense MLP
    {"moe_num_shared_experts": 0, "moe_layer_interval": 2, "moe_layer_end_index": None},
    {"moe_layer_start_index": [2, 1], "moe_layer_end_index": [1, 3], "use_bias": True},
])
def test_ernie4_5_moe_gate_layers_and_shared_experts_match_mlx_lm(changes):
    """f32_act_topk (float32 softmax / sigmoid, renorm by max(sum, 1e-12)), the start / end /
    interval layer rule (lists: min / max), the expert-width fallback and the shared experts
    against mlx-lm's Ernie4_5_MoeMLP and decoder layers."""
    from mlx_lm.models.ernie4_5_moe import Ernie4_5_MoeMLP

    cfg = {**tiny_config("ernie4_5_moe"), **changes}
    ref, ours = _pair(cfg)
    assert [s.moe for s in ours.args.layers] == [isinstance(layer.mlp, Ernie4_5_MoeMLP) for layer in ref.layers]
    assert any(s.moe for s in ours.args.layers) and not all(s.moe for s in ours.args.layers)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))
    for dtype in ("bfloat16", "float16"):
        _blocks_match_in("ernie4_5_moe", cfg, dtype)


@pytest.mark.parametrize("changes, key", [
    ({"moe_gate_act": "relu"}, "'moe_gate_act' = 'relu' is not supported"),
    ({"moe_layer_interval": 0}, "'moe_layer_interval' must be a positive integer"),
])
def test_ernie4_5_moe_refuses_what_mlx_lm_cannot_build(changes, key):
    from mlxbun.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        build_model({**tiny_config("ernie4_5_moe"), **changes})


@pytest.mark.parametrize("gate_bits", [None, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_minimax_sigmoid_corrected_router_matches_mlx_lm_block(dtype, gate_bits):
    """sigmoid_corrected: the gate on x in float32 (quantized at 8 bits as mlx-lm's quant_predicate
    leaves it), the block-level correction bias kept float32 (mlx-lm's cast_predicate) steering the
    choice, weights renormalized by sum + 1e-20 and cast to x's dtype; against MiniMaxSparseMoeBlock."""
    cfg = tiny_config("minimax_m2")
    ref, ours = _pair(cfg)
    block = ours.layers[0]["block_sparse_moe"]
    assert block.router.observer and block["e_score_correction_bias"].shape == (4,)
    assert "e_score_correction_bias" not in dict(tree_flatten(block.router.parameters()))
    _blocks_match_in("minimax", cfg, dtype, gate_bits)


# ----------------------------------------------------------------- sanitize: HF per-expert tensors


def _unstack(weights: dict, block: str, switch: str, rename: dict[str, str], keys=("weight",)) -> dict:
    """mlx-layout fused experts back to Hugging Face's per-expert tensors."""
    out = {}
    for k, v in weights.items():
        head, sep, tail = k.partition(f".{block}.{switch}.")
        name, _, key = tail.partition(".")
        if sep and name in rename and key in keys:
            for e in range(v.shape[0]):
                out[f"{head}.{block}.experts.{e}.{rename[name]}.{key}"] = v[e]
        else:
            out[k] = v
    return out


_SAME = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_W123 = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


@pytest.mark.parametrize("arch, quant, block, switch, rename, keys", [
    ("qwen3_moe", None, "mlp", "switch_mlp", _SAME, ("weight",)),
    ("qwen2_moe", 4, "mlp", "switch_mlp", _SAME, ("weight", "scales", "biases")),
    ("mixtral", None, "block_sparse_moe", "switch_mlp", _W123, ("weight",)),
    ("mixtral", 8, "block_sparse_moe", "switch_mlp", _W123, ("weight", "scales", "biases")),
    ("olmoe", None, "mlp", "switch_mlp", _SAME, ("weight",)),
    ("dots1", None, "mlp", "experts", _SAME, ("weight",)),
    ("deepseek", None, "mlp", "switch_mlp", _SAME, ("weight",)),
    ("phimoe", 4, "block_sparse_moe", "switch_mlp", _W123, ("weight", "scales", "biases")),
    ("ernie4_5_moe", None, "mlp", "switch_mlp", _SAME, ("weight",)),
    ("minimax_m2", None, "block_sparse_moe", "switch_mlp", _W123, ("weight",)),
    ("Klear", None, "mlp", "experts", _SAME, ("weight",)),
    ("afmoe", 4, "mlp", "experts", _SAME, ("weight", "scales", "biases")),
    ("mellum", None, "mlp", "switch_mlp", _SAME, ("weight",)),
])
def test_per_expert_hf_tensors_are_stacked_like_mlx_lm(zoo, tmp_path, arch, quant, block, switch, rename, keys):
    path = rewrite_checkpoint(zoo(arch, quant=quant), tmp_path / arch,
                              lambda w: _unstack(w, block, switch, rename, keys))
    names = mx.load(str(path / "model.safetensors"))
    assert any(".experts.3." in k for k in names)
    assert not any(f".{switch}.{n}." in k for k in names for n in rename)
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_a_missing_expert_is_a_load_error_naming_it(zoo, tmp_path):
    path = rewrite_checkpoint(zoo("qwen3_moe"), tmp_path / "gap", lambda w: {
        k: v for k, v in _unstack(w, "mlp", "switch_mlp", _SAME).items()
        if k != "model.layers.1.mlp.experts.2.up_proj.weight"})
    with pytest.raises(LoadError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        load_universal(path)


def test_granitemoe_input_linear_is_split_like_mlx_lm(zoo, tmp_path):
    def to_hf(w):
        out = dict(w)
        for layer in range(2):
            p = f"model.layers.{layer}.block_sparse_moe"
            gate = out.pop(f"{p}.switch_mlp.gate_proj.weight")
            up = out.pop(f"{p}.switch_mlp.up_proj.weight")
            out[f"{p}.input_linear.weight"] = mx.concatenate([gate, up], axis=1)
            out[f"{p}.output_linear.weight"] = out.pop(f"{p}.switch_mlp.down_proj.weight")
        return out

    path = rewrite_checkpoint(zoo("granitemoe"), tmp_path / "granitemoe", to_hf)
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_glm4_moe_drops_the_mtp_layer_and_stacks_experts(zoo, tmp_path):
    mtp = {"model.layers.2.eh_proj.weight": mx.ones((64, 128)), "model.layers.2.enorm.weight": mx.ones((64,))}
    path = rewrite_checkpoint(zoo("glm4_moe"), tmp_path / "glm", lambda w: {
        **_unstack(w, "mlp", "switch_mlp", _SAME), **mtp})
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == set(mtp)
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_ernie4_5_moe_drops_mtp_weights_and_the_correction_bias(zoo, tmp_path):
    extra = {"model.mtp_block.0.mlp.up_proj.weight": mx.ones((128, 64)),
             "model.mtp_linear_proj.0.weight": mx.ones((64, 128)),
             "model.mtp_hidden_norm.0.weight": mx.ones((64,)), "model.mtp_emb_norm.0.weight": mx.ones((64,)),
             "model.layers.1.mlp.moe_statics.e_score_correction_bias": mx.zeros((1, 4))}
    path = rewrite_checkpoint(zoo("ernie4_5_moe"), tmp_path / "ernie", lambda w: {
        **_unstack(w, "mlp", "switch_mlp", _SAME), **extra})
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == set(extra)
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_minimax_fp8_block_weights_dequantize_like_mlx_lm(zoo, tmp_path):
    """minimax.sanitize: fp8 weights (raw bytes) times their 128x128-block weight_scale_inv, as
    bfloat16, before the per-expert stacking; against mlx-lm's sanitize and a full load."""
    from mlx_lm.models.minimax import Model as RefModel
    from mlx_lm.models.minimax import ModelArgs

    from mlxbun.models.universal.sanitize import sanitize_weights

    cfg = tiny_config("minimax_m2")
    big = mx.random.normal((300, 200), key=mx.random.key(1))  # 3 x 2 blocks, padded at the edges
    weights = {"model.layers.0.self_attn.q_proj.weight": mx.to_fp8(big),
               "model.layers.0.self_attn.q_proj.weight_scale_inv": mx.random.uniform(shape=(3, 2)) + 0.5,
               "model.norm.weight": mx.ones((64,))}
    ours = build_model(cfg)
    want = RefModel(ModelArgs.from_dict(cfg)).sanitize(dict(weights))
    got, dropped = sanitize_weights(ours.descriptor, weights, False, ours.args.fields)
    assert set(got) == set(want) and set(dropped) == {"model.layers.0.self_attn.q_proj.weight_scale_inv"}
    assert all(got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]) for k in want)

    def to_fp8(w):  # the attention projections as an fp8 hub checkpoint ships them (bfloat16
        # experts would not run: mlx's CPU gather_mm takes float32 only), the experts per expert
        out = {}
        for k, v in _unstack(w, "block_sparse_moe", "switch_mlp", _W123).items():
            if ".self_attn." in k and k.endswith("_proj.weight"):
                out[k] = mx.to_fp8(v)
                out[f"{k}_scale_inv"] = mx.array([[0.75]])
            else:
                out[k] = v
        return out

    path = rewrite_checkpoint(zoo("minimax_m2"), tmp_path / "fp8", to_fp8)
    report = audit_checkpoint(path)
    assert report.ok and all(k.endswith("weight_scale_inv") for k in report.dropped)
    ref, ours = oracle(path), load_universal(path)
    assert ours.layers[0]["self_attn"]["q_proj"].weight.dtype == mx.bfloat16
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_half_precision_experts_refuse_where_gather_mm_takes_float32_only(zoo):
    from mlxbun.models.switch_layers import gather_mm_supported
    from mlxbun.zoo.archs import ARCHS, moe_archs, runnable_variants

    if gather_mm_supported("float16"):
        pytest.skip("this device runs gather_mm in float16")
    with pytest.raises(UnsupportedModelError, match="float16 experts.*gather_mm in float32 only"):
        load_universal(zoo("mixtral", dtype="float16"))
    with pytest.raises(RuntimeError, match="GatherMM"):  # mlx-lm cannot run them either
        mx.eval(oracle(zoo("mixtral", dtype="float16"))(prompt_ids(4)))
    # the manifest gates exactly what this device runs
    for arch in MANIFEST:
        assert MANIFEST[arch].variants == runnable_variants(arch), arch
    # the MoE archs (the H200 run's list: benchmarks/gpu_h200.sh moe) are those that lose them
    assert moe_archs() == tuple(a for a in ARCHS if "float16" not in runnable_variants(a))
    assert {"mixtral", "qwen3_moe", "deepseek"} <= set(moe_archs()) and "llama" not in moe_archs()


# ----------------------------------------------------------------- taps


def test_routing_is_tappable_per_layer_and_localization_skips_mlxbun_only_routers(zoo):
    from mlxbun.parity.localize import first_divergence

    path = zoo("qwen3_moe")
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    with ours.layers_tap(lambda p, m: isinstance(m, Router)) as taps:
        ours(ids)
    assert sorted(taps) == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    assert taps.observers == set(taps)
    for path_, outs in taps.items():
        (routing,) = taps.tuples[path_]
        assert isinstance(routing, Routing) and mx.array_equal(outs[0], routing.experts)
        assert routing.experts.shape == (1, 40, 2) and routing.weights.shape == (1, 40, 2)
        assert routing.logits.shape == (1, 40, 4)
        assert mx.allclose(routing.weights.sum(-1), mx.ones((1, 40)), atol=1e-6)  # norm_topk_prob
    # every module of the MoE blocks: the routers are ours only, the rest is bit-equal
    inside = lambda p, m: ".mlp" in p  # noqa: E731
    assert first_divergence(ours, ref, ids[0].tolist(), [5, 9], paths=inside) is None


# ----------------------------------------------------------------- bad rows


def _row(base: str, **changes) -> ArchDescriptor:
    """A copy of a real row with some knobs changed: built (and checked) again."""
    return dataclasses.replace(DESCRIPTORS[base], model_type="my_moe", **changes)


_QWEN3_MOE, _GLM = "qwen3_moe", "glm4_moe"
_NOAUX = {"scaling": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group"}


@pytest.mark.parametrize("build, knob, accepted", [
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("softmax_top_k"))),
     "moe.router.kind = 'softmax_top_k'", "'noaux_tc'"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(layers="every")),
     "moe.layers = 'every'", "'first_k_dense_freq'"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(combine="mean")),
     "moe.combine = 'mean'", "'sum_cast'"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(experts="n_experts")),
     "moe.experts reads the field 'n_experts'", "num_experts"),
    (lambda: _row(_GLM, moe=MoEKnobs(
        experts="n_routed_experts", router=RouterKnobs("noaux_tc", gate="weight",
                                                       params={"n_group": "n_group", "topk_group": "topk_group"}))),
     "moe.router.params for kind 'noaux_tc' must name exactly scaling, n_group, topk_group", "got n_group"),
    (lambda: _row(_GLM, moe=MoEKnobs(
        experts="n_routed_experts", router=RouterKnobs("noaux_tc", params={
            "scaling": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group"}))),
     "moe.router.gate must be 'weight' or 'nested'", "correction bias"),
    (lambda: _row(_GLM, moe=MoEKnobs(
        experts="n_routed_experts", router=RouterKnobs("noaux_tc", gate="weight", params={
            "scaling": "routed_scaling", "n_group": 1, "topk_group": 1}))),
     "moe.router.params['scaling'] reads the field 'routed_scaling'", "routed_scaling_factor"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(
        router=RouterKnobs("topk_softmax", norm_topk="norm_topk_prob"))),
     "moe.router.norm_topk with 'topk_softmax'", "already normalized"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("softmax_topk", params={"n_group": "num_experts"}))),
     "for kind 'softmax_topk' must name exactly nothing", "got n_group"),
    (lambda: _row(_GLM, moe=MoEKnobs(experts="n_routed_experts", shared=SharedKnobs())),
     "'moe_times_n' needs moe.shared.count", "n_shared_experts"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(names=MoENames(router="switch_mlp"))),
     "one name", "switch_mlp"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("sparsemixer"))),
     "for kind 'sparsemixer' must name exactly jitter_eps", "got nothing"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("f32_act_topk", norm_topk=True,
                                                              params={"act": "softmax"}))),
     "moe.router.norm_topk with 'f32_act_topk'", "fixes whether"),
    (lambda: _row(_GLM, moe=MoEKnobs(experts="n_routed_experts", router=RouterKnobs(
        "noaux_tc", gate="weight", gate_f32=True, params=_NOAUX))),
     "moe.router.gate_f32", "must be 'linear'"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(layers="start_end_interval")),
     "moe.layers reads the field 'moe_layer_start_index'", "num_experts"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(shared=SharedKnobs(count="num_experts", when="num_experts", when_rule="above_zero"))),
     "moe.shared.when_rule = 'above_zero'", "'positive'"),
    (lambda: _row(_QWEN3_MOE, moe=None, sanitize=(SanitizeRule("stack_experts"),)),
     "need a moe block", "stack_experts"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(), sanitize=(SanitizeRule("stack_experts"),)),
     "takes a StackExperts arg", "stack_experts"),
    (lambda: _row("gpt_oss", attention="sdpa_q_f32"),
     "sinks with attention 'sdpa_q_f32'", "'sdpa'"),
    (lambda: _row("gpt_oss", moe=None),
     "need a moe block", "split_interleaved_experts"),
])
def test_a_bad_moe_row_fails_when_built(build, knob, accepted):
    with pytest.raises(DescriptorError) as e:
        build()
    msg = str(e.value)
    assert msg.startswith("descriptor 'my_moe': ") and knob in msg and accepted in msg


def test_moe_rows_hold_enums_and_the_graph_places_blocks_where_mlx_lm_does():
    from mlxbun.models.universal.kinds import GateKind, RouterKind

    d = DESCRIPTORS["glm4_moe"]
    assert d.moe.router.kind is RouterKind.NOAUX_TC and d.moe.router.gate is GateKind.WEIGHT
    for arch in MOE_ARCHS:
        from mlx_lm.utils import _get_classes

        cfg = tiny_config(arch)
        model_cls, args_cls = _get_classes(cfg)
        ref, ours = model_cls(args_cls.from_dict(cfg)), build_model(cfg)
        name = DESCRIPTORS[arch].moe.names.block or DESCRIPTORS[arch].names.mlp
        ref_moe = ["switch_mlp" in layer[name] or "experts" in layer[name] for layer in ref.layers]
        assert [isinstance(layer[name], MoEBlock) for layer in ours.layers] == ref_moe, arch
        assert [s.moe for s in ours.args.layers] == ref_moe


def test_resolve_refuses_top_k_above_the_expert_count():
    from mlxbun.errors import ConfigError

    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        build_model({**tiny_config("qwen3_moe"), "num_experts_per_tok": 5})
    # a config whose layers are all dense resolves no MoE numbers at all
    dense = build_model({**tiny_config("qwen3_moe"), "mlp_only_layers": [0, 1]})
    assert dense.args.moe is None and not any(isinstance(layer["mlp"], MoEBlock) for layer in dense.layers)
    assert [s.moe for s in dense.args.layers] == [False, False]


def test_layer_diff_against_mlx_lm_is_all_equal_on_an_moe_model(zoo):
    from mlxbun.parity.layer_diff import layer_diff

    path = zoo("mixtral", quant=4)
    ref, ours = oracle(path), load_universal(path)
    diff = layer_diff(ours, ref, prompt_ids(40)[0].tolist(), [7, 3], paths=lambda p, m: "layers" in p)
    assert diff.first_difference() is None
    assert any(r["path"].endswith("block_sparse_moe.switch_mlp") for r in diff.records)
    assert not any(r["path"].endswith(".router") for r in diff.records)


def test_router_gates_keep_the_precision_mlx_lm_quantizes_them_at(zoo):
    """mlx-lm's convert quantizes qwen3_moe's mlp.gate and granitemoe's router.layer at 8 bits
    (their quant_predicate; granitemoe's "mlp.down_proj" suffix also catches switch_mlp.down_proj)
    and the other experts at the requested 4; deepseek-style raw gate weights
    are never quantized. The loader follows the checkpoint, module by module."""
    from mlxbun.models.switch_layers import QuantizedSwitchLinear

    qwen = load_universal(zoo("qwen3_moe", quant=4)).layers[0]["mlp"]
    assert isinstance(qwen["gate"], nn.QuantizedLinear) and qwen["gate"].bits == 8
    assert isinstance(qwen["switch_mlp"]["up_proj"], QuantizedSwitchLinear) and qwen["switch_mlp"]["up_proj"].bits == 4
    granite = load_universal(zoo("granitemoe", quant=4)).layers[0]["block_sparse_moe"]
    assert granite["router"]["layer"].bits == 8 and granite["switch_mlp"]["down_proj"].bits == 8
    assert granite["switch_mlp"]["up_proj"].bits == 4
    glm = load_universal(zoo("glm4_moe", quant=4)).layers[1]["mlp"]
    assert glm["gate"]["weight"].dtype == mx.float32 and glm["switch_mlp"]["gate_proj"].bits == 4
    # gpt_oss's quant_predicate: the router at 8 bits (affine, group 64), also under --q-mode mxfp4
    for quant, mode in ((4, "affine"), ("mxfp4", "mxfp4")):
        oss = load_universal(zoo("gpt_oss", quant=quant)).layers[0]["mlp"]
        assert (oss["router"].bits, oss["router"].group_size, oss["router"].mode) == (8, 64, "affine")
        assert oss["experts"]["up_proj"].bits == 4 and oss["experts"]["up_proj"].mode == mode


# ----------------------------------------------------------------- exaone_moe


@pytest.mark.parametrize("top_k, n_group, topk_group, scaling, norm", [
    (2, 1, 1, 2.5, True), (2, 2, 1, 2.5, True), (3, 4, 2, 1.0, False), (1, 2, 1, 1.5, True),
    (2, 8, 4, 1.0, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exaone_moe_selection_adds_eps_to_the_renormalizing_sum(top_k, n_group, topk_group, scaling,
                                                                 norm, dtype):
    from mlx_lm.models.exaone_moe import group_expert_select

    gates = mx.random.normal((2, 13, 16), key=mx.random.key(top_k * 5 + n_group)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((16,), key=mx.random.key(6))
    want_inds, want = group_expert_select(gates, bias, top_k, n_group, topk_group, scaling, norm)
    inds, got = _group_select(gates, bias, top_k, n_group, topk_group, scaling, norm, False, True)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


def test_exaone_moe_gate_module_matches_mlx_lm_and_renorm_eps_is_checked():
    ref, ours = _pair({**tiny_config("exaone_moe")}, seed=4)
    blocks = list(_moe_blocks(ref, ours, "exaone_moe"))
    assert [i for i, _, _ in blocks] == [1, 2, 3]  # is_moe_layer: layer 0 dense
    for i, ref_block, our_block in blocks:
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        inds, scores = ref_block["gate"](x)
        routing = our_block.router(x)
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(scores, routing.weights)
    with pytest.raises(DescriptorError, match="renorm 'sum_eps' is a branch of kind 'noaux_tc'"):
        _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("softmax_topk", renorm="sum_eps")))


@pytest.mark.parametrize("edit", ["all_global", "no_shared", "bad_is_moe_layer"])
def test_exaone_moe_config_branches_match_mlx_lm(edit):
    """Every layer global (mlx-lm then ropes every layer), num_shared_experts 0 (no shared
    expert), and an is_moe_layer list shorter than the layers (a clear refusal)."""
    from mlxbun.errors import ConfigError

    cfg = tiny_config("exaone_moe")
    if edit == "all_global":
        cfg["layer_types"] = ["full_attention"] * 4
    elif edit == "no_shared":
        cfg["num_shared_experts"] = 0
    else:
        with pytest.raises(ConfigError, match="'is_moe_layer' must be a list of 4 bools"):
            build_model({**cfg, "is_moe_layer": [False, True]})
        return
    ref, ours = _pair(cfg, seed=2)
    assert sorted(k for k, _ in tree_flatten(ref.parameters())) == \
        sorted(k for k, _ in tree_flatten(ours.parameters()))
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))
    if edit == "all_global":
        assert all(s.rope is not None for s in ours.args.layers)


def test_exaone_moe_hf_layout_is_sanitized_like_mlx_lm(zoo, tmp_path):
    """Per-expert tensors stacked, the block-level correction bias moved onto the gate, mtp.*
    dropped (MoE layers only, as mlx-lm's sanitize)."""
    def to_hf(w):
        out = _unstack(w, "mlp", "switch_mlp", _SAME)
        for layer in (1, 2, 3):
            p = f"model.layers.{layer}.mlp"
            out[f"{p}.e_score_correction_bias"] = out.pop(f"{p}.gate.e_score_correction_bias")
        out["mtp.fc.weight"] = mx.ones((64, 128))
        return out

    path = rewrite_checkpoint(zoo("exaone_moe"), tmp_path / "exaone_moe", to_hf)
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == {"mtp.fc.weight"}
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


# ----------------------------------------------------------------- bailing_moe


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("top_k, n_group, topk_group, scaling, norm", [
    (2, 1, 4, 1.0, True), (2, 2, 1, 2.5, True), (3, 4, 2, 1.0, False), (1, 2, 1, 1.5, True),
    (2, 8, 4, 2.5, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_bailing_grouped_score_selection_matches_mlx_lm(score, with_bias, top_k, n_group, topk_group,
                                                        scaling, norm, dtype):
    from mlx_lm.models.bailing_moe import group_expert_select

    from mlxbun.models.universal.moe import _grouped_score_select

    gates = mx.random.normal((2, 13, 16), key=mx.random.key(top_k * 3 + n_group)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((16,), key=mx.random.key(7)) if with_bias else None
    args = (top_k, n_group, topk_group, scaling, norm, score)
    want_inds, want = group_expert_select(gates, bias, *args)
    inds, got = _grouped_score_select(gates, bias, *args)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got)
    assert got.dtype == want.dtype == gates.dtype  # the weights come back in the logits' dtype


@pytest.mark.parametrize("edit", [
    {"score_function": "softmax", "moe_router_enable_expert_bias": False, "n_group": 1},
    {"rotary_dim": None, "moe_shared_expert_intermediate_size": None, "num_shared_experts": 2},
    {"moe_router_enable_shared_expert": False, "use_bias": True, "use_qkv_bias": True,
     "use_qk_norm": False, "first_k_dense_replace": 0},
    {"tie_word_embeddings": True, "partial_rotary_factor": 1.0, "rotary_dim": None},
], ids=["softmax_no_bias", "partial_rope_shared_x2", "no_shared_biases", "tied_full_rope"])
def test_bailing_moe_config_branches_match_mlx_lm(edit):
    """The Ling-1 style softmax router without expert bias, rope from partial_rotary_factor, the
    shared expert switched off, biases on, tied head: same parameters, same logits."""
    ref, ours = _pair({**tiny_config("bailing_moe"), **edit}, seed=5)
    assert sorted(k for k, _ in tree_flatten(ref.parameters())) == \
        sorted(k for k, _ in tree_flatten(ours.parameters()))
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))
    for i, ref_block, our_block in _moe_blocks(ref, ours, "bailing_moe"):
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i)).astype(mx.bfloat16)
        inds, scores = ref_block["gate"](x)
        routing = our_block.router(x)
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(scores, routing.weights)


def test_bailing_moe_hf_layout_and_norm_head_are_sanitized_like_mlx_lm(zoo, tmp_path):
    """Per-expert tensors stacked, mlp.gate.weight moved to mlp.gate.gate_proj.weight (MoE layers
    only), and norm_head: lm_head divided by its column norms at load, on both sides."""
    def to_hf(w):
        out = _unstack(w, "mlp", "switch_mlp", _SAME)
        out["model.layers.1.mlp.gate.weight"] = out.pop("model.layers.1.mlp.gate.gate_proj.weight")
        return out

    path = rewrite_checkpoint(zoo("bailing_moe"), tmp_path / "bailing_moe", to_hf,
                              config=lambda c: {**c, "norm_head": True})
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    ref, ours = oracle(path), load_universal(path)
    norms = mx.linalg.norm(ours["lm_head"].weight, axis=0)
    assert mx.allclose(norms, mx.ones_like(norms), atol=1e-5)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))
    tied = rewrite_checkpoint(zoo("bailing_moe"), tmp_path / "tied", lambda w: w,
                              config=lambda c: {**c, "norm_head": True, "tie_word_embeddings": True})
    with pytest.raises(LoadError, match="norm_head is set but the checkpoint has no lm_head.weight"):
        load_universal(tied)


# ----------------------------------------------------------------- hunyuan


@pytest.mark.parametrize("edit", [
    {},
    {"use_cla": False},
    {"cla_share_factor": 3},
    {"moe_topk": 1, "num_shared_expert": 2, "moe_intermediate_size": 64},
    {"moe_intermediate_size": None, "use_mixed_mlp_moe": False},
    {"num_experts": 1},
    {"attention_bias": True, "use_qk_norm": False},
], ids=["cla2", "no_cla", "cla3", "scalars", "fallback_width_no_shared", "single_expert", "bias_no_qk_norm"])
def test_hunyuan_config_branches_match_mlx_lm(edit):
    """CLA on / off / every third layer, int or per-layer-list MoE numbers, the expert width
    falling back to intermediate_size, no shared MLP, one expert (every layer dense): the same
    parameters (sharing layers have no k_proj / v_proj) and the same logits as mlx-lm's module."""
    cfg = {**tiny_config("hunyuan"), **edit}
    ref, ours = _pair(cfg, seed=6)
    assert sorted(k for k, _ in tree_flatten(ref.parameters())) == \
        sorted(k for k, _ in tree_flatten(ours.parameters()))
    factor = cfg["cla_share_factor"] if cfg["use_cla"] else 1
    assert [s.kv_proj for s in ours.args.layers] == [i % factor == 0 for i in range(4)]
    assert [("k_proj" in layer["self_attn"]) for layer in ours.layers] == [s.kv_proj for s in ours.args.layers]
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))
    for i, ref_block, our_block in _moe_blocks(ref, ours, "hunyuan"):
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        assert our_block.router.observer  # mlx-lm's gate returns logits; routing is ours only
        assert mx.array_equal(ref_block["gate"](x), our_block["gate"](x))
        assert our_block.router(x, our_block["gate"](x)).experts.shape[-1] == ref_block.top_k
        assert mx.array_equal(ref_block(x), our_block(x))


def test_hunyuan_decode_through_caches_matches_mlx_lm_layer_by_layer():
    """Prefill then decode steps through each side's own caches: every decoder layer's output
    (the block returns (h, kv projections), as mlx-lm's; taps record h) and every attention's
    output bit-equal, sharing layers included."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxbun.models.taps import capture

    ref, ours = _pair(tiny_config("hunyuan"), seed=8)
    ref_cache, our_cache = make_prompt_cache(ref), ours.make_cache()
    pick = lambda p, m: p.startswith("model.layers.") and p.count(".") in (2, 3) and "mlp" not in p  # noqa: E731
    ids = prompt_ids(20)
    for step in range(4):
        with capture(ours, pick) as got, capture(ref, pick) as want:
            ours(ids, cache=our_cache)
            logits = ref(ids, cache=ref_cache)
        assert sorted(got) == sorted(want) and "model.layers.1.self_attn" in got
        for path in want:
            assert mx.array_equal(want[path][0], got[path][0]).item(), f"step {step}: {path}"
        ids = mx.argmax(logits[:, -1:], axis=-1)


@pytest.mark.parametrize("edit, match", [
    ({"rope_scaling": None}, "rope_scaling needs the key 'alpha'"),
    ({"rope_scaling": {"factor": 1.0, "type": "dynamic"}}, "rope_scaling needs the key 'alpha'"),
    ({"rope_scaling": {"alpha": 1000.0}}, r"rope_scaling must contain keys \{'factor', 'type'\}"),
    ({"moe_topk": [2, 2]}, "'moe_topk' lists 2 values; layer 2 has none"),
    ({"cla_share_factor": 0}, "'cla_share_factor' must be a positive integer"),
])
def test_hunyuan_configs_mlx_lm_cannot_build_are_refused_clearly(edit, match):
    from mlxbun.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_model({**tiny_config("hunyuan"), **edit})


def test_kv_share_needs_separate_projections_and_a_sequential_block():
    from mlxbun.models.universal.schema import LayerKnobs

    with pytest.raises(DescriptorError, match="layers.kv_share takes separate q/k/v projections"):
        _row("bailing_moe", layers=LayerKnobs(kv_share="cla"))


def test_hunyuan_fused_qkv_and_gate_up_layout_is_split_like_mlx_lm(zoo, tmp_path):
    """Hunyuan's original layout (one expert, so dense MLPs): qkv_proj packed per kv head as
    [q heads of the group | k | v] and gate_and_up_proj as [up | gate]; mlx-lm's sanitize splits
    them (sharing layers have a plain q_proj)."""
    cfg = {**tiny_config("hunyuan"), "num_experts": 1}
    ref, _ = _pair(cfg, seed=9)
    n_kv, groups, hd = cfg["num_key_value_heads"], cfg["num_attention_heads"] // cfg["num_key_value_heads"], 16

    def fused(_):
        w = dict(tree_flatten(ref.parameters()))
        for i in range(4):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            if f"{a}.k_proj.weight" in w:
                q, k, v = (w.pop(f"{a}.{n}_proj.weight").reshape(n_kv, -1, hd, 64) for n in "qkv")
                w[f"{a}.qkv_proj.weight"] = mx.concatenate([q, k, v], axis=1).reshape(-1, 64)
            w[f"{m}.gate_and_up_proj.weight"] = mx.concatenate(
                [w.pop(f"{m}.up_proj.weight"), w.pop(f"{m}.gate_proj.weight")])
        return w

    path = rewrite_checkpoint(zoo("hunyuan"), tmp_path / "hunyuan_fused", fused,
                              config=lambda c: {**c, "num_experts": 1})
    assert groups == 2 and "model.layers.0.self_attn.qkv_proj.weight" in mx.load(str(path / "model.safetensors"))
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    mlxlm, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    want = mlxlm(ids)
    assert mx.array_equal(want, ours(ids)) and mx.array_equal(want, ref(ids))


@pytest.mark.parametrize("build, knob", [
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("softmax_topk", corrected="norm_topk_prob"))),
     "moe.router.corrected with 'softmax_topk': the kind has no correction bias"),
    (lambda: _row(_GLM, moe=MoEKnobs(experts="n_routed_experts", router=RouterKnobs(
        "grouped_score", gate="weight", params={"scaling": 1.0, "n_group": 1, "topk_group": 1}))),
     "must name exactly scaling, n_group, topk_group, score"),
    (lambda: _row(_GLM, moe=MoEKnobs(experts="n_routed_experts", shared=SharedKnobs(
        count="n_shared_experts", when_rule="positive"))),
     "moe.shared.when_rule 'positive' needs moe.shared.when"),    (lambda: _row("minimax", moe=dataclasses.replace(
        DESCRIPTORS["minimax"].moe, router=RouterKnobs("sigmoid_corrected", gate_f32=True))),
     "'sigmoid_corrected' with bias_at 'router' keeps its correction bias on the router module"),
    (lambda: _row("minimax", moe=dataclasses.replace(DESCRIPTORS["minimax"].moe, router=RouterKnobs(
        "sigmoid_corrected", gate_f32=True, bias_at="block", corrected=False))),
     "moe.router.corrected with 'sigmoid_corrected': the kind always adds its correction bias"),
])
def test_the_new_moe_knobs_are_checked_when_a_row_is_built(build, knob):
    with pytest.raises(DescriptorError, match="descriptor 'my_moe': ") as e:
        build()
    assert knob in str(e.value)



# ----------------------------------------------------------------- gpt_oss


def _gpt_oss_blocks(quant=None, seed=1):
    """mlx-lm's gpt_oss MLPBlock and mlxbun's MoEBlock with the same (optionally quantized) weights."""
    ref, ours = _pair({**tiny_config("gpt_oss"), "num_hidden_layers": 2}, seed=seed)
    if quant is not None:  # experts and router as mlx-lm's convert packs them for this mode
        for model in (ref, ours):
            nn.quantize(model, **quant, class_predicate=lambda p, m: ".mlp." in p and hasattr(m, "to_quantized"))
    return ref.layers[0]["mlp"], ours.layers[0]["mlp"]


@pytest.mark.parametrize("quant", [None, dict(group_size=32, bits=4), dict(group_size=32, bits=4, mode="mxfp4")],
                         ids=["float32", "q4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 7, 40])  # 40 tokens x top-2 = 80 picks: the sorted-indices path
def test_gpt_oss_block_matches_mlx_lm_mlp_block_with_clamped_swiglu(quant, tokens):
    """Router (Linear with bias, mlx_topk, precise softmax over the k), experts with biases through
    SwigluOAI (gate clipped above at 7, up clipped to [-7, 7], alpha 1.702) and the combine, against
    mlx-lm's MLPBlock; the inputs are large enough that the clamps engage."""
    from mlxbun.models.layers import SwigluOAI

    ref_block, our_block = _gpt_oss_blocks(quant)
    assert isinstance(our_block["experts"].activation, SwigluOAI)
    x = 4.0 * mx.random.normal((1, tokens, 64), key=mx.random.key(tokens))
    assert mx.array_equal(ref_block(x), our_block(x)).item()
    # the clamp engaged: some chosen expert's gate projection is above the limit
    inds = our_block.router(x, our_block["router"](x)).experts
    gate = our_block["experts"]["gate_proj"](mx.expand_dims(x, (-2, -3)), inds)
    assert (gate > 7.0).any().item() and (gate < -7.0).any().item()


def test_gpt_oss_router_is_mlx_topk_then_precise_softmax_over_the_k():
    from mlx_lm.models.gpt_oss import mlx_topk

    ref_block, our_block = _gpt_oss_blocks()
    assert "bias" in our_block["router"] and our_block.router.observer  # the Linear keeps mlx-lm's path
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.random.normal((2, 9, 64), key=mx.random.key(3)).astype(dtype)
        g = ref_block.router(x)
        values, inds = mlx_topk(g, k=2, axis=-1)
        routing = our_block.router(x, our_block["router"](x))
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(g, routing.logits)
        assert mx.array_equal(mx.softmax(values, axis=-1, precise=True), routing.weights)


def _interleave(a, b, axis):
    return mx.stack([a, b], axis=axis + 1 if axis >= 0 else axis).reshape(
        *a.shape[:axis % a.ndim], 2 * a.shape[axis], *a.shape[axis % a.ndim + 1:])


def _to_hf_mxfp4(w: dict) -> dict:
    """mlx-layout float experts -> the layout openai/gpt-oss ships: gate_up_proj with gate/up rows
    interleaved, mxfp4 `_blocks` [E, out, in/32, 16] uint8 and `_scales`, and `_bias` tensors."""
    out = dict(w)
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts"
        packed = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            wq, scales = mx.quantize(out.pop(f"{p}.{name}.weight"), group_size=32, bits=4, mode="mxfp4")
            packed[name] = (wq.view(mx.uint8).reshape(*wq.shape[:-1], -1, 16), scales, out.pop(f"{p}.{name}.bias"))
        (gb, gs, gbias), (ub, us, ubias) = packed["gate_proj"], packed["up_proj"]
        out[f"{p}.gate_up_proj_blocks"] = _interleave(gb, ub, 1)
        out[f"{p}.gate_up_proj_scales"] = _interleave(gs, us, 1)
        out[f"{p}.gate_up_proj_bias"] = _interleave(gbias, ubias, -1)
        out[f"{p}.down_proj_blocks"], out[f"{p}.down_proj_scales"], out[f"{p}.down_proj_bias"] = packed["down_proj"]
    return out


def test_gpt_oss_hf_mxfp4_checkpoint_is_sanitized_and_runs_like_mlx_lm(zoo, tmp_path):
    """The original checkpoint layout (quantization_config mxfp4, interleaved gate_up_proj blocks):
    mlx-lm's sanitize splits it; ours gives the same tensors, the same audit from headers alone,
    and bit-equal logits."""
    from mlx_lm.models.gpt_oss import Model, ModelArgs

    from mlxbun.models.universal.sanitize import sanitize_weights

    path = rewrite_checkpoint(zoo("gpt_oss"), tmp_path / "gpt_oss_hf", _to_hf_mxfp4, config=lambda cfg: {
        **cfg, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})
    raw = mx.load(str(path / "model.safetensors"))
    assert raw["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == mx.uint8
    want = Model(ModelArgs.from_dict(tiny_config("gpt_oss"))).sanitize(dict(raw))
    got, dropped = sanitize_weights(DESCRIPTORS["gpt_oss"], raw, tied=False)
    assert sorted(got) == sorted(want) and not dropped
    assert all(mx.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    ref, ours = oracle(path), load_universal(path)
    assert ours.layers[0]["mlp"]["experts"]["gate_proj"].mode == "mxfp4"
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_gpt_oss_hf_unquantized_layout_refuses_as_mlx_lm_does(zoo, tmp_path):
    """transformers' unquantized layout (gate_up_proj [E, D, 2I] without `_blocks`): mlx-lm's
    sanitize renames it to `experts.gate_proj` (no `.weight`, rows split on the wrong axis) and its
    strict load fails; mlxbun's audit refuses, naming the tensors."""
    def to_hf(w):
        out = dict(w)
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts"
            gate, up = out.pop(f"{p}.gate_proj.weight"), out.pop(f"{p}.up_proj.weight")
            out[f"{p}.gate_up_proj"] = _interleave(gate, up, 1).swapaxes(-1, -2)
            out[f"{p}.gate_up_proj_bias"] = _interleave(out.pop(f"{p}.gate_proj.bias"),
                                                        out.pop(f"{p}.up_proj.bias"), -1)
            out[f"{p}.down_proj"] = out.pop(f"{p}.down_proj.weight").swapaxes(-1, -2)
            out[f"{p}.down_proj_bias"] = out.pop(f"{p}.down_proj.bias")
        return out

    path = rewrite_checkpoint(zoo("gpt_oss"), tmp_path / "gpt_oss_hf_bf16", to_hf)
    with pytest.raises(LoadError, match=r"unconsumed: .*model\.layers\.0\.mlp\.experts\.down_proj"):
        load_universal(path)
    with pytest.raises(ValueError):
        oracle(path)


def test_gpt_oss_layer_types_default_and_refusals():
    from mlxbun.errors import ConfigError

    cfg = {**tiny_config("gpt_oss"), "layer_types": None}
    model = build_model(cfg)
    assert [s.sliding for s in model.args.layers] == [True, False, True, False]
    assert [type(c).__name__ for c in model.make_cache()] == ["RotatingKVCache", "KVCache"] * 2
    assert model.make_cache()[0].max_size == 16
    with pytest.raises(ConfigError, match="layer_types has no 'sliding_attention' layer"):
        build_model({**cfg, "layer_types": ["full_attention"] * 4})
    with pytest.raises(ConfigError, match="2 layer kinds for 3 layers"):
        build_model({**cfg, "num_hidden_layers": 3})  # mlx-lm's zip would drop the last layer
    # more layer_types than layers: mlx-lm's forward zips them away, so does the graph
    assert [s.sliding for s in build_model({**cfg, "num_hidden_layers": 2,
                                            "layer_types": ["sliding_attention", "full_attention"] * 2}
                                           ).args.layers] == [True, False]


# ----------------------------------------------------------------- attention sinks


def test_attention_sinks_reach_the_softmax(zoo, tmp_path):
    """Sinks are parameters of every attention layer; changing them changes mlxbun's logits exactly
    as mlx-lm's (a graph that dropped them would not move)."""
    path = rewrite_checkpoint(zoo("gpt_oss"), tmp_path / "sinks", lambda w: {
        k: (v + 3.0 if k.endswith(".sinks") else v) for k, v in w.items()})
    ref, ours = oracle(path), load_universal(path)
    base = load_universal(zoo("gpt_oss"))
    ids = prompt_ids(40)
    assert ours.attention_sinks and ours.layers[0]["self_attn"]["sinks"].shape == (4,)
    assert mx.array_equal(ref(ids), ours(ids))
    assert not mx.allclose(ours(ids), base(ids), atol=1e-3)


def test_quantized_kv_refuses_attention_sinks_like_mlx_lm(zoo):
    """mlx-lm's quantized SDPA raises on sinks (and cannot quantize gpt_oss's rotating caches);
    mlxbun refuses uniform and per-layer-plan KV quantization before the prefill, and its
    QuantizedKVCache refuses sinks at attention, never dropping them."""
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_sdpa
    from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantized

    from mlxbun.cache.quantized import QuantizedKVCache
    from mlxbun.errors import GenerationError
    from mlxbun.generate import stream_generate
    from mlxbun.tokenizer import load_tokenizer

    path = zoo("gpt_oss")
    model, tok = load_universal(path), load_tokenizer(path)
    for kv in (dict(kv_bits=4, kv_group_size=32), dict(kv_bits=8, quantized_kv_start=1000),
               dict(kv_config=[{"layer_idx": 1, "bits": 4, "group_size": 32}])):
        with pytest.raises(GenerationError, match="attention sinks are not supported by quantized-KV"):
            list(stream_generate(model, tok, "hello", max_tokens=2, **kv))
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(1))
    kv = mx.random.normal((1, 2, 8, 32), key=mx.random.key(2))
    sinks = mx.ones((4,))
    ours = QuantizedKVCache(group_size=32, bits=4)
    keys, values = ours.update_and_fetch(kv, kv)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        ours.attention(q, keys, values, scale=0.25, mask=None, sinks=sinks)
    theirs = MlxLmQuantized(group_size=32, bits=4)
    keys, values = theirs.update_and_fetch(kv, kv)
    with pytest.raises(ValueError, match="sinks"):
        mlx_lm_sdpa(q, keys, values, theirs, scale=0.25, mask=None, sinks=sinks)


def test_turboquant_keeps_attention_sinks(zoo):
    """TurboQuant's packed-code decode has no sinks, so a query with sinks attends through the
    fused kernel over the cache's dequantized fetch (sinks applied); gpt_oss generates with it."""
    from mlxbun.attention import fused_sdpa
    from mlxbun.cache.turboquant import TurboQuantKVCache
    from mlxbun.generate import stream_generate
    from mlxbun.tokenizer import load_tokenizer

    cache = TurboQuantKVCache(bits=4)
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 9, 16), key=mx.random.key(4)),
                                          mx.random.normal((1, 2, 9, 16), key=mx.random.key(5)))
    q = mx.random.normal((1, 4, 1, 16), key=mx.random.key(6))
    sinks = mx.array([2.0, -1.0, 0.5, 3.0])
    got = cache.attention(q, keys, values, scale=0.25, mask=None, sinks=sinks)
    assert mx.array_equal(got, fused_sdpa(q, keys, values, scale=0.25, mask=None, sinks=sinks))
    assert not mx.allclose(got, cache.attention(q, keys, values, scale=0.25, mask=None), atol=1e-3)
    path = zoo("gpt_oss")
    out = list(stream_generate(load_universal(path), load_tokenizer(path), "Once upon a time", max_tokens=8,
                               kv_bits=4, kv_scheme="turboquant"))
    assert len(out) == 8


# ----------------------------------------------------------------- Klear / afmoe routers off the zoo configs


def _same_blocks(cfg: dict, arch: str, dtype: str, seed: int = 4) -> None:
    """Every MoE block of `cfg` (parameters as mlx-lm's, cast as convert casts them) chooses the
    same experts in the same order and returns the same output as mlx-lm's block."""
    ref, ours = _pair(cfg, seed=seed)
    assert sorted(k for k, _ in tree_flatten(ours.parameters())) == sorted(k for k, _ in tree_flatten(ref.parameters()))
    dt = getattr(mx, dtype)
    for model in (ref, ours):
        cast = ref.cast_predicate  # the expert bias stays float32
        model.update(tree_unflatten([(k, v.astype(dt) if cast(k) else v)
                                     for k, v in tree_flatten(model.parameters())]))
    switch = DESCRIPTORS[arch].moe.names.switch
    blocks = list(_moe_blocks(ref, ours, arch))
    assert blocks
    for i, ref_block, our_block in blocks:
        rec_ref, rec_ours = _Experts(), _Experts()
        setattr(ref_block, switch, rec_ref)
        setattr(our_block, switch, rec_ours)
        for shape in [(1, 40, 64), (2, 7, 64), (1, 1, 64)]:
            x = (2.0 * mx.random.normal(shape, key=mx.random.key(sum(shape) + i))).astype(dt)
            expected, got = ref_block(x), our_block(x)
            assert mx.array_equal(rec_ref.seen[-1], rec_ours.seen[-1]), f"layer {i} {shape}: experts differ"
            assert got.dtype == expected.dtype and mx.array_equal(expected, got).item(), f"layer {i} {shape}"


@pytest.mark.parametrize("changes", [
    {}, {"norm_topk_prob": False}, {"num_experts_per_tok": 1}, {"n_shared_experts": 2},
    {"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_klear_sigmoid_biased_router_and_coefficient_mix_match_mlx_lm(changes, dtype):
    """RouterKind.SIGMOID_BIASED (the block's float32 expert_bias steers the choice, the weights
    cast to the input's dtype) and SharedKind.COEFFICIENT against KlearSparseMoeBlock."""
    _same_blocks({**tiny_config("Klear"), **changes}, "Klear", dtype)


@pytest.mark.parametrize("changes", [
    {}, {"score_func": "softmax"}, {"n_group": 2, "topk_group": 1}, {"route_norm": False},
    {"num_experts_per_tok": 1, "n_group": 2, "topk_group": 1}, {"num_shared_experts": 0},
    {"num_experts": 8, "score_func": "softmax", "n_group": 4, "topk_group": 2, "route_scale": 1.0},
    {"num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_afmoe_scored_grouped_router_matches_mlx_lm(changes, dtype):
    """RouterKind.SCORED_GROUPED (sigmoid or softmax by score_func, the block's expert bias, grouped
    selection when n_group > 1, uncompiled) and the nested router.gate against AfmoeMoE."""
    _same_blocks({**tiny_config("afmoe"), **changes}, "afmoe", dtype)


def test_afmoe_router_module_sits_at_mlx_lm_path_and_returns_its_choice():
    ref, ours = _pair(tiny_config("afmoe"), seed=2)
    for i, ref_block, our_block in _moe_blocks(ref, ours, "afmoe"):
        router = our_block.router
        assert router is our_block["router"] and not router.observer and "expert_bias" in our_block
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        routing = router(x, bias=our_block["expert_bias"])
        assert mx.array_equal(ref_block["router"](x), routing.logits)
        assert routing.experts.shape == (2, 9, 2)


def test_new_moe_config_errors_name_the_key():
    from mlxbun.errors import ConfigError

    with pytest.raises(ConfigError, match="'num_shared_experts' must be an integer, got None"):
        build_model({**tiny_config("afmoe"), "num_shared_experts": None})
    with pytest.raises(ConfigError, match="layer_types holds 'chunked_attention'"):
        build_model({**tiny_config("mellum"), "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="rope_parameters needs 'sliding_attention'"):
        build_model({**tiny_config("mellum"), "rope_parameters": {"full_attention": {"rope_theta": 1e4}}})
    with pytest.raises(ConfigError, match="layer_types has no 'full_attention'"):
        build_model({**tiny_config("mellum"), "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ConfigError, match="layer_types has no 'full_attention'"):
        build_model({**tiny_config("afmoe"), "layer_types": ["sliding_attention"] * 2})


@pytest.mark.parametrize("build, knob", [
    (lambda: _row("Klear", moe=dataclasses.replace(
        DESCRIPTORS["Klear"].moe, router=RouterKnobs("sigmoid_biased", norm_topk="norm_topk_prob"))),
     "'sigmoid_biased' with bias_at 'router'"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(router=RouterKnobs("softmax_topk", bias_at="block"))),
     "moe.router.bias_at with 'softmax_topk'"),
    (lambda: _row("Klear", moe=dataclasses.replace(
        DESCRIPTORS["Klear"].moe, names=MoENames(switch="experts", correction_bias="coefficient"))),
     "one name"),
    (lambda: _row("mellum", layers=dataclasses.replace(DESCRIPTORS["mellum"].layers, kinds="all_full")),
     "rope.kind 'layer_type_params'"),
    (lambda: _row("afmoe", attn_gate="tanh"), "attn_gate = 'tanh'"),
])
def test_a_bad_row_with_the_new_knobs_fails_when_built(build, knob):
    with pytest.raises(DescriptorError, match="descriptor 'my_moe': ") as e:
        build()
    assert knob in str(e.value)


def test_klear_afmoe_mellum_gates_keep_mlx_lm_precision_and_the_expert_bias_stays_float32(zoo):
    klear = load_universal(zoo("Klear", quant=4)).layers[0]["mlp"]
    assert klear["gate"].bits == 8 and klear["experts"]["up_proj"].bits == 4
    assert klear["expert_bias"].dtype == mx.float32 and klear["coefficient"].bits == 4
    afmoe = load_universal(zoo("afmoe", quant=4, dtype="bfloat16"))
    assert afmoe.layers[1]["mlp"]["router"]["gate"].bits == 8
    assert afmoe.layers[1]["mlp"]["expert_bias"].dtype == mx.float32
    assert afmoe.layers[0]["self_attn"]["gate_proj"].bits == 4
    mellum = load_universal(zoo("mellum", quant=4)).layers[0]["mlp"]
    assert mellum["gate"].bits == 8 and mellum["switch_mlp"]["down_proj"].bits == 4


# ----------------------------------------------------------------- step3p5


@pytest.mark.parametrize("top_k, scaling, norm", [(2, 3.0, True), (1, 3.0, True), (3, 1.0, False), (4, 2.5, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step3p5_sigmoid_eps_selection_matches_mlx_lm(top_k, scaling, norm, dtype):
    """RouterKind.SIGMOID_EPS against step3p5.moe_gate_select (compiled on both sides)."""
    from mlx_lm.models.step3p5 import moe_gate_select

    from mlxbun.models.universal.moe import _moe_gate_select

    gates = mx.random.normal((2, 13, 8), key=mx.random.key(top_k)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((8,), key=mx.random.key(5))
    want_inds, want = moe_gate_select(gates, bias, top_k, scaling, norm)
    inds, got = _moe_gate_select(gates, bias, top_k, scaling, norm)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


@pytest.mark.parametrize("changes", [
    {}, {"norm_expert_weight": False}, {"moe_top_k": 1}, {"swiglu_limits_shared": None},
    {"moe_layers_enum": None, "num_hidden_layers": 3}])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step3p5_router_and_clamped_shared_expert_match_mlx_lm(changes, dtype):
    _same_blocks({**tiny_config("step3p5"), **changes}, "step3p5", dtype)


@pytest.mark.parametrize("changes", [
    {"use_head_wise_attn_gate": False}, {"layer_types": None}, {"attention_other_setting": None},
    {"rope_theta": 50000.0, "partial_rotary_factors": None}, {"yarn_only_types": None},
    {"swiglu_limits": [0.25] * 4, "swiglu_limits_shared": [-1.0, None]},
    {"moe_layers_enum": " 0, 3"}])
def test_step3p5_per_layer_knobs_match_mlx_lm_through_the_caches(changes):
    """The per-layer knobs off the zoo config: whole-model prefill and cached decode bit-exact."""
    from mlx_lm.models.cache import make_prompt_cache

    ref, ours = _pair({**tiny_config("step3p5"), **changes}, seed=6)
    ids = prompt_ids(24)
    ref_cache, our_cache = make_prompt_cache(ref), ours.make_cache()
    assert mx.array_equal(ref(ids, cache=ref_cache), ours(ids, cache=our_cache))
    for t in range(6):
        step = mx.array([[11 * t + 3]])
        assert mx.array_equal(ref(step, cache=ref_cache), ours(step, cache=our_cache)), t


def test_step3p5_hf_checkpoint_is_renamed_and_its_norms_shifted_like_mlx_lm(zoo, tmp_path):
    """A vanilla (Hugging Face) step3p5 checkpoint: moe.* / share_expert names, zero-centred norm
    weights (mlx-lm adds 1), MTP tensors and a layer past num_hidden_layers (dropped)."""
    back = [(".mlp.switch_mlp.", ".moe."), (".mlp.gate.gate.", ".moe.gate."),
            (".mlp.gate.router_bias", ".moe.router_bias"), (".mlp.share_expert.", ".share_expert.")]

    def to_hf(w):
        out = {}
        for k, v in w.items():
            for dst, src in back:
                k = k.replace(dst, src)
            out[k] = v - 1 if k.endswith(".weight") and "norm" in k else v
        extra = {"model.layers.4.eh_proj.weight": mx.ones((64, 128)), "model.mtp.norm.weight": mx.ones((64,))}
        return {**out, **extra}

    path = rewrite_checkpoint(zoo("step3p5"), tmp_path / "step3p5", to_hf)
    names = mx.load(str(path / "model.safetensors"))
    assert "model.layers.1.moe.gate_proj.weight" in names and "model.layers.1.moe.router_bias" in names
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == {"model.layers.4.eh_proj.weight", "model.mtp.norm.weight"}
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_step3p5_config_errors_name_the_key():
    from mlxbun.errors import ConfigError

    cfg = tiny_config("step3p5")
    for changes, match in [
        ({"moe_layers_enum": "1;2"}, "'moe_layers_enum' must be a comma-separated list"),
        ({"attention_other_setting": {"num_attention_heads": 8}}, "lacks num_attention_groups"),
        ({"rope_theta": [1e6, 1e4]}, "rope_theta lists 2 bases, none for layer 2"),
        ({"swiglu_limits": [None, "7"]}, r"'swiglu_limits'\[1\] must be a number or null"),
        ({"layer_types": ["full_attention"]}, "layer_types lists 1 kinds for 4 layers"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_model({**cfg, **changes})
    with pytest.raises(DescriptorError, match="attn_gate_when names the field switching attn_gate"):
        _row("step3p5", attn_gate=None)


# ----------------------------------------------------------------- mimo_v2_flash


@pytest.mark.parametrize("top_k, n_group, topk_group, scaling, norm", [
    (2, 1, 1, 1.0, True), (2, 2, 1, 2.5, True), (3, 4, 2, 1.0, False), (1, 2, 1, 1.5, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mimo_v2_flash_selection_is_noaux_tc_with_the_eps_renorm(top_k, n_group, topk_group, scaling,
                                                                 norm, dtype):
    """Its group_expert_select is exaone_moe's (renorm by sum + 1e-20): the row reuses it."""
    from mlx_lm.models.mimo_v2_flash import group_expert_select

    gates = mx.random.normal((2, 13, 16), key=mx.random.key(top_k * 3 + n_group)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((16,), key=mx.random.key(7))
    want_inds, want = group_expert_select(gates, bias, top_k, n_group, topk_group, scaling, norm)
    inds, got = _group_select(gates, bias, top_k, n_group, topk_group, scaling, norm, False, True)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


def test_mimo_v2_flash_gate_module_sits_at_mlx_lm_path_and_returns_its_choice():
    ref, ours = _pair(tiny_config("mimo_v2_flash"), seed=5)
    blocks = list(_moe_blocks(ref, ours, "mimo_v2_flash"))
    assert [i for i, _, _ in blocks] == [1, 2, 3]  # moe_layer_freq [0, 1, 1, 1]
    for i, ref_block, our_block in blocks:
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        inds, scores = ref_block["gate"](x)
        routing = our_block.router(x)
        assert our_block.router is our_block["gate"] and not our_block.router.observer
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(scores, routing.weights)


@pytest.mark.parametrize("changes", [
    {}, {"add_full_attention_sink_bias": True}, {"add_swa_attention_sink_bias": False},
    {"attention_value_scale": None}, {"n_shared_experts": None},
    {"routed_scaling_factor": 2.5, "n_group": 1}, {"norm_topk_prob": False, "num_experts_per_tok": 1},
    {"swa_num_attention_heads": 4, "swa_head_dim": 24, "swa_v_head_dim": 24, "v_head_dim": 24},
    {"hybrid_layer_pattern": [1, 0, 1, 1], "moe_layer_freq": [1, 0, 0, 1], "partial_rotary_factor": 1.0}])
def test_mimo_v2_flash_per_layer_attention_matches_mlx_lm_through_the_caches(changes):
    """Sliding layers' own heads / dims / rope base, sink biases per layer kind, the value scale,
    the router and shared-expert branches: parameter paths, prefill and cached decode bit-exact."""
    ref, ours = _pair({**tiny_config("mimo_v2_flash"), **changes}, seed=8)
    assert sorted(k for k, _ in tree_flatten(ref.parameters())) == \
        sorted(k for k, _ in tree_flatten(ours.parameters()))
    ids = prompt_ids(24)
    ref_cache, our_cache = ref.make_cache(), ours.make_cache()
    assert [type(c).__name__ for c in ref_cache] == [type(c).__name__ for c in our_cache]
    assert mx.array_equal(ref(ids, cache=ref_cache), ours(ids, cache=our_cache))
    for t in range(6):
        step = mx.array([[13 * t + 5]])
        assert mx.array_equal(ref(step, cache=ref_cache), ours(step, cache=our_cache)), t


def test_mimo_v2_flash_fp8_experts_and_mtp_are_sanitized_like_mlx_lm():
    """mimo_v2_flash.sanitize: fp8 weights times their 128x128-block scales (bfloat16), per-expert
    tensors stacked, model.mtp.* dropped; against mlx-lm's sanitize."""
    from mlx_lm.models.mimo_v2_flash import Model as RefModel
    from mlx_lm.models.mimo_v2_flash import ModelArgs

    from mlxbun.models.universal.sanitize import sanitize_weights

    cfg = tiny_config("mimo_v2_flash")
    big = mx.random.normal((300, 200), key=mx.random.key(2))  # 3 x 2 blocks, padded at the edges
    weights = {"model.layers.0.self_attn.q_proj.weight": mx.to_fp8(big),
               "model.layers.0.self_attn.q_proj.weight_scale_inv": mx.random.uniform(shape=(3, 2)) + 0.5,
               "model.mtp.layers.0.norm.weight": mx.ones((64,)), "model.norm.weight": mx.ones((64,))}
    for e in range(cfg["n_routed_experts"]):
        for name in ("gate_proj", "up_proj", "down_proj"):
            weights[f"model.layers.1.mlp.experts.{e}.{name}.weight"] = mx.full((8, 4), float(e))
    ours = build_model(cfg)
    want = RefModel(ModelArgs.from_dict(cfg)).sanitize(dict(weights))
    got, dropped = sanitize_weights(ours.descriptor, weights, False, ours.args.fields)
    assert set(got) == set(want) and "model.layers.1.mlp.switch_mlp.up_proj.weight" in got
    assert set(dropped) == {"model.layers.0.self_attn.q_proj.weight_scale_inv",
                            "model.mtp.layers.0.norm.weight"}
    assert all(got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]) for k in want)


def test_mimo_v2_flash_config_and_row_errors_name_the_key():
    from mlxbun.errors import ConfigError

    cfg = tiny_config("mimo_v2_flash")
    for changes, match in [
        ({"hybrid_layer_pattern": [0, 0, 0, 0]}, "'hybrid_layer_pattern' must list 4 layers"),
        ({"hybrid_layer_pattern": [0, 1]}, "'hybrid_layer_pattern' must list 4 layers"),
        ({"moe_layer_freq": [0, 1]}, "'moe_layer_freq' must be a list of 4 ints"),
        ({"swa_head_dim": None}, "swa_head_dim"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_model({**cfg, **changes})
    assert build_model({**cfg, "routed_scaling_factor": None}).args.fields["routed_scaling_factor"] == 1.0
    with pytest.raises(DescriptorError, match="sinks_when names the fields switching sinks"):
        _row("mimo_v2_flash", sinks=False)
    with pytest.raises(DescriptorError, match="layers.sliding_attn needs sliding layers"):
        _row("mimo_v2_flash", layers=LayerKnobs(sliding_attn=DESCRIPTORS["mimo_v2_flash"].layers.sliding_attn))
    with pytest.raises(DescriptorError, match="sinks_when reads the field 'add_sinks'"):
        _row("mimo_v2_flash", sinks_when=("add_full_attention_sink_bias", "add_sinks"))


# ----------------------------------------------------------------- laguna


@pytest.mark.parametrize("changes", [
    {}, {"moe_router_logit_softcapping": 0.0}, {"moe_router_score_func": "sqrtsoftplus"},
    {"moe_routed_scaling_factor": 1.0, "num_experts_per_tok": 1}])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_laguna_capped_score_router_and_scaled_shared_sum_match_mlx_lm(changes, dtype):
    """RouterKind.CAPPED_SCORE and SharedKind.ROUTED_SCALED against laguna's MoEGate / MoE."""
    _same_blocks({**tiny_config("laguna"), **changes}, "laguna", dtype)


def test_laguna_gate_module_sits_at_mlx_lm_path_and_returns_its_choice():
    ref, ours = _pair({**tiny_config("laguna"), "moe_router_score_func": "sqrtsoftplus"}, seed=5)
    blocks = list(_moe_blocks(ref, ours, "laguna"))
    assert [i for i, _, _ in blocks] == [1, 2, 3]  # mlp_layer_types: layer 0 dense
    for i, ref_block, our_block in blocks:
        x = mx.random.normal((2, 9, 64), key=mx.random.key(i))
        inds, weights = ref_block["gate"](x)
        routing = our_block.router(x)
        assert our_block.router is our_block["gate"] and not our_block.router.observer
        assert mx.array_equal(inds, routing.experts) and mx.array_equal(weights, routing.weights)


@pytest.mark.parametrize("changes", [
    {}, {"gating": False}, {"layer_types": None}, {"num_attention_heads_per_layer": None},
    {"mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}, {"tie_word_embeddings": True},
    {"rope_parameters": None, "partial_rotary_factor": 0.5},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}])
def test_laguna_per_layer_knobs_match_mlx_lm_through_the_caches(changes):
    """Per-layer head counts, the softplus gate, rope per layer type (absent entries: defaults),
    the MoE layer list: parameter paths, prefill and cached decode bit-exact."""
    ref, ours = _pair({**tiny_config("laguna"), **changes}, seed=9)
    assert sorted(k for k, _ in tree_flatten(ref.parameters())) == \
        sorted(k for k, _ in tree_flatten(ours.parameters()))
    ids = prompt_ids(24)
    ref_cache, our_cache = ref.make_cache(), ours.make_cache()
    assert mx.array_equal(ref(ids, cache=ref_cache), ours(ids, cache=our_cache))
    for t in range(6):
        step = mx.array([[7 * t + 2]])
        assert mx.array_equal(ref(step, cache=ref_cache), ours(step, cache=our_cache)), t


def test_laguna_original_layout_is_sanitized_like_mlx_lm(zoo, tmp_path):
    """The repacked `language_model.` prefix, the bare router weight and the expert-side
    correction bias, per-expert tensors: against mlx-lm's sanitize and a full load."""
    def to_original(w):
        out = {}
        for k, v in _unstack(w, "mlp", "switch_mlp", _SAME).items():
            k = k.replace(".mlp.gate.proj.weight", ".mlp.gate.weight")
            k = k.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")
            out[f"language_model.{k}"] = v
        return out

    path = rewrite_checkpoint(zoo("laguna"), tmp_path / "laguna", to_original)
    names = mx.load(str(path / "model.safetensors"))
    assert "language_model.model.layers.1.mlp.gate.weight" in names
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight" in names
    assert audit_checkpoint(path).ok
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_laguna_config_and_row_errors_name_the_key():
    from mlxbun.errors import ConfigError

    cfg = tiny_config("laguna")
    for changes, match in [
        ({"moe_router_score_func": "softmax"}, "'moe_router_score_func' = 'softmax' is not supported"),
        ({"layer_types": ["sliding_attention"] * 4}, "no 'full_attention' layer"),
        ({"num_attention_heads_per_layer": [4, 8]}, "'num_attention_heads_per_layer' must list one entry"),
        ({"num_attention_heads_per_layer": [4, 0, 4, 4]}, r"'num_attention_heads_per_layer'\[1\] must be"),
        ({"mlp_layer_types": ["dense"]}, "'mlp_layer_types' must list one entry per layer"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_model({**cfg, **changes})
    d = DESCRIPTORS["laguna"]
    with pytest.raises(DescriptorError, match="'routed_scaled' and moe.shared.scale"):
        _row("laguna", moe=dataclasses.replace(d.moe, shared=SharedKnobs("plain", size="shared_expert_intermediate_size",
                                                                          scale="moe_routed_scaling_factor")))
    with pytest.raises(DescriptorError, match="norm_topk with 'capped_score'"):
        _row("laguna", moe=dataclasses.replace(d.moe, router=dataclasses.replace(d.moe.router, norm_topk=True)))
    with pytest.raises(DescriptorError, match="heads_per_layer needs n_kv_heads"):
        _row("laguna", layers=dataclasses.replace(d.layers, sliding_heads="gating"))
