"""gemma3n's vision tower (MobileNetV5, mlxbun.towers.mobilenet5) and its images held bit-exact to
mlx-vlm 0.7.10, run live: the processor's pixels, the spliced ids and soft-token counts, the tower
block by block, the soft tokens, the merged rows, the prompt's logits and greedy generation
(tokens and log-probabilities vs mlx-vlm's generate_step), images and audio in one prompt, the
refusals, `generate --image`.

The oracle is mlx-vlm's code with a shorter stage list. mlx-vlm hard-codes MobileNetV5's ~300M
layout, so its model is built and loaded under mlxbun.zoo.mobilenet.mobilenet_layout(TINY_LAYOUT),
which patches exactly two things for the duration: mlx_vlm.models.gemma3n.vision.gemma3n_mobilenet_def
(returning the tiny stage list as mlx-vlm's own EdgeResidualConfig /
UniversalInvertedResidualConfig / MultiQueryAttentionBlockConfig) and VisionTower.__init__ (mlx-vlm's
own ConvNormAct stem and MobileNetV5MultiScaleFusionAdapter, built at an 8-channel stem and a
56 -> 32 MSFA pooled to 2 x 2 in place of 64 and 1920 -> 2048 at 16 x 16). VisionTower.build,
every block class and every forward are mlx-vlm's, unpatched. The zoo's gemma3n-towers checkpoint
carries that tower (and gemma3n-audio's audio tower). The full default layout is compared with
mlx-vlm's by parameter names and shapes (no forward)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.multimodal import MAX_IMAGES, open_vlm, refuse_images, stream_generate
from mlxbun.towers.errors import ImageCountError, NoTowerError, TooManyImages
from mlxbun.towers.mobilenet5 import FULL_LAYOUT, MobileNetLayout, MobileNetV5
from mlxbun.zoo.mobilenet import TINY_LAYOUT, mobilenet_patch, vlm_stages
from tests.audio_oracle import prompt_logits_equal, samples_of, write_wav
from tests.conftest import assert_broken_images_refused

ARCH = "gemma3n-towers"
IMAGE = "<image_soft_token>"
AUDIO = "<audio_soft_token>"
PROMPT = f"hi {IMAGE} and {IMAGE} there"
# the tower in the checkpoint's dtype (mlx_vlm.convert never quantizes it); the text weights float
# or quantized
VARIANTS = [("float32", None), ("float16", None), ("bfloat16", None), ("float32", 4), ("bfloat16", 8),
            ("float32", "mixed")]


@pytest.fixture(scope="session")
def pictures(images) -> list[str]:
    """matplotlib's JPEG photo and a drawn grayscale, non-square PNG (test_towers' images)."""
    return [images[0], images[2]]


@pytest.fixture(scope="session")
def clip(run_tmp) -> Path:
    t = np.arange(9000) / 16_000
    return write_wav(run_tmp / "gemma3n-vision-sine.wav", 0.3 * np.sin(2 * np.pi * 440 * t))


_LOADED: dict = {}


def _both(path: Path):
    """(mlxbun's Gemma3nImageModel, mlx-vlm's model, processor), loaded once per checkpoint; mlx-vlm's
    under the tiny layout's patch (module docstring)."""
    if path not in _LOADED:
        from mlx_vlm.utils import load

        with mobilenet_patch(json.loads((path / "config.json").read_text())):
            model, processor = load(str(path))
        _LOADED[path] = (open_vlm(path), model, processor)
    return _LOADED[path]


def _oracle_inputs(processor, images, prompt=PROMPT, clips=()):
    from mlx_vlm.utils import prepare_inputs

    return prepare_inputs(processor, images=list(images) or None, audio=[samples_of(c) for c in clips] or None,
                          prompts=[prompt], add_special_tokens=True)


def test_the_full_layout_is_mlx_vlms():
    """mlxbun's default layout is gemma3n_mobilenet_def() block for block, and the tower it builds has
    mlx-vlm's parameter names and shapes (both built lazily: nothing evaluated)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models.gemma3n import vision as v
    from mlx_vlm.models.gemma3n.config import VisionConfig

    assert vlm_stages(FULL_LAYOUT) == v.gemma3n_mobilenet_def()
    assert (FULL_LAYOUT.msfa_in, FULL_LAYOUT.msfa_out, FULL_LAYOUT.tokens) == (1920, 2048, 256)
    theirs = {k: p.shape for k, p in tree_flatten(v.VisionTower(VisionConfig()).parameters())}
    ours = {k: p.shape for k, p in tree_flatten(MobileNetV5().parameters())}
    assert ours == theirs and len(ours) == 548
    assert MobileNetLayout.from_config(TINY_LAYOUT.as_config()) == TINY_LAYOUT
    FULL_LAYOUT.check_image(768, 768)  # the hub processor's size: 48 x 48 maps pooled 3 x 3
    with pytest.raises(UnsupportedModelError, match="multiple of it"):
        FULL_LAYOUT.check_image(256, 256)  # 16 x 16 maps: mlx-vlm's equal-size path
    with pytest.raises(UnsupportedModelError, match="multiple of it"):
        FULL_LAYOUT.check_image(720, 720)  # 45 x 45: its bicubic path


@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_mobilenet_tower_splice_merge_and_logits_are_bit_exact(tower_ckpt, pictures, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, ARCH))
    ref = _oracle_inputs(processor, pictures)
    ours = vlm.prepare(PROMPT, pictures)
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.soft_tokens == int((ref["input_ids"] == model.config.image_token_id).sum().item()) == 2 * 4
    # the tower block by block (mlx-vlm's modules in its VisionTower.__call__'s order), then the MSFA
    tm = model.vision_tower.timm_model
    x = tm.conv_stem(ref["pixel_values"].transpose(0, 2, 3, 1))
    theirs, fused = [], []
    for i, group in enumerate(tm.blocks, start=1):
        for block in group:
            theirs.append(x := block(x))
        if i in tm.msfa_indices:
            fused.append(x)
    taps: list = []
    out = vlm.vision.tower(ours.pixel_values, taps)
    assert len(taps) == len(theirs) == sum(len(s) for s in TINY_LAYOUT.stages)
    for i, (a, b) in enumerate(zip(taps, theirs)):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"MobileNetV5 block {i} differs"
    assert mx.array_equal(out, tm.msfa(fused)) and mx.array_equal(out, model.vision_tower(ref["pixel_values"]))
    # the soft tokens (get_image_features), the merged rows, the prompt's logits
    want = model.get_image_features(ref["pixel_values"], model.vision_tower, model.config, model.embed_vision)
    assert mx.array_equal(ours.features, want)
    emb = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"])
    assert mx.array_equal(ours.embeddings, emb.inputs_embeds)
    prompt_logits_equal(vlm, model, ref, emb, ours)


def _greedy_equal(vlm, model, ref, prompt, images, clips=(), steps=6):
    from mlx_vlm.generate.ar import generate_step

    audio = {k: ref[k] for k in ("input_features", "input_features_mask")} if clips else {}
    theirs = list(generate_step(ref["input_ids"], model, ref["pixel_values"], ref["attention_mask"], max_tokens=steps,
                                temperature=0.0, **audio))
    media = vlm.prepare(prompt, images, clips=clips)
    ours = [(r.token, r.logprobs) for r in stream_generate(vlm, media, max_tokens=steps)]
    assert len(ours) >= 3 and [t for t, _ in ours] == [t for t, _ in theirs[:len(ours)]]
    for (_, a), (_, b) in zip(ours, theirs):
        assert mx.array_equal(a, b)
    return media


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 8)], ids=["float32", "bf16-q8"])
def test_greedy_generation_with_images_is_bit_exact(tower_ckpt, pictures, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, ARCH))
    _greedy_equal(vlm, model, _oracle_inputs(processor, pictures), PROMPT, pictures)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None)], ids=["float32", "bfloat16"])
def test_images_and_audio_in_one_prompt_are_bit_exact(tower_ckpt, pictures, clip, dtype, quant):
    """One image and one clip: mlx-vlm's processor expands both, its get_input_embeddings lays the
    image's soft tokens and the clip's over their tokens; generation from there."""
    vlm, model, processor = _both(tower_ckpt(dtype, quant, ARCH))
    prompt = f"{AUDIO} then {IMAGE} what"
    ref = _oracle_inputs(processor, pictures[:1], prompt, [clip])
    ours = vlm.prepare(prompt, pictures[:1], clips=[clip])
    assert ours.ids.tolist() == ref["input_ids"][0].tolist() and ours.n_images == 1 and ours.n_clips == 1
    assert ours.soft_tokens == 4 + 8
    emb = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], input_features=ref["input_features"],
                                     input_features_mask=ref["input_features_mask"])
    assert mx.array_equal(ours.embeddings, emb.inputs_embeds)
    prompt_logits_equal(vlm, model, ref, emb, ours)
    _greedy_equal(vlm, model, ref, prompt, pictures[:1], [clip], steps=4)


def test_a_prompt_without_placeholders_takes_the_images_first(tower_ckpt, pictures):
    vlm, _, processor = _both(tower_ckpt("float32", None, ARCH))
    ours = vlm.prepare("what is this", pictures[1:])
    ref = _oracle_inputs(processor, pictures[1:], f"{IMAGE}what is this")
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.pixel_values, ref["pixel_values"])


def test_pytorch_layout_conv_weights_load_as_mlx_vlm_sanitizes_them(tower_ckpt, tmp_path):
    """A checkpoint whose tower convs are in PyTorch's [out, in, kH, kW] (the hub's): moved to mlx's
    as mlx-vlm's VisionModel.sanitize does, the tower the same as from the mlx-layout file."""
    from mlx.utils import tree_flatten

    from mlxbun.towers.gemma3n_vision import open_gemma3n_vision

    src = tower_ckpt("float32", None, ARCH)
    dst = tmp_path / "torch-layout"
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        w = {k: v.transpose(0, 3, 1, 2) if "vision_tower" in k and v.ndim == 4 else v
             for k, v in mx.load(str(shard)).items()}
        mx.save_safetensors(str(shard), w, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    want = dict(tree_flatten(open_gemma3n_vision(src, config).tower.parameters()))
    got = dict(tree_flatten(open_gemma3n_vision(dst, config).tower.parameters()))
    assert want.keys() == got.keys() and all(mx.array_equal(want[k], got[k]) for k in want)


# ------------------------------------------------------------------ bad input: one named error each


def test_bad_images_and_checkpoints_are_refused_by_name(tower_ckpt, pictures, zoo, tmp_path, monkeypatch):
    vlm, _, _ = _both(tower_ckpt("float32", None, ARCH))

    def no_tower(*a, **k):
        raise AssertionError("the tower ran")

    monkeypatch.setattr(type(vlm.vision), "soft_tokens", no_tower)
    assert_broken_images_refused(lambda path: vlm.prepare(IMAGE, [path]), pictures[0], tmp_path)
    with pytest.raises(ImageCountError, match="2 image placeholder"):
        vlm.prepare(PROMPT, pictures[:1])
    with pytest.raises(TooManyImages, match=f"at most {MAX_IMAGES}"):
        vlm.prepare("x", [tmp_path / "missing.png"] * (MAX_IMAGES + 1))  # before any file is read
    monkeypatch.undo()
    # checkpoints without a vision tower mlxbun builds
    with pytest.raises(NoTowerError, match="holds no vision_tower"):
        refuse_images(tower_ckpt("float32", None, "gemma3n-audio"))
    with pytest.raises(NoTowerError, match="no gemma3n_vision vision_config"):  # the text zoo's gemma3n
        refuse_images(zoo("gemma3n"))
    # numbers the processor, tower and merge must agree on
    src = tower_ckpt("float32", None, ARCH)
    for name, edit, message in (
            ("processor_config.json", lambda c: c.update(image_seq_length=9), "image_seq_length 9"),
            ("preprocessor_config.json", lambda c: c.update(size={"height": 32, "width": 32}), "multiple of it"),
            ("config.json", lambda c: c["vision_config"].update(hidden_size=64), "hidden_size is 64"),
            ("config.json", lambda c: c["vision_config"].pop("mobilenet_layout"), "mlxbun_zoo_tiny_mobilenetv5")):
        dst = tmp_path / name.replace(".", "-") / message.replace(" ", "-")
        shutil.copytree(src, dst)
        cfg = json.loads((dst / name).read_text())
        edit(cfg)
        (dst / name).write_text(json.dumps(cfg))
        with pytest.raises((ConfigError, UnsupportedModelError), match=message):
            open_vlm(dst)


# ------------------------------------------------------------------ the CLI


def test_cli_generates_from_gemma3n_images_and_audio(tower_ckpt, pictures, clip, capsys):
    path = tower_ckpt("float32", None, ARCH)
    vlm, _, _ = _both(path)
    code = cli.main(["generate", "--model", str(path), "--image", pictures[0], "--image", pictures[1],
                     "--prompt", PROMPT, "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    prompt = vlm.prepare(PROMPT, pictures)
    assert code == 0 and out["images"] == 2 and out["soft_tokens"] == 8 and out["prompt_ids"] == prompt.ids.tolist()
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]
    both = f"{IMAGE} {AUDIO} what"
    code = cli.main(["generate", "--model", str(path), "--image", pictures[0], "--audio", str(clip),
                     "--prompt", both, "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    prompt = vlm.prepare(both, pictures[:1], clips=[clip])
    assert code == 0 and out["images"] == 1 and out["audio_clips"] == 1 and out["soft_tokens"] == 12
    assert out["prompt_ids"] == prompt.ids.tolist()
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]
