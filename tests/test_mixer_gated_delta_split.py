"""olmo_hybrid's gated DeltaNet mixer held bit-exact to mlx-lm 0.32.2's `olmo_hybrid.GatedDeltaNet`.

mlx-lm's module is built from a tiny real config (transformers' `OlmoHybridConfig`), its
parameters copied into mlxbun's `GatedDeltaSplitConv`, and the outputs and the four cache slots
compared with mx.array_equal: prefill, decode steps through an ArraysCache, batch 2 with left
padding (the ssm mask reaches only the delta rule) and with lengths; float32 and bfloat16; beta
in [0, 2] and in [0, 1].
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.errors import MlxbunError
from mlxbun.models.universal.mixers.gated_delta_split import GatedDeltaSplitConv, GatedDeltaSplitKnobs

D = 32


def _config(neg: bool) -> dict:
    from transformers import OlmoHybridConfig

    # Hv = 2 Hk (the repeat path), Dk != Dv, kernel 4
    return OlmoHybridConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100, linear_num_value_heads=4,
                            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                            linear_allow_neg_eigval=neg).to_dict()


@pytest.fixture(scope="module",
                params=[(dt, neg) for dt in (mx.float32, mx.bfloat16) for neg in (True, False)],
                ids=lambda p: f"{p[0]}-neg_eigval={p[1]}")
def pair(request):
    """(mlx-lm's module, mlxbun's module with its parameters, dtype)."""
    from mlx_lm.models import olmo_hybrid

    dtype, neg = request.param
    d = _config(neg)
    mx.random.seed(0)
    theirs = olmo_hybrid.GatedDeltaNet(olmo_hybrid.ModelArgs.from_dict(d))
    theirs.update(tree_map_with_path(  # non-trivial norm / A_log / dt_bias values
        lambda p, v: mx.random.normal(v.shape) * 0.5 + (1.0 if "norm" in p else 0.0)
        if v.ndim == 1 else v, theirs.parameters()))
    theirs.update(tree_map_with_path(lambda p, v: v.astype(dtype), theirs.parameters()))
    a = SimpleNamespace(model_type="olmo_hybrid", fields={"layer_norm_epsilon": 1e-5, **d}, hidden=D,
                        eps=d["rms_norm_eps"])
    mine = GatedDeltaSplitConv(a, GatedDeltaSplitKnobs(), index=0)
    theirs_params = tree_flatten(theirs.parameters())
    assert {k for k, _ in tree_flatten(mine.parameters())} == {k for k, _ in theirs_params}
    mine.update(tree_unflatten(theirs_params))
    mine.eval(), theirs.eval()
    return theirs, mine, dtype


def _x(shape, dtype, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _same_cache(c_mine, c_theirs):
    for m, t in zip(c_mine.cache, c_theirs.cache, strict=True):
        assert m.dtype == t.dtype and mx.array_equal(m, t)


def test_prefill_without_cache(pair):
    theirs, mine, dtype = pair
    x = _x((1, 7, D), dtype, 1)
    want, got = theirs(x), mine(x)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want)


def test_prefill_then_decode_through_the_cache(pair):
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine, c_theirs = ArraysCache(size=mine.cache_slots), LmArraysCache(size=4)
    for step, L in enumerate([5, 1, 1, 1, 3]):
        x = _x((1, L, D), dtype, 10 + step)
        assert mx.array_equal(mine(x, cache=c_mine), theirs(x, cache=c_theirs)), f"step {step}"
        _same_cache(c_mine, c_theirs)
    assert [s.shape for s in c_mine.cache] == [(1, 3, 32), (1, 3, 32), (1, 3, 32), (1, 4, 8, 16)]
    assert c_mine.cache[3].dtype == mx.float32  # the delta state stays float32
    assert c_mine.tokens_seen == 11


def test_batch_two_left_padding(pair):
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine = ArraysCache(size=4, left_padding=[3, 0])
    c_theirs = LmArraysCache(size=4, left_padding=[3, 0])
    for step, L in enumerate([6, 1, 1]):
        x = _x((2, L, D), dtype, 20 + step)
        m_mine, m_theirs = c_mine.make_mask(L), c_theirs.make_mask(L)
        assert mx.array_equal(m_mine, m_theirs)
        assert mx.array_equal(mine(x, mask=m_mine, cache=c_mine),
                              theirs(x, mask=m_theirs, cache=c_theirs)), f"step {step}"
        _same_cache(c_mine, c_theirs)


def test_batch_two_lengths(pair):
    """mlx-lm's olmo_hybrid keeps every row's last K - 1 inputs, whatever its length."""
    from mlx_lm.models.cache import ArraysCache as LmArraysCache

    theirs, mine, dtype = pair
    c_mine, c_theirs = ArraysCache(size=4), LmArraysCache(size=4)
    c_mine.prepare(lengths=[6, 4])
    c_theirs.prepare(lengths=[6, 4])
    x = _x((2, 6, D), dtype, 30)
    assert mx.array_equal(mine(x, mask=c_mine.make_mask(6), cache=c_mine),
                          theirs(x, mask=c_theirs.make_mask(6), cache=c_theirs))
    _same_cache(c_mine, c_theirs)


def test_knobs_name_fields():
    with pytest.raises(MlxbunError, match="GatedDeltaSplitKnobs.norm_eps: expected a ModelArgs field"):
        GatedDeltaSplitKnobs(norm_eps="")
    refs = dict(GatedDeltaSplitKnobs().field_refs())
    assert refs["hybrid.knobs.allow_neg_eigval"] == "linear_allow_neg_eigval"
