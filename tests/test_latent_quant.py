"""The opt-in uniform quantization of an MLA latent cache (mlxbun/cache/latent_quant.py): the same
bytes and codes as mlx-lm's QuantizedKVCache, a dequantized fetch, never built by default; and
teacher forcing refuses what generation refuses."""

import mlx.core as mx
import pytest

from mlxbun.cache.kv import KVCache
from mlxbun.cache.latent_quant import DequantizingKVCache, quantize_latent_caches
from mlxbun.cache.quantized import KVQuantError, QuantizedKVCache
from mlxbun.errors import GenerationError, MlxbunError
from mlxbun.names import KVSettings


def _kv(L, dk=64, dv=128, seed=0):
    k = mx.random.normal((1, 1, L, dk), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((1, 1, L, dv), key=mx.random.key(seed + 1)).astype(mx.float16)
    return k, v


@pytest.mark.parametrize("bits", [4, 8])
def test_same_bytes_as_mlx_lm_layout_and_a_dequantized_fetch(bits):
    ours, ref = DequantizingKVCache(group_size=64, bits=bits), QuantizedKVCache(group_size=64, bits=bits)
    for step, L in enumerate((300, 1, 1)):  # a prefill past one growth step, then decode steps
        k, v = _kv(L, seed=2 * step)
        got_k, got_v = ours.update_and_fetch(k, v)
        q_k, q_v = ref.update_and_fetch(k, v)
        assert got_k.dtype == mx.float16 and got_k.shape == (1, 1, ours.offset, 64)
        assert mx.array_equal(got_k, mx.dequantize(*q_k, group_size=64, bits=bits))
        assert mx.array_equal(got_v, mx.dequantize(*q_v, group_size=64, bits=bits))
    assert ours.nbytes == ref.nbytes and all(mx.array_equal(a, b) for a, b in zip(ours.keys, ref.keys))


def test_conversion_of_filled_caches_only_and_head_dim_refusal():
    filled, empty = KVCache(), KVCache()
    k, v = _kv(10)
    filled.update_and_fetch(k, v)
    caches = [filled, empty]
    quantize_latent_caches(caches, bits=8)
    assert type(caches[0]) is DequantizingKVCache and caches[0].offset == 10 and caches[1] is empty
    assert mx.array_equal(caches[0].keys[0], mx.quantize(filled.keys, group_size=64, bits=8)[0])  # to_quantized
    narrow = KVCache()
    narrow.update_and_fetch(*_kv(4, dk=64, dv=8))
    with pytest.raises(KVQuantError, match="head dim 8"):
        quantize_latent_caches([narrow], bits=4)


def test_saving_it_as_a_prompt_cache_is_refused(tmp_path):
    from mlxbun.cache.prompt_cache import IDENTITY_KEYS, save_prompt_cache

    c = DequantizingKVCache(bits=8)
    c.update_and_fetch(*_kv(4))
    identity = {**dict.fromkeys(IDENTITY_KEYS, "x"), "num_layers": "1"}
    with pytest.raises(MlxbunError, match="DequantizingKVCache"):
        save_prompt_cache(tmp_path / "c.safetensors", [c], model_identity=identity)


def test_teacher_forcing_refuses_what_generation_refuses_and_runs_the_opt_in(zoo, tmp_path):
    from mlxbun.models.universal.loader import load_universal
    from mlxbun.parity.forced import teacher_forced
    from mlxbun.zoo import build

    model = load_universal(zoo("deepseek_v3"))
    ids = list(range(5, 25))
    with pytest.raises(GenerationError, match="MLA latent"):  # was an AttributeError mid-run
        teacher_forced(model, ids, prefill=8, kv=KVSettings("uniform", 8, 64))
    with pytest.raises(MlxbunError, match="not more"):
        teacher_forced(model, ids, prefill=8, kv=KVSettings("uniform", 8, 64), quantize=lambda c: None)
    wide = tmp_path / "wide"
    wide.mkdir()
    build.build_files(build.variant("deepseek_v3"), wide, {"qk_rope_head_dim": 64, "head_dim": 64})
    model = load_universal(wide)
    plain = teacher_forced(model, ids, prefill=8)
    q8 = teacher_forced(model, ids, prefill=8, quantize=lambda c: quantize_latent_caches(c, bits=8))
    assert q8.kv_bytes < plain.kv_bytes and not mx.array_equal(q8.logits, plain.logits)
    assert mx.allclose(q8.logits, plain.logits, atol=0.05)  # 8-bit codes: close, not equal
