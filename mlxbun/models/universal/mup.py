"""falcon_h1's muP multipliers as mlx-lm 0.32.2 applies them: folded into HF-layout weights by
its `sanitize` (`fold_falcon_h1`, SanitizeOp.FALCON_H1_MUP), and a tied head's logits times
lm_head_multiplier / embedding_multiplier in its forward (`tied_ratio`, PostOp.TIED_MUL_RATIO).

mlx-lm folds each multiplier by key suffix, first match wins, in this order: embed_tokens
(embedding_multiplier), lm_head (lm_head_multiplier), q_proj and k_proj (attention_in_multiplier;
v_proj is left alone), key_proj (attention_in * key_multiplier: no falcon_h1 tensor has that
name, so key_multiplier changes nothing), o_proj (attention_out_multiplier), out_proj
(ssm_out_multiplier), gate_proj and down_proj (mlp_multipliers[0] / [1]), in_proj (ssm_in_multiplier
times the per-row muP vector built from ssm_multipliers); biases are never scaled. A checkpoint
whose layer-0 conv1d is already in mlx's layout (an mlx-lm conversion) is taken as folded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlxbun.errors import LoadError
from mlxbun.models.universal.fields import fail

__all__ = ["fold_falcon_h1", "tied_ratio"]

_PROBE = "model.layers.0.mamba.conv1d.weight"  # the tensor mlx-lm's sanitize tests


def _number(a: Mapping[str, Any], key: str, mt: str, index: int | None = None) -> float:
    v = a[key] if index is None else a[key][index]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        where = key if index is None else f"{key}[{index}]"
        raise fail(mt, f"'{where}' must be a number, got {v!r}")
    return v


def _numbers(a: Mapping[str, Any], key: str, n: int, mt: str) -> list:
    v = a[key]
    if not isinstance(v, (list, tuple)) or len(v) < n:
        raise fail(mt, f"'{key}' must list at least {n} numbers (mlx-lm reads the first {n}), got {v!r}")
    return [_number(a, key, mt, i) for i in range(n)]


def tied_ratio(a: Mapping[str, Any], by: str, over: str, mt: str) -> float:
    """The tied head's logit multiplier, `by / over` as mlx-lm's forward computes it."""
    num, den = _number(a, by, mt), _number(a, over, mt)
    if den == 0:
        raise fail(mt, f"'{over}' is 0: a tied head's logits are scaled by {by} / {over}")
    return num / den


def _mup_vector(a: Mapping[str, Any], mt: str) -> mx.array:
    """falcon_h1.compute_mup_vector: each in_proj segment's ssm_multiplier, one per row."""
    gs = a["mamba_n_groups"] * a["mamba_d_state"]
    sizes = [a["mamba_d_ssm"], a["mamba_d_ssm"], gs, gs, a["mamba_n_heads"]]
    return mx.concatenate(
        [mx.broadcast_to(mx.array(m), (s,)) for s, m in zip(sizes, _numbers(a, "ssm_multipliers", 5, mt))]
    )


def fold_falcon_h1(w: dict, a: Mapping[str, Any], mt: str) -> dict:
    """falcon_h1.sanitize, op for op (`w` may hold header-only tensors: their shapes move)."""
    if _PROBE not in w:
        raise LoadError(f"falcon_h1 checkpoint lacks {_PROBE} (mlx-lm's sanitize reads it)")
    c1d = w[_PROBE]
    if c1d.shape[-1] <= c1d.shape[1]:
        return w
    emb, head = _number(a, "embedding_multiplier", mt), _number(a, "lm_head_multiplier", mt)
    attn_in, key = _number(a, "attention_in_multiplier", mt), _number(a, "key_multiplier", mt)
    attn_out, ssm_out = _number(a, "attention_out_multiplier", mt), _number(a, "ssm_out_multiplier", mt)
    mlp = _numbers(a, "mlp_multipliers", 2, mt)
    ssm_in, mup = _number(a, "ssm_in_multiplier", mt), _mup_vector(a, mt)
    out = {}
    for name, param in w.items():
        if not isinstance(param, mx.array):  # a header-only tensor: only a conv1d's shape moves
            out[name] = param.swapaxes(1, 2) if "conv1d.weight" in name else param
            continue
        if name.endswith("embed_tokens.weight"):
            param = param * emb
        elif name.endswith("lm_head.weight"):
            param = param * head
        elif name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            param = param * attn_in
        elif name.endswith("key_proj.weight"):
            param = param * (attn_in * key)
        elif name.endswith("o_proj.weight"):
            param = param * attn_out
        elif name.endswith("out_proj.weight"):
            param = param * ssm_out
        elif name.endswith("gate_proj.weight"):
            param = param * mlp[0]
        elif name.endswith("down_proj.weight"):
            param = param * mlp[1]
        elif name.endswith("in_proj.weight"):
            param = param * (ssm_in * mup.astype(param.dtype)[:, None])
        elif "conv1d.weight" in name:
            param = param.transpose(0, 2, 1)
        out[name] = param
    return out
