"""The Mamba2 mixer (models/universal/mixers/mamba2.py, ssm.py) against mlx-lm 0.32.2's own.

mlx-lm's mixer is built from a tiny real config (transformers' Mamba2Config, NemotronHConfig,
FalconH1Config, GraniteMoeHybridConfig through mlx-lm's ModelArgs), given random parameters,
and mlxbun's mixer takes the same ones (a strict load: the parameter paths are mlx-lm's).
Outputs and both cache slots are compared bit-exact (mx.array_equal) in float32 and bfloat16
(also with the scan's parameters left in float32): a prefill without a cache, a prefill of
more than one 256-token scan chunk, a prefill then decode steps through an
ArraysCache (mlxbun's vs mlx-lm's), a batch of two with left padding (the ssm mask), and a
batch of two prefilled with per-row lengths (mlx-lm's batched generation), then decoded.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.mixers import ssm
from mlxbun.models.universal.mixers.mamba2 import (
    GatedNorm,
    Mamba2Knobs,
    Mamba2KnobsError,
    Mamba2Mixer,
)
from mlxbun.models.universal.table import DESCRIPTORS

SIZES = dict(hidden_size=32, vocab_size=128, n_groups=2, conv_kernel=4)

# the rows' knobs (falcon_h1 has no row: its knobs are here)
MAMBA2, NEMOTRON_H, GRANITEMOEHYBRID = (DESCRIPTORS[a].hybrid.mixer_knobs()
                                        for a in ("mamba2", "nemotron_h", "granitemoehybrid"))
FALCON_H1 = Mamba2Knobs(heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state",
                        groups="mamba_n_groups", conv_kernel="mamba_d_conv",
                        conv_bias="mamba_conv_bias", in_bias="mamba_proj_bias",
                        out_bias="projectors_bias", eps="rms_norm_eps", intermediate="mamba_d_ssm",
                        time_step_limit=(0.0, math.inf), norm_when="mamba_rms_norm",
                        norm_before_gate="mamba_norm_before_gate")


def _mamba2():
    from mlx_lm.models.mamba2 import Mamba2Block, ModelArgs
    from transformers import Mamba2Config

    cfg = Mamba2Config(num_heads=8, head_dim=8, state_size=16, num_hidden_layers=2,
                       use_bias=True, time_step_limit=(0.001, 10.0), **SIZES).to_dict()
    # mlx-lm's ModelArgs requires intermediate_size, which transformers 5's Mamba2Config no
    # longer writes (its mixer never reads it)
    args = ModelArgs.from_dict({**cfg, "intermediate_size": 64})
    return args, Mamba2Block(args, 0), MAMBA2, lambda m, x, mask, c: m(x, mask, c)


def _nemotron_h():
    from mlx_lm.models.nemotron_h import ModelArgs, NemotronHMamba2Mixer
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16,
                          layers_block_type=["linear_attention", "full_attention"],
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=64, mamba_proj_bias=True, **SIZES).to_dict()
    args = ModelArgs.from_dict(cfg)
    return args, NemotronHMamba2Mixer(args), NEMOTRON_H, lambda m, x, mask, c: m(x, mask, c)


def _falcon_h1(rms_norm: bool, before_gate: bool):
    def build():
        from mlx_lm.models.falcon_h1 import FalconH1Mixer, ModelArgs
        from transformers import FalconH1Config

        cfg = FalconH1Config(hidden_size=32, vocab_size=128, mamba_n_heads=8, mamba_d_head=8,
                             mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                             mamba_proj_bias=True, projectors_bias=True, mamba_rms_norm=rms_norm,
                             mamba_norm_before_gate=before_gate, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64,
                             num_hidden_layers=2).to_dict()
        args = ModelArgs.from_dict(cfg)
        return args, FalconH1Mixer(args), FALCON_H1, lambda m, x, mask, c: m(x, cache=c, mask=mask)
    return build


def _granitemoehybrid():
    from mlx_lm.models.granitemoehybrid import GraniteMoeHybridMamba2Mixer, ModelArgs
    from transformers import GraniteMoeHybridConfig

    cfg = GraniteMoeHybridConfig(hidden_size=32, vocab_size=128, mamba_n_heads=8, mamba_d_head=8,
                                 mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                                 mamba_proj_bias=True, time_step_limit=(0.01, 50.0),
                                 num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, num_hidden_layers=2).to_dict()
    args = ModelArgs.from_dict(cfg)
    return args, GraniteMoeHybridMamba2Mixer(args), GRANITEMOEHYBRID, lambda m, x, mask, c: m(x, mask, c)


CASES = {"mamba2": _mamba2, "nemotron_h": _nemotron_h, "granitemoehybrid": _granitemoehybrid,
         "falcon_h1": _falcon_h1(False, True),
         "falcon_h1-rms_norm": _falcon_h1(True, False),
         "falcon_h1-rms_norm-before_gate": _falcon_h1(True, True)}
# bfloat16: cast as mlx_lm.convert casts (nemotron_h's cast_predicate keeps A_log in float32);
# bfloat16-mixed: A_log, D and dt_bias left in float32, as an unconverted checkpoint may hold them
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "bfloat16-mixed": mx.bfloat16}
SCAN_PARAMS = ("A_log", "D", "dt_bias")


def _universal_args(args) -> SimpleNamespace:
    return SimpleNamespace(fields=dict(vars(args)), hidden=args.hidden_size,
                           model_type=args.model_type)


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    """(mlx-lm's mixer, mlxbun's with the same parameters, how to call mlx-lm's, dtype)."""
    case, dtype_name = request.param
    args, ref, knobs, call = CASES[case]()
    dtype = DTYPES[dtype_name]
    mx.random.seed(7)
    params = []
    for k, v in tree_flatten(ref.parameters()):
        if k == "A_log":
            p = mx.log(mx.random.uniform(0.5, 8.0, v.shape))
        elif k == "dt_bias":
            p = mx.random.uniform(-4.0, 1.0, v.shape)
        elif k.endswith("norm.weight"):
            p = 1.0 + 0.2 * mx.random.normal(v.shape)
        else:
            p = 0.3 * mx.random.normal(v.shape)
        keep = (k == "A_log" and case == "nemotron_h") or (
            dtype_name == "bfloat16-mixed" and k in SCAN_PARAMS)
        params.append((k, p if keep else p.astype(dtype)))
    ref.update(tree_unflatten(params))
    ours = Mamba2Mixer(_universal_args(args), knobs, 0)
    ours.load_weights(params, strict=True)
    assert ours.cache_slots == 2
    return ref, ours, call, dtype


def _x(shape, dtype, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert mx.array_equal(a, b).item(), f"{what}: max |diff| {mx.abs(a - b).max().item()}"


def _same_cache(rc, oc, what):
    for i in range(2):
        _same(rc[i], oc[i], f"{what}: cache slot {i}")


def _caches(**kw):
    from mlx_lm.models.cache import ArraysCache as RefArraysCache

    return RefArraysCache(2, **kw), ArraysCache(2, **kw)


@pytest.mark.parametrize("length", [7, 300])
def test_prefill_without_cache(pair, length):
    ref, ours, call, dtype = pair
    x = _x((1, length, 32), dtype, 1)
    _same(call(ref, x, None, None), ours(x, None, None), f"prefill L={length}")


def test_prefill_then_decode(pair):
    ref, ours, call, dtype = pair
    rc, oc = _caches()
    x = _x((1, 5, 32), dtype, 2)
    _same(call(ref, x, None, rc), ours(x, None, oc), "prefill")
    _same_cache(rc, oc, "prefill")
    for step in range(4):
        x = _x((1, 1, 32), dtype, 10 + step)
        _same(call(ref, x, None, rc), ours(x, None, oc), f"decode step {step}")
        _same_cache(rc, oc, f"decode step {step}")
    assert oc.tokens_seen == 9


def test_batch_left_padding(pair):
    ref, ours, call, dtype = pair
    rc, oc = _caches(left_padding=[2, 0])
    for step, length in enumerate((6, 1, 1)):
        x = _x((2, length, 32), dtype, 20 + step)
        rmask, omask = rc.make_mask(length), oc.make_mask(length)
        _same(rmask, omask, "mask")
        _same(call(ref, x, rmask, rc), ours(x, omask, oc), f"left-padded step {step}")
        _same_cache(rc, oc, f"left-padded step {step}")


def test_batch_lengths(pair):
    """mlx-lm's batched prefill: right-padded rows with their lengths (the scan keeps each row's
    state at its length where the knobs pass lengths), then plain decode steps."""
    ref, ours, call, dtype = pair
    rc, oc = _caches()
    for c in (rc, oc):
        c.prepare(lengths=[6, 3])
    x = _x((2, 6, 32), dtype, 30)
    rmask, omask = rc.make_mask(6), oc.make_mask(6)
    _same(call(ref, x, rmask, rc), ours(x, omask, oc), "prefill with lengths")
    _same_cache(rc, oc, "prefill with lengths")
    for c in (rc, oc):
        c.finalize()
    for step in range(2):
        x = _x((2, 1, 32), dtype, 40 + step)
        _same(call(ref, x, None, rc), ours(x, None, oc), f"decode step {step}")
        _same_cache(rc, oc, f"decode step {step}")


def test_metal_kernel_is_mlx_lms():
    """The Metal kernel Apple users get is mlx-lm's text, and off Metal there is none."""
    from mlx_lm.models import ssm as ref_ssm

    assert ssm.SSM_KERNEL_SOURCE in inspect.getsource(ref_ssm.make_ssm_kernel)
    assert (ssm._ssm_kernel is None) == (not mx.metal.is_available())


@pytest.mark.parametrize("bad, msg", [
    (dict(norm="layer"), "Mamba2Knobs.norm = 'layer' is not one of 'whole', 'grouped'"),
    (dict(norm="grouped", norm_before_gate=True), "norm_before_gate takes norm 'whole'"),
    (dict(time_step_limit=(1.0, 0.0)), "Mamba2Knobs.time_step_limit = (1.0, 0.0)"),
    (dict(heads=""), "Mamba2Knobs.heads = '' must be a ModelArgs field name"),
    (dict(d_cast="yes"), "Mamba2Knobs.d_cast = 'yes' must be a bool"),
])
def test_knobs_refused_when_built(bad, msg):
    with pytest.raises(Mamba2KnobsError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Mamba2Knobs(**bad)


def test_knobs_refs_and_coercion():
    k = Mamba2Knobs(norm="grouped")
    assert k.norm is GatedNorm.GROUPED
    refs = dict(FALCON_H1.field_refs())
    assert refs["hybrid.knobs.norm_before_gate"] == "mamba_norm_before_gate"
    assert "hybrid.knobs.time_step_limit" not in refs  # a literal
    assert dict(Mamba2Knobs().field_refs())["hybrid.knobs.time_step_limit"] == "time_step_limit"


def test_config_refused_with_the_key():
    args, _, knobs, _ = _mamba2()
    a = _universal_args(args)
    a.fields["n_groups"] = 3
    with pytest.raises(ConfigError, match=r"'num_heads' \(8\) is not a multiple of 'n_groups' \(3\)"):
        Mamba2Mixer(a, knobs, 0)
    a.fields["n_groups"], a.fields["use_conv_bias"] = 2, "true"
    with pytest.raises(ConfigError, match="'use_conv_bias' must be true or false"):
        Mamba2Mixer(a, knobs, 0)
