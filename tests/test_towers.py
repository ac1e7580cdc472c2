"""Vision towers held bit-exact to mlx-vlm 0.7.10, run live: the tower block by block, the
projector, the processor's pixels, the spliced ids and soft-token counts, the merged rows, and
greedy generation (tokens, log-probabilities and per-step raw logits) on tiny zoo checkpoints that
carry their towers (mlxbun.zoo.towers), in every dtype / quantization mlx-vlm runs. Test images:
matplotlib's sample data and images drawn here."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.multimodal import MAX_IMAGES, EmbeddedPrompt, open_vlm, stream_generate
from mlxbun.errors import GenerationError, UnsupportedModelError
from mlxbun.experiments.tower_bringup import oracle_stages, patch_order
from mlxbun.towers.knobs import VitLayout
from mlxbun.towers.errors import ImageCountError, ImageUnreadable, NoTowerError, TooManyImages
from tests.conftest import assert_broken_images_refused
from tests.tower_oracle import load_both, qwen_text_side_equal, qwen_tower_equal

# (dtype, quant): every variant mlx_vlm.convert writes for the tiny checkpoint (towers in the dtype)
VARIANTS = [("float32", None), ("float16", None), ("bfloat16", None), ("float32", 4), ("bfloat16", 8),
            ("float32", "mixed")]
PROMPT = "hi <start_of_image> and <start_of_image> there"
PIXTRAL_PROMPT = "hi [IMG] and [IMG] there"
QWEN_PROMPT = "hi <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|> there"


_both = load_both  # (mlxbun's VisionLanguageModel, mlx-vlm's model, processor), loaded once per checkpoint


def _greedy_equal(vlm, model, ref, prompt, images, steps: int, **oracle_kwargs):
    """mlx-vlm's generate_step and mlxbun's stream_generate, greedy, on the same prompt and images:
    the same tokens (mlxbun stops at EOS, mlx-vlm does not) and bit-equal log-probabilities."""
    from mlx_vlm.generate.ar import generate_step

    theirs = list(generate_step(ref["input_ids"], model, ref["pixel_values"], ref["attention_mask"],
                                max_tokens=steps, temperature=0.0, **oracle_kwargs))
    media = vlm.prepare(prompt, images)
    ours = [(r.token, r.logprobs) for r in stream_generate(vlm, media, max_tokens=steps)]
    assert len(ours) >= 3 and [t for t, _ in ours] == [t for t, _ in theirs[:len(ours)]]
    for (_, a), (_, b) in zip(ours, theirs):
        assert mx.array_equal(a, b)
    return media, [t for t, _ in ours]


def _splice_equal(vlm, model, processor, images, prompt, token_id: int):
    """(mlx-vlm's processor inputs, mlxbun's prepared prompt): the same spliced ids and pixels,
    the soft-token count the image tokens in mlx-vlm's ids."""
    ref = _oracle_inputs(processor, images, prompt)
    ours = vlm.prepare(prompt, images)
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.soft_tokens == int((ref["input_ids"] == token_id).sum().item())
    return ref, ours


def _oracle_inputs(processor, images, prompt=PROMPT):
    from mlx_vlm.utils import prepare_inputs

    return prepare_inputs(processor, images=list(images), prompts=[prompt], add_special_tokens=True)


@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_tower_projector_splice_and_merge_are_bit_exact(tower_ckpt, images, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant))
    ref, ours = _splice_equal(vlm, model, processor, images[:2], PROMPT, model.config.image_token_index)
    assert ours.soft_tokens == 2 * vlm.vision.tokens_per_image
    # the tower, block by block (a mismatch names its first block), then the projector
    dtype = model.language_model.model.embed_tokens(ref["input_ids"]).dtype
    theirs = oracle_stages(model, VitLayout.SIGLIP, ref["pixel_values"], None, dtype)
    mine = vlm.vision.blocks(ours.pixel_values, dtype)
    assert [n for n, _ in mine] == ["embeddings", "layers.0", "layers.1", "post_layernorm", "projector"]
    for (name, a), b in zip(mine, theirs):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"first mismatch at {name}"
    assert mx.array_equal(ours.features, theirs[-1])
    # the merge into the text embeddings, and the prompt's logits through the text graph
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], mask=ref["attention_mask"])
    assert mx.array_equal(ours.embeddings, merged.inputs_embeds)
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds).logits
    assert mx.array_equal(vlm.logits(ours), logits)


QWEN_ARCHS = [("qwen2_vl-vision", False), ("qwen2_5_vl-vision", True), ("qwen3_vl-vision", False)]


# qwen3_vl_moe: the variants this CPU runs (mlx's gather_mm takes unquantized experts in float32 only)
MOE_VARIANTS = [("float32", None), ("float32", 4), ("bfloat16", 8), ("float32", "mixed")]
QWEN_CASES = ([(a, w, d, q) for a, w in QWEN_ARCHS for d, q in VARIANTS]
              + [("qwen3_vl_moe-vision", False, d, q) for d, q in MOE_VARIANTS])


@pytest.mark.parametrize("arch,windows,dtype,quant", QWEN_CASES, ids=[f"{a}-{d}-{q}" for a, _, d, q in QWEN_CASES])
def test_qwen_vl_tower_merger_splice_and_merge_are_bit_exact(tower_ckpt, images, dtype, quant, arch, windows):
    """Dynamic resolution: two images of different sizes (their grids, soft-token counts and
    patch sequences differ), the drawn grayscale one non-square; Qwen2.5-VL's window attention
    over several windows per image."""
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch=arch))
    ref, ours = _splice_equal(vlm, model, processor, [images[0], images[2]], QWEN_PROMPT, model.config.image_token_id)
    assert mx.array_equal(ours.grid, ref["image_grid_thw"])
    assert ours.grid.tolist()[0] != ours.grid.tolist()[1]
    assert ours.soft_tokens == sum(int(t * h * w) // 4 for t, h, w in ours.grid.tolist())
    grid = ref["image_grid_thw"]
    qwen_tower_equal(vlm, model, ours, ref["pixel_values"], grid, windows)
    # the merged rows, Qwen3-VL's deepstack rows (the mergers after the listed blocks), the mRoPE
    # positions (get_rope_index) and the prompt's logits through them
    qwen_text_side_equal(vlm, model, ours, ref, ref["pixel_values"], arch.startswith("qwen3"), image_grid_thw=grid)


GEN_CASES = ([(a, d, q) for a, _ in QWEN_ARCHS for d, q in (("float32", None), ("bfloat16", 4))]
             + [("qwen3_vl_moe-vision", "float32", None), ("qwen3_vl_moe-vision", "bfloat16", 8)])


@pytest.mark.parametrize("arch,dtype,quant", GEN_CASES, ids=[f"{a}-{d}-{q}" for a, d, q in GEN_CASES])
def test_qwen_vl_greedy_generation_is_bit_exact_vs_mlx_vlm(tower_ckpt, images, dtype, quant, arch):
    """Prefill at the prompt's mRoPE positions, decode at the cache offset + the position delta."""
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch=arch))
    # the tiny random models stop at EOS early on some inputs: a pair each that gives a trajectory
    pair = [images[0], images[2]] if arch == "qwen3_vl_moe-vision" else images[:2]
    ref = _oracle_inputs(processor, pair, QWEN_PROMPT)
    prompt, _ = _greedy_equal(vlm, model, ref, QWEN_PROMPT, pair, 10, image_grid_thw=ref["image_grid_thw"])
    with pytest.raises(GenerationError, match="plain KV caches"):
        stream_generate(vlm, prompt, max_tokens=2, kv_bits=4)


PIXTRAL_ARCHS = ["pixtral-vision", "mistral3-vision"]


@pytest.mark.parametrize("arch", PIXTRAL_ARCHS)
@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_pixtral_tower_projector_splice_merge_and_logits_are_bit_exact(tower_ckpt, images, dtype, quant, arch):
    """Two images of different sizes, the second zero-padded in the batch and cropped back by its
    size; [IMG] rows split by [IMG_BREAK], closed by [IMG_END]; the block-diagonal mask; mistral3:
    its RMSNorm + 2x2 patch-merging projector over each image's grid."""
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch=arch))
    ref, ours = _splice_equal(vlm, model, processor, [images[0], images[2]], PIXTRAL_PROMPT,
                              model.config.image_token_index)
    assert ours.grid.tolist() == np.array(ref["image_sizes"]).tolist() and ours.grid.tolist()[0] != ours.grid.tolist()[1]
    theirs = oracle_stages(model, VitLayout.PIXTRAL, ref["pixel_values"], ref["image_sizes"], None,
                           mistral3=arch == "mistral3-vision")
    mine = vlm.vision.blocks(ours.pixel_values, None, ours.grid)
    assert len(mine) == len(theirs) and mine[-1][0] == "projector"
    for (name, a), b in zip(mine, theirs):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"first mismatch at {name}"
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], image_sizes=ref["image_sizes"])
    assert mx.array_equal(ours.embeddings, merged.inputs_embeds)
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds).logits
    assert mx.array_equal(vlm.logits(ours), logits)
    # one image: mistral3's merger then sees a single image's (strided) windows
    ref1 = _oracle_inputs(processor, images[:1], "[IMG] x")
    one = model.get_input_embeddings(ref1["input_ids"], ref1["pixel_values"], image_sizes=ref1["image_sizes"])
    assert mx.array_equal(vlm.prepare("[IMG] x", images[:1]).embeddings, one.inputs_embeds)


@pytest.mark.parametrize("arch", PIXTRAL_ARCHS)
@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 4)], ids=["float32", "bfloat16-q4"])
def test_pixtral_greedy_generation_is_bit_exact_vs_mlx_vlm(tower_ckpt, images, dtype, quant, arch):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch=arch))
    ref = _oracle_inputs(processor, images[:2], PIXTRAL_PROMPT)
    _greedy_equal(vlm, model, ref, PIXTRAL_PROMPT, images[:2], 8, image_sizes=ref["image_sizes"])


LFM2_PROMPT = "hi <image> and <image> x"


@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_lfm2_vl_tower_projector_splice_merge_and_logits_are_bit_exact(tower_ckpt, images, dtype, quant):
    """The photograph tiled (a 3x3 grid of 64-pixel tiles, row / column markers, a thumbnail), the
    drawn image one padded view; the position table resized to each view, padding masked."""
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch="lfm2-vl-vision"))
    ref, ours = _splice_equal(vlm, model, processor, [images[0], images[2]], LFM2_PROMPT, model.config.image_token_index)
    assert np.array_equal(np.array(ours.grid), np.array(ref["spatial_shapes"]))
    assert np.array_equal(ours.mask, np.array(ref["pixel_attention_mask"])) and not ours.mask.all()
    assert "<|img_row_3_col_3|>" in ours.text and "<|img_thumbnail|>" in ours.text
    grid = (ref["spatial_shapes"], ref["pixel_attention_mask"])
    theirs = oracle_stages(model, VitLayout.SIGLIP, ref["pixel_values"], grid, None)
    mine = vlm.vision.blocks(ours.pixel_values, None, ours.tower_grid)
    assert len(mine) == len(theirs) and mine[-1][0] == "projector"
    for (name, a), b in zip(mine, theirs):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"first mismatch at {name}"
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], spatial_shapes=ref["spatial_shapes"],
                                        pixel_attention_mask=ref["pixel_attention_mask"])
    assert mx.array_equal(ours.embeddings, merged.inputs_embeds)
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds).logits
    assert mx.array_equal(vlm.logits(ours), logits)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 4)], ids=["float32", "bfloat16-q4"])
def test_lfm2_vl_greedy_generation_is_bit_exact_vs_mlx_vlm(tower_ckpt, images, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, arch="lfm2-vl-vision"))
    pair = [images[0], images[2]]
    ref = _oracle_inputs(processor, pair, LFM2_PROMPT)
    _greedy_equal(vlm, model, ref, LFM2_PROMPT, pair, 8, spatial_shapes=ref["spatial_shapes"],
                  pixel_attention_mask=ref["pixel_attention_mask"])


def test_qwen2_vl_prompt_without_placeholders_and_count_mismatch(tower_ckpt, images):
    vlm, _, processor = _both(tower_ckpt(arch="qwen2_vl-vision"))
    ours = vlm.prepare("what is this", images[:1])
    ref = _oracle_inputs(processor, images[:1], "<|vision_start|><|image_pad|><|vision_end|>what is this")
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    with pytest.raises(ImageCountError, match="<|image_pad|>"):
        vlm.prepare("<|image_pad|> <|image_pad|>", images[:1])


def _oracle_replay(model, input_ids, embeds, tokens):
    """mlx-vlm's generate_step composition, raw logits per step: its cache, the prompt's rows but
    the last in one chunk, then the last row, then each generated token."""
    from mlx_vlm.models import cache as vlm_cache

    cache = vlm_cache.make_prompt_cache(model.language_model)
    lm = model.language_model
    lm(input_ids[:, :-1], inputs_embeds=embeds[:, :-1], cache=cache)
    out = [lm(input_ids[:, -1:], inputs_embeds=embeds[:, -1:], cache=cache).logits[:, -1, :]]
    for t in tokens[:-1]:
        out.append(lm(mx.array([[t]]), cache=cache).logits[:, -1, :])
    return out


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 4)], ids=["float32", "bfloat16-q4"])
def test_greedy_generation_is_bit_exact_vs_mlx_vlm(tower_ckpt, images, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant))
    ref = _oracle_inputs(processor, images[:2])
    prompt, tokens = _greedy_equal(vlm, model, ref, PROMPT, images[:2], 10)
    # raw logits per step: both compositions replayed over the same tokens
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], mask=ref["attention_mask"])
    want = _oracle_replay(model, ref["input_ids"], merged.inputs_embeds, tokens)
    runner = EmbeddedPrompt(vlm.text_model, prompt.embeddings)
    cache = vlm.text_model.make_cache()
    ids = prompt.ids[None]
    runner(ids[:, :-1], cache=cache)
    got = [runner(ids[:, -1:], cache=cache)[:, -1, :]]
    for t in tokens[:-1]:
        got.append(runner(mx.array([[t]]), cache=cache)[:, -1, :])
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b), f"step {i}"


def test_preprocessing_equals_the_processor_on_other_images(tower_ckpt, images):
    """A grayscale, non-square drawn image and an RGBA PNG: resize, RGB, rescale, normalize."""
    vlm, _, processor = _both(tower_ckpt())
    for image in images[1:]:
        ref = _oracle_inputs(processor, [image], "<start_of_image>")
        ours = vlm.prepare("<start_of_image>", [image])
        assert ours.ids.tolist() == ref["input_ids"][0].tolist()
        assert mx.array_equal(ours.pixel_values, ref["pixel_values"]), image


def test_a_prompt_without_placeholders_takes_the_images_first(tower_ckpt, images):
    vlm, _, processor = _both(tower_ckpt())
    ours = vlm.prepare("what is this", images[:2])
    ref = _oracle_inputs(processor, images[:2], "<start_of_image> <start_of_image> what is this")
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()


# ------------------------------------------------------------------ bad input: one named error each


def test_bad_images_are_named_errors_before_the_tower(tower_ckpt, images, tmp_path, monkeypatch):
    vlm, _, _ = _both(tower_ckpt())

    def no_tower(*a, **k):
        raise AssertionError("the tower ran")

    monkeypatch.setattr(type(vlm.vision), "features", no_tower)
    assert_broken_images_refused(lambda path: vlm.prepare("<start_of_image>", [path]), images[0], tmp_path)
    with pytest.raises(ImageUnreadable, match="not a file"):
        vlm.prepare("<start_of_image>", [tmp_path])
    with pytest.raises(ImageCountError, match="2 image placeholder"):
        vlm.prepare("<start_of_image> <start_of_image>", images[:1])
    with pytest.raises(TooManyImages, match=f"at most {MAX_IMAGES}"):
        vlm.prepare("", images[:1] * (MAX_IMAGES + 1))
    with pytest.raises(TooManyImages, match="context"):  # 15 x (4 soft + 4 markers) + text > 512
        vlm.prepare("x " * 400, images[:1] * 15)


def test_a_checkpoint_without_a_tower_refuses_images(zoo, tower_ckpt):
    from mlxbun.towers.loader import has_tower, open_vision

    assert has_tower(tower_ckpt())
    for arch, why in (("gemma3", "no vision_config"), ("llama", "llama is a text model")):
        path = zoo(arch)
        assert not has_tower(path)
        with pytest.raises(NoTowerError, match=why):
            open_vision(path)


def test_a_vlm_config_without_tower_tensors_is_refused(tower_ckpt, tmp_path):
    """A text-only build of the VLM (vision_config kept, no vision_tower.* tensors)."""
    import shutil

    from mlxbun.towers.loader import open_vision

    src = tower_ckpt()
    dst = tmp_path / "text-only"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        w = {k: v for k, v in mx.load(str(dst / shard)).items() if not k.startswith("vision_tower.")}
        mx.save_safetensors(str(dst / shard), w, metadata={"format": "mlx"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("vision_tower.")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NoTowerError, match="holds no vision_tower"):
        open_vision(dst)


# ------------------------------------------------------------------ the CLI


def test_cli_generate_with_images_equals_the_api(tower_ckpt, images, capsys):
    path = tower_ckpt()
    code = cli.main(["generate", "--model", str(path), "--image", images[0], "--image", images[1],
                     "--prompt", PROMPT, "--max-tokens", "6", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    vlm, _, _ = _both(path)
    prompt = vlm.prepare(PROMPT, images[:2])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == 8 and out["images"] == 2
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=6)]


def test_cli_generates_from_qwen2_vl_images(tower_ckpt, images, capsys):
    path = tower_ckpt(arch="qwen2_vl-vision")
    code = cli.main(["generate", "--model", str(path), "--image", images[0], "--prompt", "what is this",
                     "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    vlm, _, _ = _both(path)
    prompt = vlm.prepare("what is this", images[:1])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == prompt.soft_tokens
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]


@pytest.mark.parametrize("extra,message", [
    (["--model", "zoo:llama"], "llama is a text model"),
    (["--model", "zoo:gemma3"], "no vision tower"),
    (["--image", "/nonexistent.png"], "no such image file"),
    (["--engine", "mlx-lm"], "mlxbun's engine only"),
    (["--fast"], "--fast with --image"),
    (["--chat"], "--chat with --image"),
])
def test_cli_image_refusals_are_one_line(tower_ckpt, images, capsys, monkeypatch, extra, message):
    import mlxbun.multimodal as mm

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(mm, "open_vlm", no_load)
    args = ["generate", "--model", str(tower_ckpt()), "--image", images[0], "--prompt", "x", "--max-tokens", "2"]
    code = cli.main(args + extra)
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_tower_rows_check_their_knobs():
    from mlxbun.towers.knobs import MergeKind, ProjectorKind, SpliceKind, TowerDescriptor, VitKnobs

    with pytest.raises(TypeError, match="vit.act='gelu'"):
        TowerDescriptor("x", ("x",), "a", "b", VitKnobs(act="gelu"), ProjectorKind.GEMMA3_AVGPOOL,
                        MergeKind.GEMMA3_SCALED, SpliceKind.GEMMA3)
    with pytest.raises(TypeError, match="splice='rows'"):
        TowerDescriptor("x", ("x",), "a", "b", VitKnobs(), ProjectorKind.GEMMA3_AVGPOOL,
                        MergeKind.GEMMA3_SCALED, "rows")


# ------------------------------------------------------------------ the bring-up notebook's driver


def test_tower_bringup_driver_holds_every_stage_and_records_rows(tower_ckpt, tmp_path):
    from mlxbun.experiments.tower_bringup import tower_bringup
    from mlxbun.lab import tower_plots
    from mlxbun.results import open_results

    db = tmp_path / "results.sqlite"
    run = tower_bringup(tower_ckpt("bfloat16", 4), results_path=db)
    assert run.bit_exact and run.verdict().startswith("PASS"), run.verdict()
    assert run.stages == ["embeddings", "layers.0", "layers.1", "post_layernorm", "projector"]
    assert run.grids["layers.0"].shape == (4, 4) and run.grids["projector"].shape == (2, 2)
    assert run.image.shape == (64, 64, 3) and run.soft_tokens.shape == (4, 64)
    assert run.attention.shape == (2, 16, 16) and np.allclose(run.attention.sum(-1), 1.0, atol=1e-5)
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    assert set(rows.metric) == {"max_abs_diff", "bit_exact", "soft_tokens"}
    assert (rows[rows.metric == "max_abs_diff"].value == 0).all()
    for fig in (tower_plots.patch_grid_plot(run.image, run.patch_size), tower_plots.stage_diff_grids(run.grids),
                tower_plots.soft_tokens_plot(run.soft_tokens, run.prompt_ids, run.token_id),
                tower_plots.attention_plot(run.attention)):
        assert fig.axes
    run.stage_max["layers.1"] = 1.0  # a stage that differs is named by the verdict and fails the run
    assert "first stage that differs: layers.1" in run.verdict()
    with pytest.raises(Exception, match="layers.1"):
        run.require_pass()


@pytest.mark.parametrize("arch", [a for a, _ in QWEN_ARCHS] + PIXTRAL_ARCHS + ["lfm2-vl-vision"])
def test_tower_bringup_driver_on_dynamic_towers(zoo_root, arch):
    from mlxbun.experiments.tower_bringup import tower_bringup

    run = tower_bringup(f"zoo:{arch}", zoo_root=zoo_root, record=False)
    assert run.bit_exact, run.verdict()
    rows, cols = run.grid_shape
    patch, merge = {"pixtral-vision": (16, 1), "mistral3-vision": (16, 2), "qwen3_vl-vision": (16, 2),
                    "lfm2-vl-vision": (16, 2)}.get(arch, (14, 2))
    assert run.image.shape == (rows * patch, cols * patch, 3)
    assert run.grids["projector"].shape == (rows // merge, cols // merge)
    assert run.attention.shape == (2, rows * cols, rows * cols)


def test_patch_order_puts_qwen_patches_back_in_row_major_order(tower_ckpt, images):
    """Each processor patch row's first pixel is the resized, normalized image's pixel at the
    corner of the patch `patch_order` names."""
    from PIL import Image

    from mlxbun.towers.images import load_image

    vlm, _, _ = _both(tower_ckpt(arch="qwen2_vl-vision"))
    prompt = vlm.prepare("x", images[:1])
    order = patch_order(vlm.vision, prompt.grid)
    _, h, w = prompt.grid.tolist()[0]
    spec = vlm.vision.processor
    resized = load_image(images[0]).resize((w * 14, h * 14), resample=Image.BICUBIC)
    red = (np.array(resized)[..., 0].astype(np.float32) * spec.rescale_factor - np.float32(spec.image_mean[0])) \
        / np.float32(spec.image_std[0])
    corners = np.array(prompt.pixel_values)[:, 0]  # channel 0, frame 0, (0, 0) of each patch in sequence order
    assert sorted(order.tolist()) == list(range(h * w))
    assert np.array_equal(red[::14, ::14].reshape(-1)[order], corners)


# ------------------------------------------------------------------ gemma4's vision tower (towers/gemma4_vision.py)

G4 = "gemma4-towers"
G4_PROMPT = "hi <|image|> and <|image|> there"
# gemma4 on this CPU: unquantized float16 / bfloat16 MoE experts do not run (gather_mm: float32 only)
G4_VARIANTS = [("float32", None), ("float32", 4), ("bfloat16", 8), ("float32", "mixed")]


@pytest.mark.parametrize("dtype,quant", G4_VARIANTS, ids=[f"{d}-{q}" for d, q in G4_VARIANTS])
def test_gemma4_vision_tower_splice_and_merge_are_bit_exact(tower_ckpt, images, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, G4))
    for sel in (images[:2], [images[0], images[0]]):  # two sizes (one by one), one size (a batch)
        prompt = " ".join(["<|image|>"] * len(sel)) + " what"
        ref = _oracle_inputs(processor, sel, prompt)
        ours = vlm.prepare(prompt, sel)
        assert ours.ids.tolist() == ref["input_ids"][0].tolist()
        assert ours.soft_tokens == int((ref["input_ids"] == model.config.image_token_id).sum().item())
        px = ref["pixel_values"] if isinstance(ref["pixel_values"], list) else list(ref["pixel_values"])
        assert all(mx.array_equal(a, b) for a, b in zip(ours.pixel_values, px))
        emb = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"])
        assert mx.array_equal(ours.embeddings, emb.inputs_embeds)
    # the tower block by block, on one image
    tower, mine = model.vision_tower, vlm.vision.tower
    pixels = ours.pixel_values[0][None]
    positions, padding, _ = tower._patch_positions_single(pixels.shape[2], pixels.shape[3],
                                                           max_patches=(pixels.shape[2] // 16) * (pixels.shape[3] // 16))
    positions, padding = mx.array(positions[None]), mx.array(padding[None])
    x = tower.patch_embedder(pixels, positions, padding)
    mask = mx.expand_dims(mx.where(mx.ones((1, x.shape[1], x.shape[1]), dtype=mx.bool_), mx.array(0.0, dtype=x.dtype),
                                   mx.array(-1e4, dtype=x.dtype)), 1)
    theirs = [x]
    for layer in tower.encoder.layers:
        theirs.append(x := layer(x, positions, mask))
    taps: list = []
    mine(pixels, taps=taps)
    assert len(taps) == len(theirs) and all(mx.array_equal(a, b) for a, b in zip(taps, theirs))


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 8)], ids=["float32", "bf16-q8"])
def test_gemma4_vision_greedy_generation_is_bit_exact(tower_ckpt, images, dtype, quant):
    vlm, model, processor = _both(tower_ckpt(dtype, quant, G4))
    _greedy_equal(vlm, model, _oracle_inputs(processor, images[:2], G4_PROMPT), G4_PROMPT, images[:2], 5)


def _g4_bidirectional(src: Path, dst: Path, how: str = "vision") -> Path:
    """A copy of the checkpoint whose text config says use_bidirectional_attention `how`."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = how
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 8)], ids=["float32", "bf16-q8"])
def test_gemma4_bidirectional_image_attention_is_bit_exact(tower_ckpt, images, tmp_path, dtype, quant):
    """use_bidirectional_attention "vision": mlx-vlm's generate, given the processor's token types,
    runs the prompt in one call whose masks let an image's tokens see each other, its logits from
    the last row cut before the KV-shared layers; the prompt's logits over every row likewise."""
    from mlx_vlm.generate.ar import generate_step

    path = _g4_bidirectional(tower_ckpt(dtype, quant, G4), tmp_path / "vision")
    vlm, model, processor = _both(path)
    ref = _oracle_inputs(processor, images[:2], G4_PROMPT)
    ours = vlm.prepare(G4_PROMPT, images[:2])
    emb = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"])
    want = model.language_model(None, inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs,
                                mm_token_type_ids=ref["mm_token_type_ids"]).logits
    causal = model.language_model(None, inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs).logits
    assert mx.array_equal(vlm.logits(ours), want) and not mx.array_equal(want, causal)
    theirs = list(generate_step(ref["input_ids"], model, ref["pixel_values"], ref["attention_mask"], max_tokens=5,
                                temperature=0.0, mm_token_type_ids=ref["mm_token_type_ids"]))
    mine = [(r.token, r.logprobs) for r in stream_generate(vlm, ours, max_tokens=5)]
    assert len(mine) >= 3 and [t for t, _ in mine] == [t for t, _ in theirs[:len(mine)]]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(mine, theirs))


def test_gemma4_vision_refusals(tower_ckpt, images, zoo_root, tmp_path):
    from mlxbun.multimodal import refuse_images
    from mlxbun.zoo import cached_checkpoint

    with pytest.raises(NoTowerError, match="holds no vision_tower"):  # the zoo's text-only gemma4
        refuse_images(cached_checkpoint("gemma4", root=zoo_root))
    dst = _g4_bidirectional(tower_ckpt("float32", None, G4), tmp_path / "all", "all")
    with pytest.raises(UnsupportedModelError, match="every token both ways is not built"):
        open_vlm(dst)
    src = tower_ckpt("float32", None, G4)
    vlm, _, _ = _both(src)
    with pytest.raises(ImageCountError, match="2 image placeholder"):
        vlm.prepare(G4_PROMPT, images[:1])
    with pytest.raises(TooManyImages):
        vlm.prepare("x", images[:1] * (MAX_IMAGES + 1))


def test_cli_generates_from_gemma4_images(tower_ckpt, images, capsys):
    path = tower_ckpt("float32", None, G4)
    code = cli.main(["generate", "--model", str(path), "--image", images[0], "--image", images[1],
                     "--prompt", G4_PROMPT, "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    vlm, _, _ = _both(path)
    prompt = vlm.prepare(G4_PROMPT, images[:2])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == prompt.soft_tokens and out["images"] == 2
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]
