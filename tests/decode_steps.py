"""A decoder beside the exact path, step by step: the compiled step (tests/test_fast_path.py), the
fused step with the kernels' MLX-op reference (tests/test_fused_decode.py) or with the CUDA kernels
emulated (tests/test_kernels_emulated.py)."""

import mlx.core as mx

from mlxbun.fast.fused_decoder import FusedDecoder
from mlxbun.fast.fused_plan import fused_plan
from mlxbun.kernels.fused_decode import ReferenceFusedOps

PROMPT = (3, 1, 4, 1, 5, 9, 2)


def step_beside_exact(model, make_decoder, steps: int = 6, prompt=PROMPT):
    """`prompt` prefilled into two caches, then `steps` greedy tokens decoded by the exact model on
    one and by `make_decoder(the other cache)`: (exact cache, static cache, decoder, [(exact
    logits, decoder logits)] per step)."""
    ids = mx.array([list(prompt)])
    exact, static = model.make_cache(), model.make_cache()
    model(ids, cache=exact)
    model(ids, cache=static)
    dec = make_decoder(static)
    y = mx.array([[7]])
    pairs = []
    for _ in range(steps):
        e = model(y, cache=exact)[:, -1, :]
        pairs.append((e, dec(y)))
        y = mx.argmax(e, axis=-1)[:, None]
    return exact, static, dec, pairs


def decode_both(model, steps=6, ops=None, room=None):
    """`step_beside_exact` with the fused step (`ops`: its executor, the MLX-op reference by default)."""
    return step_beside_exact(model, lambda static: FusedDecoder(model, fused_plan(model), static, room or steps,
                                                                ops or ReferenceFusedOps()), steps)
