"""The gated delta rule as mlx-lm 0.32.2 runs it (`mlx_lm/models/gated_delta.py`).

`gated_delta_update` is mlx-lm's entry point with its dispatch: on Apple GPUs (default
device gpu, Metal available, Dk a multiple of 32) the Metal kernels of `gated_delta_metal`;
everywhere else (CPU, CUDA, training) the ops path, one compiled step per token, which is
what mlxbun runs and holds bit-exact here. The gates are mlx-lm's compiled functions
(`compute_g`, `compute_lower_bound_g`), and `normalize_qk` folds the readout scale into q.
Callers normalize q / k themselves; the update applies no scale of its own (mlx-lm's contract).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.universal.mixers.gated_delta_metal import gated_delta_kernel

__all__ = ["compute_g", "compute_lower_bound_g", "gated_delta_ops", "gated_delta_update",
           "normalize_qk"]


@partial(mx.compile, shapeless=True)
def compute_g(A_log, a, dt_bias):
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@partial(mx.compile, shapeless=True)
def compute_lower_bound_g(A_log, a, dt_bias, lower_bound):
    return mx.exp(
        lower_bound
        * mx.sigmoid(
            mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias)
        )
    )


def normalize_qk(
    q: mx.array, k: mx.array, *, inv_scale: float, eps: float
) -> Tuple[mx.array, mx.array]:
    """L2-normalize q/k and fold the ``head_dim**-0.5`` readout scale into q.

    ``eps`` is the reference l2norm eps, which is added to sum(x^2).
    ``mx.fast.rms_norm`` adds it to mean(x^2), so scale it by ``inv_scale**2``.
    """
    rms_eps = eps * inv_scale**2
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)
    k = inv_scale * mx.fast.rms_norm(k, None, rms_eps)
    return q, k


@mx.compile
def _gated_delta_step_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """One recurrent step (mlx-lm's compiled `_gated_delta_step_ops`).

    q, k: [B, H, Dk]; v: [B, H, Dv]; g: [B, H] or [B, H, Dk]; beta: [B, H];
    state: [B, H, Dv, Dk]. Returns y [B, H, Dv] and the new state.
    """
    old_state = state
    if g.ndim == 2:
        decay = g[..., None, None]
    elif g.ndim == 3:
        decay = g[..., None, :]
    else:
        raise ValueError(f"Unsupported gating shape {g.shape}")
    state = state * decay
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # [B, H, Dv]

    if mask is not None:
        mask = mx.expand_dims(mask, axis=(1, 2, 3))
        state = mx.where(mask, state, old_state)
    return y.astype(q.dtype), state


def gated_delta_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """The ops path: a sequential loop of compiled steps (scalar or vector gates).

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] or [B, T, Hv, Dk];
    beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]. Returns y [B, T, Hv, Dv] and the state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)

    if (repeat_factor := Hv // Hk) > 1:
        q = mx.repeat(q, repeat_factor, -2)
        k = mx.repeat(k, repeat_factor, -2)

    ys = []
    for t in range(T):
        y, state = _gated_delta_step_ops(
            q[:, t],
            k[:, t],
            v[:, t],
            g[:, t],
            beta[:, t],
            state,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
    y = mx.stack(ys, axis=1)
    return y, state


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule recurrence (mlx-lm's, with its kernel-or-ops dispatch).

    `allow_neg_eigval` puts beta in [0, 2] instead of [0, 1]; `lower_bound` takes the
    sigmoid-bounded gate (`compute_lower_bound_g`) instead of `compute_g`.
    """
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = compute_g(A_log, a, dt_bias)
    else:
        g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        B, _, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)

    if (
        not use_kernel
        or mx.default_device() != mx.gpu
        or not mx.metal.is_available()
        or k.shape[-1] < 32
        or k.shape[-1] % 32 != 0
    ):
        return gated_delta_ops(q, k, v, g, beta, state, mask)
    return gated_delta_kernel(q, k, v, g, beta, state, mask)
