"""mlxbun's own graphs route TurboQuant caches natively (no patch needed), and agree
bit for bit with an mlx-lm model running the same caches under patch_mlxlm_attention."""

import mlx.core as mx

import mlxbun
from mlxbun.cache.turboquant import TurboQuantKVCache, patch_mlxlm_attention
from mlxbun.models.mlxlm import load_mlxlm


def _run(model, prompt, steps, caches):
    logits = [model(prompt, cache=caches)[:, -1]]
    tok = mx.argmax(logits[-1], axis=-1)[:, None]
    for _ in range(steps):
        logits.append(model(tok, cache=caches)[:, -1])
        tok = mx.argmax(logits[-1], axis=-1)[:, None]
    mx.eval(logits)
    return logits


def test_universal_graph_uses_rotated_decode_and_matches_mlx_lm_both_on_mlxbun_turboquant_caches(zoo, monkeypatch):
    path = zoo("qwen3")
    ours, ref = mlxbun.open_model(path), load_mlxlm(path)
    prompt = mx.array([list(range(40, 64))])
    n = len(ours.layers)

    calls = []
    real = TurboQuantKVCache.decode_attention

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(TurboQuantKVCache, "decode_attention", counting)
    a = _run(ours, prompt, 6, [TurboQuantKVCache(bits=3.5, seed=i) for i in range(n)])
    assert len(calls) == 6 * n  # every decode step of every layer ran in the rotated space
    with patch_mlxlm_attention():
        b = _run(ref.module, prompt, 6, [TurboQuantKVCache(bits=3.5, seed=i) for i in range(n)])
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))
