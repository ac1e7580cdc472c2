"""kimi_vl's vision side held bit-exact to mlx-vlm 0.7.10, run live on the zoo's tiny
`kimi_vl-vision` (MoonViT over deepseek_v3's MLA / MoE text model, as mlx-vlm's own kimi_vl
builds it): the processor's patches and grids, the spliced ids, MoonViT stage by stage, the
projector, the merged rows, the prompt's logits through mlx-vlm's text model and greedy generation,
in the variants this CPU runs (unquantized float16 / bfloat16 experts do not: gather_mm)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.experiments.tower_bringup_kimi import oracle_moonvit_stages
from mlxbun.multimodal import open_vlm, stream_generate
from mlxbun.towers.errors import ImageCountError, MediaError
from tests.tower_oracle import load_both

ARCH = "kimi_vl-vision"
PROMPT = "hi <|media_pad|> and <|media_pad|> there"
VARIANTS = [("float32", None), ("float32", 4), ("bfloat16", 8), ("float32", "mixed")]


@pytest.fixture(scope="session")
def kimi_images(run_tmp) -> list[str]:
    """A 56x56 RGB image (the 4x4 position table's own grid), a 90x37 grayscale one (cropped to
    84x28: a 2x6 grid, the table resized) and a 920x910 one (past 4096 patches: scaled down)."""
    from PIL import Image

    out = []
    for name, (w, h), mode in (("kimi-square.png", (56, 56), "RGB"), ("kimi-wide.png", (90, 37), "L"),
                               ("kimi-large.png", (920, 910), "RGB")):
        f = run_tmp / name
        if not f.exists():
            y, x = np.mgrid[0:h, 0:w]
            planes = [(x * 3 + y * 5) % 256, (x * 7 + y) % 256, (x + y * 11) % 256]
            a = np.stack(planes, axis=-1) if mode == "RGB" else planes[0]
            Image.fromarray(a.astype(np.uint8), mode=mode).save(f)
        out.append(str(f))
    return out


def _ckpt(zoo_root, dtype="float32", quant=None) -> Path:
    from mlxbun.zoo.towers import cached_tower_checkpoint

    return cached_tower_checkpoint(ARCH, dtype=dtype, quant=quant, root=zoo_root)


def _oracle_inputs(processor, images, prompt):
    from mlx_vlm.utils import prepare_inputs

    return prepare_inputs(processor, images=list(images), prompts=[prompt], add_special_tokens=True)


@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_kimi_vl_tower_projector_splice_merge_and_logits_are_bit_exact(zoo_root, kimi_images, dtype, quant):
    """Two images: one at the position table's own grid, one whose table is resized; each image
    attending within itself; 2x2 windows per soft token."""
    vlm, model, processor = load_both(_ckpt(zoo_root, dtype, quant))
    pair = kimi_images[:2]
    ref = _oracle_inputs(processor, pair, PROMPT)
    ours = vlm.prepare(PROMPT, pair)
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.grid.tolist() == ref["image_grid_hws"].tolist() == [[4, 4], [2, 6]]
    assert ours.soft_tokens == int((ref["input_ids"] == model.config.media_placeholder_token_id).sum()) == 4 + 3
    grid = ref["image_grid_hws"]
    theirs = oracle_moonvit_stages(model, ref["pixel_values"], grid)
    mine = vlm.vision.blocks(ours.pixel_values, None, ours.grid)
    assert [n for n, _ in mine] == ["embeddings", "layers.0", "layers.1", "post_layernorm", "merged", "projector"]
    for (name, a), b in zip(mine, theirs):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"first mismatch at {name}"
    whole = model.vision_tower(ref["pixel_values"].transpose(0, 2, 3, 1), grid)
    assert mx.array_equal(mine[-2][1], mx.concatenate(whole, axis=0))
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], image_grid_hws=grid)
    assert mx.array_equal(ours.embeddings, merged.inputs_embeds)
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds).logits
    assert mx.array_equal(vlm.logits(ours), logits)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 8)], ids=["float32", "bf16-q8"])
def test_kimi_vl_greedy_generation_is_bit_exact_vs_mlx_vlm(zoo_root, kimi_images, dtype, quant):
    from mlx_vlm.generate.ar import generate_step

    vlm, model, processor = load_both(_ckpt(zoo_root, dtype, quant))
    pair = kimi_images[:2]
    ref = _oracle_inputs(processor, pair, PROMPT)
    theirs = list(generate_step(ref["input_ids"], model, ref["pixel_values"], ref["attention_mask"], max_tokens=8,
                                temperature=0.0, image_grid_hws=ref["image_grid_hws"]))
    ours = [(r.token, r.logprobs) for r in stream_generate(vlm, vlm.prepare(PROMPT, pair), max_tokens=8)]
    assert len(ours) >= 3 and [t for t, _ in ours] == [t for t, _ in theirs[:len(ours)]]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(ours, theirs))


def test_kimi_vl_processor_scales_a_large_image_down_and_prompts_without_placeholders(zoo_root, kimi_images):
    """Past in_token_limit (4096 patches) the processor shrinks the image bicubically before the crop."""
    from PIL import Image

    from mlxbun.towers.images import preprocess_kimi

    vlm, _, processor = load_both(_ckpt(zoo_root))
    big = Image.open(kimi_images[2]).convert("RGB")
    want = processor.image_processor([big])
    pixels = preprocess_kimi([big], vlm.vision.processor)
    assert np.array_equal(np.array(want["pixel_values"]), pixels.values)
    assert pixels.grid.tolist() == want["image_grid_hws"].tolist() and int(np.prod(pixels.grid)) <= 4096
    # a prompt without placeholders: the chat template's media item per image in front
    ours = vlm.prepare("what is this", kimi_images[:1])
    ref = _oracle_inputs(processor, kimi_images[:1], "<|media_start|>image<|media_content|><|media_pad|>"
                                                     "<|media_end|>what is this")
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()


def test_kimi_vl_one_expert_group_and_no_rope_scaling_as_mlx_vlm(zoo_root, kimi_images, tmp_path):
    """n_group 1 (the hub Kimi-VL-A3B's), where mlx-vlm's kimi_vl picks the top k by
    argsort, its order the order the experts are summed in (three a token here: mlx-lm's
    argpartition order sums them differently, 7e-7 apart in these logits); no rope scaling (a
    traditional rope, not deepseek's yarn)."""
    from mlx_vlm.utils import load

    dst = tmp_path / "one-group"
    shutil.copytree(_ckpt(zoo_root), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"].update(n_group=1, topk_group=1, num_experts_per_tok=3, rope_scaling=None)
    cfg["text_config"].pop("rope_parameters")
    (dst / "config.json").write_text(json.dumps(cfg))
    vlm, (model, processor) = open_vlm(dst), load(str(dst))
    ref = _oracle_inputs(processor, kimi_images[:1], "<|media_pad|> x")
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], image_grid_hws=ref["image_grid_hws"])
    ours = vlm.prepare("<|media_pad|> x", kimi_images[:1])
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds).logits
    assert mx.array_equal(vlm.logits(ours), logits)


def test_kimi_vl_refusals(zoo_root, kimi_images, tmp_path):
    from PIL import Image

    vlm, _, _ = load_both(_ckpt(zoo_root))
    tiny = tmp_path / "tiny.png"
    Image.new("RGB", (20, 60)).save(tiny)
    with pytest.raises(MediaError, match="smaller than one 28x28 merge window"):
        vlm.prepare("<|media_pad|>", [tiny])
    with pytest.raises(ImageCountError, match="2 image placeholder"):
        vlm.prepare("<|media_pad|> <|media_pad|>", kimi_images[:1])


def _hf_tower_name(name: str) -> str:
    """A tower tensor's name as the hub's Kimi-VL writes it (vision_tower.encoder.blocks.i.wqkv, ...)."""
    for part in ("blocks.", "final_layernorm."):
        name = name.replace(f"vision_tower.{part}", f"vision_tower.encoder.{part}")
    return name.replace(".attn.", ".")


def test_kimi_vl_loads_the_hub_tower_layout(zoo_root, kimi_images, tmp_path):
    """HF's names (vision_tower.encoder.*, bare wqkv / wo) and PyTorch's conv layout load as mlx-vlm's
    sanitize moves them; HF's head count disagreeing with mlx-vlm's num_heads is refused."""
    from mlxbun.errors import ConfigError
    from mlxbun.towers.loader import open_vision

    src, dst = _ckpt(zoo_root), tmp_path / "hub"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        w = mx.load(str(dst / shard))
        conv = "vision_tower.patch_embed.proj.weight"
        if conv in w:
            w[conv] = w[conv].transpose(0, 3, 1, 2)
        mx.save_safetensors(str(dst / shard), {_hf_tower_name(k): v for k, v in w.items()}, metadata={"format": "mlx"})
    index["weight_map"] = {_hf_tower_name(k): v for k, v in index["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in index["weight_map"]
    pixels = mx.array(np.random.default_rng(0).standard_normal((16, 3, 14, 14)).astype(np.float32))
    assert mx.array_equal(open_vision(dst).features(pixels, None, [[4, 4]]),
                          load_both(src)[0].vision.features(pixels, None, [[4, 4]]))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vision_config"]["num_attention_heads"] = 4
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_attention_heads 4 but num_heads 2"):
        open_vision(dst)


def test_cli_generates_from_kimi_vl_images(zoo_root, kimi_images, capsys):
    path = _ckpt(zoo_root)
    code = cli.main(["generate", "--model", str(path), "--image", kimi_images[0], "--image", kimi_images[1],
                     "--prompt", PROMPT, "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    vlm, _, _ = load_both(path)
    prompt = vlm.prepare(PROMPT, kimi_images[:2])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == 7 and out["images"] == 2
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]
