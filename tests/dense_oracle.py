"""mlx-lm as the oracle of the universal graphs (the dense, MoE and Gemma-4 tests): its model of a
checkpoint, the parity check they share (prefill, greedy decode through each side's own caches,
a batch of two), and the random checkpoints they build."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.models.universal.loader import load_universal

PROMPT_LEN, DECODE_STEPS = 40, 8


def oracle(path):
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return model


def oracle_cache(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def prompt_ids(n, batch=1, seed=7):
    return mx.random.randint(1, 512, (batch, n), key=mx.random.key(seed))


def first_divergence(ref, ours, ids) -> str:
    """Localize a mismatch: the first module (in execution order) whose output differs."""
    from mlxbun.models.taps import capture

    with capture(ref) as a:
        ref(ids)
    with capture(ours) as b:
        ours(ids)
    for path, i in a.order:
        x, y = a[path][i], b.get(path, [None] * (i + 1))[i]
        if y is None or x.shape != y.shape or not mx.array_equal(x, y):
            return path
    return "none (only the head differs)"


def assert_parity(path):
    """40-token prefill, 8 greedy decode steps through each side's own caches, batch-2 forward."""
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    ref_cache, our_cache = oracle_cache(ref), ours.make_cache()
    expected, got = ref(ids, cache=ref_cache), ours(ids, cache=our_cache)
    assert got.shape == expected.shape == (1, PROMPT_LEN, 512)
    assert mx.array_equal(expected, got), f"prefill differs first at {first_divergence(ref, ours, ids)}"
    token = mx.argmax(expected[:, -1], axis=-1)[:, None]
    for step in range(DECODE_STEPS):
        expected, got = ref(token, cache=ref_cache), ours(token, cache=our_cache)
        assert mx.array_equal(expected, got), f"decode step {step} differs"
        token = mx.argmax(expected[:, -1], axis=-1)[:, None]
    def children(caches):  # falcon_h1: each layer's CacheList, child by child
        return [x for c in caches for x in getattr(c, "caches", (c,))]

    for c, r in zip(children(our_cache), children(ref_cache), strict=True):  # a recurrent layer's
        # state, bit for bit; a KV cache's offset
        if hasattr(r, "offset"):
            assert c.offset == r.offset
        else:
            assert all(mx.array_equal(x, y) for x, y in zip(c.cache, r.cache, strict=True))

    batch = prompt_ids(24, batch=2, seed=11)
    assert mx.array_equal(ref(batch), ours(batch)), f"batch-2 differs first at {first_divergence(ref, ours, batch)}"


def random_checkpoint(out: Path, cfg: dict, dtype: str, quant, seed: int = 0) -> Path:
    """A checkpoint built from the arch's mlx-lm Model: random weights, norms not ones."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    mx.random.seed(seed)
    params = []
    for name, v in tree_flatten(model.parameters()):
        noise = mx.random.normal(v.shape)
        params.append((name, (1.0 + 0.1 * noise if "norm" in name else 0.08 * noise).astype(v.dtype)))
    model.update(tree_unflatten(params))
    if quant is not None:
        nn.quantize(model, group_size=32, bits=quant)
        cfg = {**cfg, "quantization": {"group_size": 32, "bits": quant}}
    weights = dict(tree_flatten(model.parameters()))
    if dtype != "float32":
        weights = {k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out
