"""The universal graph's MoE block (models/universal/moe.py) against mlx-lm 0.32.2's own code.

Routers: every router kind against the mlx-lm block (or gate module, or compiled grouped
selection) it transcribes, on random inputs in float32 / bfloat16 / float16 and with a
quantized gate: the chosen experts (in order) and the combined output bit-exact. The fused
experts are replaced on both sides by the same recorder, so half-precision routing runs on
mlx's CPU backend (whose gather_mm takes float32 only). Then: per-expert Hugging Face
tensors stacked as mlx-lm's sanitize does, routing taps, and MoE rows refused at build.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.errors import LoadError, UnsupportedModelError
from mlxbun.models.universal.loader import audit_checkpoint, build_model, load_universal
from mlxbun.models.universal.moe import MoEBlock, Router, Routing, _group_select_k_nonzero, _group_select_n_group
from mlxbun.models.universal.schema import (
    ArchDescriptor,
    DescriptorError,
    MoEKnobs,
    MoENames,
    RouterKnobs,
    SanitizeRule,
    SharedKnobs,
)
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo import tiny_config
from tests.test_universal_dense import _oracle, _prompt, _rewrite
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
    cfg = {**tiny_config(arch), "num_hidden_layers": 2}
    ref, ours = _pair(cfg)
    if gate == "q4":  # the gates (and every other Linear) quantized, as a converted checkpoint
        nn.quantize(ref, group_size=32, bits=4)
        nn.quantize(ours, group_size=32, bits=4)
    dt = getattr(mx, dtype)
    for model in (ref, ours):
        cast = getattr(model, "cast_predicate", lambda _: True)
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


@pytest.mark.parametrize("select, mlx_lm_fn", [
    (_group_select_n_group, "glm4_moe"), (_group_select_k_nonzero, "dots1")])
@pytest.mark.parametrize("top_k, n_group, topk_group, scaling, norm", [
    (2, 1, 1, 1.0, True), (2, 2, 1, 2.5, True), (3, 4, 2, 1.0, False), (1, 2, 1, 1.5, True),
    (4, 4, 3, 2.5, True), (2, 8, 4, 1.0, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_noaux_selection_matches_mlx_lm(select, mlx_lm_fn, top_k, n_group, topk_group, scaling,
                                                norm, dtype):
    import importlib

    ref_fn = importlib.import_module(f"mlx_lm.models.{mlx_lm_fn}").group_expert_select
    gates = mx.random.normal((2, 13, 16), key=mx.random.key(top_k * 7 + n_group)).astype(getattr(mx, dtype))
    bias = 0.1 * mx.random.normal((16,), key=mx.random.key(5))
    want_inds, want = ref_fn(gates, bias, top_k, n_group, topk_group, scaling, norm)
    inds, got = select(gates, bias, top_k, n_group, topk_group, scaling, norm)
    assert mx.array_equal(want_inds, inds) and mx.array_equal(want, got) and want.dtype == got.dtype


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
    ("Klear", None, "mlp", "experts", _SAME, ("weight",)),
    ("afmoe", 4, "mlp", "experts", _SAME, ("weight", "scales", "biases")),
    ("mellum", None, "mlp", "switch_mlp", _SAME, ("weight",)),
])
def test_per_expert_hf_tensors_are_stacked_like_mlx_lm(zoo, tmp_path, arch, quant, block, switch, rename, keys):
    path = _rewrite(zoo(arch, quant=quant), tmp_path / arch,
                    lambda w: _unstack(w, block, switch, rename, keys))
    names = mx.load(str(path / "model.safetensors"))
    assert any(".experts.3." in k for k in names)
    assert not any(f".{switch}.{n}." in k for k in names for n in rename)
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    ref, ours = _oracle(path), load_universal(path)
    ids = _prompt(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_a_missing_expert_is_a_load_error_naming_it(zoo, tmp_path):
    path = _rewrite(zoo("qwen3_moe"), tmp_path / "gap", lambda w: {
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

    path = _rewrite(zoo("granitemoe"), tmp_path / "granitemoe", to_hf)
    ref, ours = _oracle(path), load_universal(path)
    ids = _prompt(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_glm4_moe_drops_the_mtp_layer_and_stacks_experts(zoo, tmp_path):
    mtp = {"model.layers.2.eh_proj.weight": mx.ones((64, 128)), "model.layers.2.enorm.weight": mx.ones((64,))}
    path = _rewrite(zoo("glm4_moe"), tmp_path / "glm", lambda w: {
        **_unstack(w, "mlp", "switch_mlp", _SAME), **mtp})
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == set(mtp)
    ref, ours = _oracle(path), load_universal(path)
    ids = _prompt(40)
    assert mx.array_equal(ref(ids), ours(ids))


def test_half_precision_experts_refuse_where_gather_mm_takes_float32_only(zoo):
    from mlxbun.models.switch_layers import gather_mm_supported
    from mlxbun.zoo.archs import runnable_variants

    if gather_mm_supported("float16"):
        pytest.skip("this device runs gather_mm in float16")
    with pytest.raises(UnsupportedModelError, match="float16 experts.*gather_mm in float32 only"):
        load_universal(zoo("mixtral", dtype="float16"))
    with pytest.raises(RuntimeError, match="GatherMM"):  # mlx-lm cannot run them either
        mx.eval(_oracle(zoo("mixtral", dtype="float16"))(_prompt(4)))
    # the manifest gates exactly what this device runs
    for arch in MANIFEST:
        assert MANIFEST[arch].variants == runnable_variants(arch), arch


# ----------------------------------------------------------------- taps


def test_routing_is_tappable_per_layer_and_localization_skips_mlxbun_only_routers(zoo):
    from mlxbun.parity.localize import first_divergence

    path = zoo("qwen3_moe")
    ref, ours = _oracle(path), load_universal(path)
    ids = _prompt(40)
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
    (lambda: _row(_QWEN3_MOE, moe=None, sanitize=(SanitizeRule("stack_experts"),)),
     "need a moe block", "stack_experts"),
    (lambda: _row(_QWEN3_MOE, moe=MoEKnobs(), sanitize=(SanitizeRule("stack_experts"),)),
     "takes a StackExperts arg", "stack_experts"),
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
    ref, ours = _oracle(path), load_universal(path)
    diff = layer_diff(ours, ref, _prompt(40)[0].tolist(), [7, 3], paths=lambda p, m: "layers" in p)
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
    ids = _prompt(24)
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

    path = _rewrite(zoo("step3p5"), tmp_path / "step3p5", to_hf)
    names = mx.load(str(path / "model.safetensors"))
    assert "model.layers.1.moe.gate_proj.weight" in names and "model.layers.1.moe.router_bias" in names
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == {"model.layers.4.eh_proj.weight", "model.mtp.norm.weight"}
    ref, ours = _oracle(path), load_universal(path)
    ids = _prompt(40)
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
