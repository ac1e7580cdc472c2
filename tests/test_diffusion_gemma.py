"""DiffusionGemma graph (`mlxbun.models.diffusion_gemma`) held bit-exact to mlx-vlm 0.7.10 (L2).

The oracle is mlx-vlm's own `load` of the same tiny zoo checkpoint (HF layout, strict load):
single encoder and decoder forwards must be `mx.array_equal`, cache contents included, over
prompts inside and beyond the sliding window, across fed-back canvases (rotating cache in
concat and in-place mode), with and without self-conditioning. Loading refuses bad inputs
with mlxbun errors that name the culprit.
"""

import json
import shutil

import mlx.core as mx
import pytest

from mlxbun.errors import ConfigError, LoadError, MlxbunError, UnsupportedModelError
from mlxbun.models.diffusion_gemma.config import config_from_dict
from mlxbun.models.diffusion_gemma.layers import cache_state
from mlxbun.models.diffusion_gemma.loader import load_diffusion_gemma
from mlxbun.models.diffusion_gemma.model import DiffusionGemmaModel
from mlxbun.zoo.diffusion import (
    cached_diffusion_checkpoint,
    make_diffusion_checkpoint,
    tiny_diffusion_config,
)

PROMPT = [1, 40, 77, 300, 12, 9, 100, 200, 350, 18, 7, 41]  # inside the 16-token window
LONG_PROMPT = PROMPT + list(range(60, 82))  # 34 tokens: beyond it, and >= 32 sorts the experts


@pytest.fixture(scope="session")
def ckpt(zoo_root):
    return cached_diffusion_checkpoint(root=zoo_root)


@pytest.fixture(scope="session")
def ours(ckpt):
    return load_diffusion_gemma(ckpt)


@pytest.fixture(scope="session")
def ref(ckpt):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(ckpt), strict=True)
    return model


def _equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def _caches_equal(ca, cb):
    assert len(ca) == len(cb)
    for a, b in zip(ca, cb):
        assert type(a).__name__ == type(b).__name__
        assert a.offset == b.offset
        from mlx_vlm.models.diffusion_gemma.language import _cache_state

        ka, va = cache_state(a)
        kb, vb = _cache_state(b)  # the oracle's own reader
        assert _equal(ka, kb) and _equal(va, vb)


def test_checkpoint_is_hf_layout(ckpt):
    names = set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.decoder.layers.0.experts.gate_up_proj" in names  # fused, no ".weight"
    assert "model.decoder.layers.1.experts.down_proj" in names
    assert "model.encoder.language_model.layers.1.layer_scalar" in names
    assert "lm_head.weight" not in names
    assert not any(n.startswith("model.encoder.language_model.") and not n.endswith("layer_scalar") for n in names)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["text_config"]["model_type"] == "diffusion_gemma_text"


def test_structure(ours):
    tc = ours.config.text_config
    assert tc.layer_types == ["sliding_attention", "full_attention"]
    sliding, full = ours.layers
    assert "v_proj" in sliding.self_attn and "v_proj" not in full.self_attn  # K reused as V
    assert (sliding.self_attn.head_dim, full.self_attn.head_dim) == (16, 32)
    assert (sliding.self_attn.n_kv_heads, full.self_attn.n_kv_heads) == (2, 1)
    assert ours.config.canvas_length == 16 and tc.num_experts == 4 and tc.top_k_experts == 2
    # the encoder's layer scalars are its own, and differ from the decoder's
    enc = [s.layer_scalar for s in ours.model.encoder.language_model.layers]
    dec = [layer.layer_scalar for layer in ours.layers]
    assert all(not mx.array_equal(e, d).item() for e, d in zip(enc, dec))


def test_parameters_equal_mlx_vlm(ours, ref):
    from mlx.utils import tree_flatten

    mine = dict(tree_flatten(ours.parameters()))
    theirs = dict(tree_flatten(ref.parameters()))
    assert set(mine) == set(theirs)
    assert all(_equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["in-window", "past-window"])
def test_encoder_forward_bit_exact(ours, ref, prompt):
    ids = mx.array([prompt])
    h_ours, c_ours = ours.encode(ids, ours.make_cache())
    h_ref, c_ref = ref.model.encoder(ids, cache=ref.make_cache())
    assert _equal(h_ours, h_ref)
    _caches_equal(c_ours, c_ref)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["in-window", "past-window"])
def test_decoder_forward_bit_exact(ours, ref, prompt):
    """Three blocks: decoder logits with and without self-conditioning, then the canvas fed
    back through the encoder; the encoder cache is read, never written, by the decoder."""
    ids = mx.array([prompt])
    c_ours = ours.diffusion_prefill_cache(ids, cache=ours.make_cache())
    c_ref = ref.diffusion_prefill_cache(ids, cache=ref.make_cache())
    keys = mx.random.split(mx.random.key(7), 3)
    for block, length in enumerate((16, 16, 5)):
        canvas = mx.random.randint(0, 512, (1, length), key=keys[block])
        offsets = [c.offset for c in c_ours]
        m_ours = ours.diffusion_decoder_masks(canvas, c_ours)
        m_ref = ref.diffusion_decoder_masks(canvas, c_ref, None)
        assert m_ours.keys() == m_ref.keys()
        for kind in m_ours:
            assert (m_ours[kind] is None) == (m_ref[kind] is None)
            if m_ours[kind] is not None:
                assert _equal(m_ours[kind], m_ref[kind])
        l_ours = ours.diffusion_decoder_logits(canvas, cache=c_ours, decoder_attention_mask=m_ours)
        l_ref = ref.diffusion_decoder_logits(canvas, cache=c_ref, decoder_attention_mask=m_ref)
        assert l_ours.dtype == mx.float32 and _equal(l_ours, l_ref)
        sc_ours = ours.diffusion_self_conditioning(l_ours / 0.5, ours.diffusion_prepare_self_conditioning())
        sc_ref = ref.diffusion_self_conditioning(l_ref / 0.5, ref.diffusion_prepare_self_conditioning())
        assert _equal(sc_ours, sc_ref)
        l2_ours = ours.diffusion_decoder_logits(canvas, cache=c_ours, self_conditioning=sc_ours,
                                                decoder_attention_mask=m_ours)
        l2_ref = ref.diffusion_decoder_logits(canvas, cache=c_ref, self_conditioning=sc_ref,
                                              decoder_attention_mask=m_ref)
        assert _equal(l2_ours, l2_ref)
        assert not mx.array_equal(l_ours, l2_ours).item()  # self-conditioning changes the logits
        assert [c.offset for c in c_ours] == offsets  # the decoder wrote nothing
        fed = mx.argmax(l2_ours, axis=-1)
        c_ours = ours.diffusion_update_cache(fed, cache=c_ours)
        c_ref = ref.diffusion_update_cache(fed, cache=c_ref)
        _caches_equal(c_ours, c_ref)
    # a one-token canvas takes the rotating cache's in-place path
    one = mx.array([[17]])
    c_ours = ours.diffusion_update_cache(one, cache=c_ours)
    c_ref = ref.diffusion_update_cache(one, cache=c_ref)
    _caches_equal(c_ours, c_ref)
    for canvas in (mx.array([[5, 6, 7, 8]]), mx.arange(40)[None] * 7):  # 40 tokens: sorted experts
        assert _equal(ours.diffusion_decoder_logits(canvas, cache=c_ours),
                      ref.diffusion_decoder_logits(canvas, cache=c_ref))


def test_chunked_prefill_bit_exact(ours, ref):
    ids = mx.array([LONG_PROMPT])
    c_ours = ours.diffusion_prefill_cache(ids, cache=ours.make_cache(), prefill_step_size=10, chunk_prefill=True)
    c_ref = ref.diffusion_prefill_cache(ids, cache=ref.make_cache(), prefill_step_size=10, chunk_prefill=True,
                                        attention_mask=None, pixel_values=None, mm_token_type_ids=None)
    _caches_equal(c_ours, c_ref)


def test_call_equals_mlx_vlm_call(ours, ref):
    ids = mx.array([PROMPT])
    canvas = mx.array([list(range(100, 116))])
    assert _equal(ours(ids, canvas_ids=canvas), ref(ids, canvas_ids=canvas).logits)
    # no canvas: both draw it with the same randint call
    mx.random.seed(5)
    a = ours(ids)
    mx.random.seed(5)
    b = ref(ids).logits
    assert _equal(a, b)


def test_engine_surface_refuses_what_is_not_ported(ours):
    ids = mx.array([PROMPT])
    with pytest.raises(UnsupportedModelError, match="pixel_values"):
        ours.diffusion_prefill_cache(ids, cache=ours.make_cache(), pixel_values=mx.zeros((1, 3, 8, 8)))
    with pytest.raises(UnsupportedModelError, match="decoder_attention_mask"):
        ours.diffusion_decoder_masks(ids, ours.make_cache(), mx.ones((1, 12), dtype=mx.bool_))


def test_zoo_is_deterministic(tmp_path):
    a = make_diffusion_checkpoint(tmp_path / "a", seed=3)
    b = make_diffusion_checkpoint(tmp_path / "b", seed=3)
    c = make_diffusion_checkpoint(tmp_path / "c", seed=4)
    shard = "model-00001-of-00002.safetensors"
    assert (a / shard).read_bytes() == (b / shard).read_bytes()
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
    assert a.name == "tiny-diffusion_gemma-s3"


# ----------------------------------------------------------------------------- bad inputs


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_shards(path, fn):
    """Apply fn(dict of all tensors) and write them back as one model.safetensors."""
    from mlxbun.weights import read_index

    index = read_index(path)
    tensors = index.load()
    fn(tensors)
    for f in index.files:
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), tensors)


def test_wrong_model_type_refused(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    _edit_config(path, lambda c: c.update(model_type="gemma4"))
    with pytest.raises(UnsupportedModelError, match=r"model_type is 'gemma4'.*diffusion_gemma"):
        load_diffusion_gemma(path)
    _edit_config(path, lambda c: (c.update(model_type="diffusion_gemma"),
                                  c["text_config"].update(model_type="gemma4_text")))
    with pytest.raises(UnsupportedModelError, match=r"text_config.model_type is 'gemma4_text'"):
        load_diffusion_gemma(path)


@pytest.mark.parametrize("edit, err, match", [
    (lambda c: c.update(canvas_length=0), ConfigError, "canvas_length"),
    (lambda c: c["text_config"].update(top_k_experts=9), ConfigError, "top_k_experts"),
    (lambda c: c["text_config"].update(layer_types=["sliding_attention"]), ConfigError, "layer_types"),
    (lambda c: c["text_config"].update(hidden_activation="silu"), UnsupportedModelError, "hidden_activation"),
    (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     UnsupportedModelError, "rope"),
])
def test_bad_config_refused(ckpt, tmp_path, edit, err, match):
    path = _copy(ckpt, tmp_path)
    _edit_config(path, edit)
    with pytest.raises(err, match=match):
        load_diffusion_gemma(path)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_diffusion_gemma(tmp_path)


def test_missing_tensor_named(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    _rewrite_shards(path, lambda t: t.pop("model.decoder.layers.1.experts.down_proj"))
    with pytest.raises(LoadError, match=r"model\.decoder\.layers\.1\.experts\.down_proj"):
        load_diffusion_gemma(path)


def test_missing_encoder_scalar_named(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    _rewrite_shards(path, lambda t: t.pop("model.encoder.language_model.layers.0.layer_scalar"))
    with pytest.raises(LoadError, match=r"model\.encoder\.language_model\.layers\.0\.layer_scalar"):
        load_diffusion_gemma(path)


def test_unconsumed_and_misshapen_tensors_named(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    _rewrite_shards(path, lambda t: t.update({"model.decoder.mystery.weight": mx.zeros((2,))}))
    with pytest.raises(LoadError, match=r"model\.decoder\.mystery\.weight"):
        load_diffusion_gemma(path)
    path2 = tmp_path / "second"
    shutil.copytree(ckpt, path2)
    _rewrite_shards(path2, lambda t: t.update({"model.decoder.norm.weight": mx.ones((8,))}))
    with pytest.raises(LoadError, match=r"model\.decoder\.norm\.weight"):
        load_diffusion_gemma(path2)


def test_drop_rules_and_mlx_layout(ckpt, tmp_path, ours):
    """Vision tower, tied encoder copies and lm_head are dropped with their reasons; the
    mlx-converted expert names (".weight") load too, to the same graph."""
    path = _copy(ckpt, tmp_path)

    def edit(t):
        t["model.encoder.vision_tower.patch_embedder.input_proj.weight"] = mx.zeros((4, 4))
        t["model.encoder.language_model.layers.0.mlp.gate_proj.weight"] = t["model.decoder.layers.0.mlp.gate_proj.weight"]
        t["lm_head.weight"] = t["model.decoder.embed_tokens.weight"]
        t["model.decoder.layers.0.experts.gate_up_proj.weight"] = t.pop("model.decoder.layers.0.experts.gate_up_proj")

    _rewrite_shards(path, edit)
    from mlxbun.models.diffusion_gemma.loader import drop_rules
    from mlxbun.weights import read_index

    names = list(read_index(path).tensors)
    reasons = {n: next((r.reason for r in drop_rules() if r.matches(n)), None) for n in names}
    assert "vision" in reasons["model.encoder.vision_tower.patch_embedder.input_proj.weight"]
    assert "tied" in reasons["model.encoder.language_model.layers.0.mlp.gate_proj.weight"]
    assert "tied" in reasons["lm_head.weight"]
    assert reasons["model.encoder.language_model.layers.0.layer_scalar"] is None  # consumed
    loaded = load_diffusion_gemma(path)
    ids = mx.array([PROMPT])
    canvas = mx.array([list(range(16))])
    assert _equal(loaded(ids, canvas_ids=canvas), ours(ids, canvas_ids=canvas))


def test_quantized_refused(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    _rewrite_shards(path, lambda t: t.update({"model.decoder.layers.0.mlp.gate_proj.scales": mx.ones((2,))}))
    with pytest.raises(UnsupportedModelError, match=r"quantized.*gate_proj\.scales"):
        load_diffusion_gemma(path)


def test_config_from_dict_defaults():
    """mlx-vlm's defaults: 5 sliding : 1 full with the last forced full; proportional rope on
    full layers; every error is an MlxbunError."""
    cfg = tiny_diffusion_config()
    for k in ("layer_types", "rope_parameters"):
        del cfg["text_config"][k]
    cfg["text_config"]["num_hidden_layers"] = 8
    c = config_from_dict(cfg)
    assert c.text_config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention", "full_attention"]
    assert c.text_config.rope_parameters["full_attention"]["rope_type"] == "proportional"
    model = DiffusionGemmaModel(c)
    assert len(model.layers) == 8
    with pytest.raises(MlxbunError):
        config_from_dict({"model_type": "diffusion_gemma", "text_config": [1]})
