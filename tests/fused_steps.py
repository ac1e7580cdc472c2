"""The fused decode step beside the exact path, step by step (tests/test_fused_decode.py with the
kernels' MLX-op reference, tests/test_kernels_emulated.py with the CUDA kernels emulated)."""

import mlx.core as mx

from mlxbun.fast.fused_decoder import FusedDecoder
from mlxbun.fast.fused_plan import fused_plan
from mlxbun.kernels.fused_decode import ReferenceFusedOps

PROMPT = (3, 1, 4, 1, 5, 9, 2)


def decode_both(model, steps=6, ops=None, room=None):
    ids = mx.array([list(PROMPT)])
    exact, static = model.make_cache(), model.make_cache()
    model(ids, cache=exact)
    model(ids, cache=static)
    dec = FusedDecoder(model, fused_plan(model), static, room or steps, ops or ReferenceFusedOps())
    y = mx.array([[7]])
    pairs = []
    for _ in range(steps):
        e = model(y, cache=exact)[:, -1, :]
        pairs.append((e, dec(y)))
        y = mx.argmax(e, axis=-1)[:, None]
    return exact, static, dec, pairs
