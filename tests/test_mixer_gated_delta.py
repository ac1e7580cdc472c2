"""The gated DeltaNet mixer held bit-exact to mlx-lm 0.32.2's modules.

mlx-lm's own `Qwen3NextGatedDeltaNet` (qwen3_next.py) and `GatedDeltaNet` (qwen3_5.py) are
built from tiny real configs (transformers' `Qwen3NextConfig` / `Qwen3_5TextConfig`), their
parameters copied into mlxbun's `GatedDeltaNet`, and the outputs (and cache slots) compared
with mx.array_equal: prefill, decode steps through an ArraysCache, batch 2 with left padding
and with right-padding lengths; float32 and bfloat16.
"""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.errors import ConfigError, MlxbunError
from mlxbun.models.universal.mixers import gated_delta_metal, gated_delta_rule
from mlxbun.models.universal.mixers.gated_delta import GatedDeltaKnobs, GatedDeltaNet, GdnProjections

# a tiny config: Hv = 2 Hk (the repeat path), Dk != Dv, kernel 4
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, vocab_size=100,
            intermediate_size=64, rms_norm_eps=1e-6)
DTYPES = [mx.float32, mx.bfloat16]


def _config(arch: str) -> dict:
    """The tiny real config, as the dict mlx-lm's ModelArgs reads."""
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        d = Qwen3NextConfig(**TINY).to_dict()
    else:
        from transformers import Qwen3_5TextConfig

        d = Qwen3_5TextConfig(**TINY).to_dict()
    # transformers 5 writes rope as rope_parameters; qwen3_next's ModelArgs reads the legacy keys
    d.setdefault("rope_theta", d["rope_parameters"]["rope_theta"])
    d.setdefault("partial_rotary_factor", d["rope_parameters"]["partial_rotary_factor"])
    return d


def _oracle(arch: str, d: dict):
    if arch == "qwen3_next":
        from mlx_lm.models import qwen3_next

        return qwen3_next.Qwen3NextGatedDeltaNet(qwen3_next.ModelArgs.from_dict(d))
    from mlx_lm.models import qwen3_5

    return qwen3_5.GatedDeltaNet(qwen3_5.TextModelArgs.from_dict(d))


LAYOUT = {"qwen3_next": GdnProjections.QKVZ_BA, "qwen3_5": GdnProjections.QKV_Z_B_A}


def _cast(module, dtype, keep_a_log: bool):
    """Cast parameters to dtype (qwen3_5's cast_predicate keeps A_log in float32)."""
    def cast(path, p):
        return p if keep_a_log and path.endswith("A_log") else p.astype(dtype)

    module.update(tree_map_with_path(cast, module.parameters()))


@pytest.fixture(scope="module", params=[(arch, dt) for arch in LAYOUT for dt in DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    """(mlx-lm's module, mlxbun's module with its parameters, dtype)."""
    arch, dtype = request.param
    d = _config(arch)
    mx.random.seed(0)
    theirs = _oracle(arch, d)
    theirs.update(tree_map_with_path(  # non-trivial norm / bias / A_log values
        lambda p, v: mx.random.normal(v.shape) * 0.5 + (1.0 if "norm" in p else 0.0)
        if v.ndim == 1 else v, theirs.parameters()))
    _cast(theirs, dtype, keep_a_log=arch == "qwen3_5")
    a = SimpleNamespace(model_type=d["model_type"], fields=d, hidden=d["hidden_size"],
                        eps=d["rms_norm_eps"])
    mine = GatedDeltaNet(a, GatedDeltaKnobs(LAYOUT[arch]), index=0)
    mine_keys = {k for k, _ in tree_flatten(mine.parameters())}
    theirs_params = tree_flatten(theirs.parameters())
    assert mine_keys == {k for k, _ in theirs_params}  # parameter paths are mlx-lm's
    mine.update(tree_unflatten(theirs_params))
    mine.eval(), theirs.eval()
    return theirs, mine, dtype


def _x(shape, dtype, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _same_cache(c_mine, c_theirs):
    for m, t in zip(c_mine.cache, c_theirs.cache):
        assert m.dtype == t.dtype and mx.array_equal(m, t)


def test_prefill_without_cache(pair):
    theirs, mine, dtype = pair
    x = _x((1, 7, 32), dtype, 1)
    want = theirs(x)
    got = mine(x)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want)


def test_prefill_then_decode_through_the_cache(pair):
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine, c_theirs = ArraysCache(size=mine.cache_slots), LmArraysCache(size=2)
    for step, L in enumerate([5, 1, 1, 1, 3]):
        x = _x((1, L, 32), dtype, 10 + step)
        want = theirs(x, cache=c_theirs)
        got = mine(x, cache=c_mine)
        assert mx.array_equal(got, want), f"step {step}"
        _same_cache(c_mine, c_theirs)
    assert c_mine.cache[1].dtype == mx.float32  # the delta state stays float32
    assert c_mine.tokens_seen == 11


def test_batch_two_left_padding(pair):
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine = ArraysCache(size=2, left_padding=[3, 0])
    c_theirs = LmArraysCache(size=2, left_padding=[3, 0])
    for step, L in enumerate([6, 1, 1]):
        x = _x((2, L, 32), dtype, 20 + step)
        m_mine, m_theirs = c_mine.make_mask(L), c_theirs.make_mask(L)
        assert mx.array_equal(m_mine, m_theirs)
        want = theirs(x, mask=m_theirs, cache=c_theirs)
        got = mine(x, mask=m_mine, cache=c_mine)
        assert mx.array_equal(got, want), f"step {step}"
        _same_cache(c_mine, c_theirs)


def test_batch_two_lengths_keep_the_conv_state_at_each_end(pair):
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine, c_theirs = ArraysCache(size=2), LmArraysCache(size=2)
    c_mine.prepare(lengths=[6, 4])
    c_theirs.prepare(lengths=[6, 4])
    x = _x((2, 6, 32), dtype, 30)
    want = theirs(x, mask=c_theirs.make_mask(6), cache=c_theirs)
    got = mine(x, mask=c_mine.make_mask(6), cache=c_mine)
    assert mx.array_equal(got, want)
    _same_cache(c_mine, c_theirs)
    # the short row's conv state holds its own last inputs, not the padded tail
    assert not mx.array_equal(c_mine.cache[0][1], c_mine.cache[0][0])


# ------------------------------------------------------------------ the rule on its own


@pytest.mark.parametrize("gate", ["scalar", "vector", "lower_bound", "neg_eigval"])
@pytest.mark.parametrize("masked", [False, True])
def test_gated_delta_update_equals_mlx_lm(gate, masked):
    from mlx_lm.models import gated_delta as lm

    B, T, Hk, Hv, Dk, Dv = 2, 5, 2, 4, 32, 8
    keys = iter(mx.random.split(mx.random.key(7), 8))
    q, k = (mx.random.normal((B, T, Hk, Dk), key=next(keys)).astype(mx.bfloat16) for _ in "qk")
    v = mx.random.normal((B, T, Hv, Dv), key=next(keys)).astype(mx.bfloat16)
    a_shape = (B, T, Hv, Dk) if gate == "vector" else (B, T, Hv)
    a = mx.random.normal(a_shape, key=next(keys)).astype(mx.bfloat16)
    b = mx.random.normal((B, T, Hv), key=next(keys)).astype(mx.bfloat16)
    # a vector gate as kimi_linear passes it: A_log [Hv, 1], dt_bias [Hv, Dk]
    A_log = mx.random.normal((Hv, 1) if gate == "vector" else (Hv,), key=next(keys))
    dt_bias = mx.random.normal(a_shape[2:], key=next(keys)).astype(mx.bfloat16)
    state = mx.random.normal((B, Hv, Dv, Dk), key=next(keys))
    mask = mx.array([[True] * T, [False, False] + [True] * (T - 2)]) if masked else None
    kw = {"lower_bound": -5.0} if gate == "lower_bound" else {}
    kw |= {"allow_neg_eigval": True} if gate == "neg_eigval" else {}
    q, k = gated_delta_rule.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    want = lm.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
    got = gated_delta_rule.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w)


def _function_ast(module, name: str) -> str:
    fn = next(n for n in ast.parse(inspect.getsource(module)).body
              if isinstance(n, ast.FunctionDef) and n.name == name)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body  # without a docstring
    return ast.dump(ast.Module(body=body, type_ignores=[]))


@pytest.mark.parametrize("name", ["_make_gated_delta_kernel", "_make_gated_delta_packed_kernel"])
def test_metal_kernels_are_mlx_lms(name):
    """The Metal kernels cannot run here: their makers (sources, names, inputs) must be mlx-lm's."""
    from mlx_lm.models import gated_delta as lm

    assert _function_ast(gated_delta_metal, name) == _function_ast(lm, name)


def test_metal_dispatch_is_mlx_lms():
    """gated_delta_kernel is mlx-lm's `_gated_delta_kernel_impl` with allow_packed=True."""
    from mlx_lm.models import gated_delta as lm

    theirs = _function_ast(lm, "_gated_delta_kernel_impl").replace(
        "BoolOp(op=And(), values=[Name(id='packed_eligible', ctx=Load()), Name(id='allow_packed', "
        "ctx=Load()), Name(id='_ENABLE_GDN_PACKED', ctx=Load())])",
        "BoolOp(op=And(), values=[Name(id='packed_eligible', ctx=Load()), "
        "Name(id='_ENABLE_GDN_PACKED', ctx=Load())])")
    assert _function_ast(gated_delta_metal, "gated_delta_kernel") == theirs
    assert _function_ast(gated_delta_rule, "gated_delta_update") == _function_ast(
        lm, "gated_delta_update")


# ------------------------------------------------------------------ knobs and config checks


def test_knobs_take_the_layout_string_and_refuse_others():
    assert GatedDeltaKnobs("qkvz_ba").projections is GdnProjections.QKVZ_BA
    with pytest.raises(MlxbunError, match="projections.*'qkv_z_b_a'"):
        GatedDeltaKnobs("qkvzba")
    with pytest.raises(MlxbunError, match="head_k_dim"):
        GatedDeltaKnobs(GdnProjections.QKVZ_BA, head_k_dim="")


def test_config_errors_name_the_key():
    d = _config("qwen3_5") | {"linear_num_value_heads": 3}
    a = SimpleNamespace(model_type="qwen3_5_text", fields=d, hidden=32, eps=1e-6)
    with pytest.raises(ConfigError, match="'linear_num_value_heads' \\(3\\) must be divisible"):
        GatedDeltaNet(a, GatedDeltaKnobs("qkv_z_b_a"), index=0)
    a.fields = _config("qwen3_5") | {"linear_conv_kernel_dim": 0}
    with pytest.raises(ConfigError, match="linear_conv_kernel_dim"):
        GatedDeltaNet(a, GatedDeltaKnobs("qkv_z_b_a"), index=0)
