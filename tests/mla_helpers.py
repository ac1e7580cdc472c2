"""Helpers of the MLA tests (tests/test_mla.py, test_mla_absorbed.py, test_mla_rows.py): a row
held to mlx-lm through a prefill and decode steps, and absorbed-MLA weights rewritten to the
kv_b_proj layout a transformers checkpoint holds."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from tests.hybrid_models import oracle_and_universal

IDS = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])


def prefill_and_decode(cfg):
    """mlx-lm's model and the universal graph built from `cfg`: the prefill's and three decode
    steps' logits bit-equal; returns both caches."""
    ref, ours = oracle_and_universal(cfg)
    rc, oc = mlx_cache.make_prompt_cache(ref), ours.make_cache()
    assert mx.array_equal(ref(IDS, cache=rc), ours(IDS, cache=oc))
    for t in (11, 250, 3):
        step = mx.array([[t]])
        assert mx.array_equal(ref(step, cache=rc), ours(step, cache=oc)), t
    return rc, oc


def kv_b_layout(w: dict, cfg: dict, layers: int, heads: int, quantize_first: bool = True) -> None:
    """Replace each layer's embed_q / unembed_out (mlx-lm's absorbed layout) by a random kv_b_proj
    as transformers' checkpoints hold it; layer 0's 4-bit quantized (group 32) when asked."""
    dn, dv, kv = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn"
        del w[f"{p}.embed_q.weight"], w[f"{p}.unembed_out.weight"]
        kv_b = mx.random.normal((heads * (dn + dv), kv))
        if layer == 0 and quantize_first:
            (w[f"{p}.kv_b_proj.weight"], w[f"{p}.kv_b_proj.scales"],
             w[f"{p}.kv_b_proj.biases"]) = mx.quantize(kv_b, group_size=32, bits=4)
        else:
            w[f"{p}.kv_b_proj.weight"] = kv_b
