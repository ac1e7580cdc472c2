"""Video into the Qwen-VL towers held bit-exact to mlx-vlm 0.7.10, run live on the tiny zoo
checkpoints: the video processor's pixels and grid, the spliced ids (Qwen3-VL's timestamps), the
soft-token count, the tower block by block over the frames, the merged rows, the mRoPE positions,
the prompt's logits and greedy generation. mlx-vlm decodes video files through OpenCV, which is
not installed, so both sides take the same decoded frames (drawn here, saved as PNG frames)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.multimodal import open_vlm, stream_generate
from mlxbun.towers.errors import (ImageCountError, NoTowerError, NoVideoTower, TooManyFrames, VideoCountError,
                                  VideoFormatError, VideoUnreadable)
from tests.tower_oracle import load_both, qwen_text_side_equal, qwen_tower_equal

PROMPT = "hi <|vision_start|><|video_pad|><|vision_end|> what happens"
TWO = "a <|vision_start|><|video_pad|><|vision_end|> then <|vision_start|><|video_pad|><|vision_end|> why"
# (arch, dtype, quant, Qwen2.5-VL windows): every Qwen-VL row in float32, and quantized ones
CASES = [("qwen2_vl-vision", "float32", None, False), ("qwen2_5_vl-vision", "float32", None, True),
         ("qwen3_vl-vision", "float32", None, False), ("qwen3_vl_moe-vision", "float32", None, False),
         ("qwen3_vl-vision", "float32", 4, False), ("qwen2_vl-vision", "bfloat16", 8, False)]


def _draw(n: int, height: int, width: int) -> list:
    """`n` RGB frames: a gradient with a square moving across it."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    out = []
    for i in range(n):
        f = np.stack([(x * 4 + i * 20) % 256, (y * 6) % 256, ((x + y) * 3) % 256], axis=-1).astype(np.uint8)
        f[5:15, 5 + 8 * i:15 + 8 * i] = (255, 255 - 40 * i, 0)
        out.append(Image.fromarray(f))
    return out


def _save(d: Path, frames: list) -> Path:
    for i, f in enumerate(frames):
        f.save(d / f"{i:03d}.png")
    return d


@pytest.fixture(scope="session")
def frames(tmp_path_factory) -> Path:
    """Three 60x40 PNG frames (odd: the last repeated into the second temporal patch)."""
    return _save(tmp_path_factory.mktemp("video-frames"), _draw(3, 40, 60))


@pytest.fixture(scope="session")
def wide(tmp_path_factory) -> Path:
    """Two 112x56 frames: one temporal patch of 4 x 8 patches (Qwen2.5-VL: two attention windows)."""
    return _save(tmp_path_factory.mktemp("video-wide"), _draw(2, 56, 112))


def _decoded(d: Path) -> np.ndarray:
    """The frames as mlx-vlm's processor takes decoded ones: [T, H, W, 3] uint8."""
    from PIL import Image

    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in sorted(d.glob("*.png"))])


@pytest.fixture(scope="session")
def ckpt(zoo_root):
    from mlxbun.zoo.towers import cached_tower_checkpoint

    return lambda arch, dtype="float32", quant=None: cached_tower_checkpoint(arch, dtype=dtype, quant=quant,
                                                                              root=zoo_root)


def _oracle(processor, video, prompt: str = PROMPT, **kw):
    """mlx-vlm's processor inputs for decoded frames (`video`: one [T, H, W, 3] array or a list)."""
    from mlx_vlm.utils import prepare_inputs

    videos = video if isinstance(video, list) else [video]
    return prepare_inputs(processor, videos=videos, prompts=[prompt], add_special_tokens=True, **kw)


@pytest.mark.parametrize("arch,dtype,quant,windows", CASES, ids=[f"{a}-{d}-{q}" for a, d, q, _ in CASES])
def test_video_splice_tower_merge_logits_and_greedy_are_bit_exact(ckpt, frames, wide, arch, dtype, quant, windows):
    """Two videos of different sizes: three frames (two temporal patches, the last frame repeated)
    and two wider ones (one temporal patch)."""
    from mlx_vlm.generate.ar import generate_step

    vlm, model, processor = load_both(ckpt(arch, dtype, quant))
    ref = _oracle(processor, [_decoded(frames), _decoded(wide)], TWO)
    ours = vlm.prepare(TWO, videos=[frames, wide])
    video_id = model.config.video_token_id
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.pixel_values, ref["pixel_values_videos"])
    assert mx.array_equal(ours.grid, ref["video_grid_thw"]) and ours.grid[:, 0].tolist() == [2, 1]
    assert ours.soft_tokens == int((ref["input_ids"] == video_id).sum().item()) == 4 + 8
    assert ours.n_videos == 2 and ours.n_images == 0
    if arch.startswith("qwen3"):  # a "<t seconds>" vision block per temporal patch
        assert ours.text.count("<0.2 seconds><|vision_start|>") == 2 and "<1.0 seconds><|vision_start|>" in ours.text
    grid = ref["video_grid_thw"]
    qwen_tower_equal(vlm, model, ours, ref["pixel_values_videos"], grid, windows)
    video = {"pixel_values_videos": ref["pixel_values_videos"], "video_grid_thw": grid}
    qwen_text_side_equal(vlm, model, ours, ref, None, arch.startswith("qwen3"), **video)
    # greedy: mlx-vlm's generate_step (mlxbun stops at EOS, mlx-vlm does not)
    oracle = list(generate_step(ref["input_ids"], model, None, ref["attention_mask"], max_tokens=6,
                                temperature=0.0, **video))
    mine = [(r.token, r.logprobs) for r in stream_generate(vlm, ours, max_tokens=6)]
    assert len(mine) >= 3 and [t for t, _ in mine] == [t for t, _ in oracle[:len(mine)]]
    for (_, a), (_, b) in zip(mine, oracle):
        assert mx.array_equal(a, b)


def test_video_sources_fps_and_placeholders_equal_the_processor(ckpt, frames, tmp_path):
    """A .npy array, a frame list and the frame directory give the same prompt; Qwen3-VL's fps
    (the timestamps), a bare placeholder (no vision block per patch) and a prompt without any
    placeholder (the video in front) against mlx-vlm's processor; the ids alone."""
    vlm, _, processor = load_both(ckpt("qwen3_vl-vision"))
    decoded = _decoded(frames)
    np.save(tmp_path / "clip.npy", decoded)
    base = vlm.prepare(PROMPT, videos=[frames])
    for source in (tmp_path / "clip.npy", sorted(frames.glob("*.png")), decoded.transpose(0, 3, 1, 2)):
        other = vlm.prepare(PROMPT, videos=[source])
        assert other.ids.tolist() == base.ids.tolist() and mx.array_equal(other.pixel_values, base.pixel_values)
    slow = vlm.prepare(PROMPT, videos=[frames], fps=0.5)
    assert slow.ids.tolist() == _oracle(processor, decoded, fps=0.5)["input_ids"][0].tolist()
    assert "<1.0 seconds>" in slow.text and "<4.0 seconds>" in slow.text
    bare = "hi <|video_pad|> there"
    assert vlm.prepare(bare, videos=[frames]).ids.tolist() == _oracle(processor, decoded, bare)["input_ids"][0].tolist()
    lead = vlm.prepare("what happens", videos=[frames])
    assert lead.ids.tolist() == _oracle(processor, decoded, "<|vision_start|><|video_pad|><|vision_end|>what happens"
                                        )["input_ids"][0].tolist()


def test_video_refusals_are_named_before_the_tower(ckpt, frames, tmp_path, monkeypatch):
    from PIL import Image

    vlm, _, _ = load_both(ckpt("qwen2_vl-vision"))

    def no_tower(*a, **k):
        raise AssertionError("the tower ran")

    monkeypatch.setattr(vlm.vision, "features_and_deepstack", no_tower)
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "0.png").write_bytes(b"not a png")
    (tmp_path / "mixed").mkdir()
    for i, f in enumerate(_draw(2, 40, 60)):
        f.resize((60 + 4 * i, 40)).save(tmp_path / "mixed" / f"{i}.png")
    np.save(tmp_path / "float.npy", np.zeros((2, 40, 60, 3), np.float32))
    np.save(tmp_path / "small.npy", np.zeros((2, 20, 60, 3), np.uint8))
    np.save(tmp_path / "long.npy", np.zeros((769, 2, 2, 3), np.uint8))
    cases = [("missing", VideoUnreadable, "no such video"), ("clip.mp4", VideoUnreadable, "OpenCV"),
             ("empty", VideoUnreadable, "no frames"), ("bad", VideoUnreadable, "not an image"),
             ("mixed", VideoFormatError, "different sizes"), ("float.npy", VideoFormatError, "uint8"),
             ("small.npy", VideoFormatError, "resize factor"), ("long.npy", TooManyFrames, "768")]
    for name, error, message in cases:
        with pytest.raises(error, match=message):
            vlm.prepare(PROMPT, videos=[tmp_path / name])
    with pytest.raises(VideoCountError, match="2 video placeholder"):
        vlm.prepare(PROMPT + PROMPT, videos=[frames])
    with pytest.raises(VideoCountError, match="images and videos"):
        vlm.prepare(PROMPT, [Image.new("RGB", (60, 40))], videos=[frames])
    with pytest.raises(ImageCountError, match="1 image placeholder"):
        vlm.prepare(PROMPT + "<|image_pad|>", videos=[frames])
    with pytest.raises(VideoCountError, match="1 video placeholder"):  # an image prompt holding a video placeholder
        vlm.prepare(PROMPT, [Image.new("RGB", (60, 40))])
    with pytest.raises(TooManyFrames, match="at most 4"):
        vlm.prepare("", videos=[frames] * 5)


def test_video_on_a_row_without_video_is_refused(ckpt, frames, zoo):
    from mlxbun.multimodal import refuse_video

    gemma3 = ckpt("gemma3-vision")
    with pytest.raises(NoVideoTower, match="takes no video"):
        refuse_video(gemma3)
    with pytest.raises(NoVideoTower, match="takes no video"):
        open_vlm(gemma3).prepare("x", videos=[frames])
    with pytest.raises(NoTowerError, match="text model"):
        refuse_video(zoo("llama"))


def test_cli_generates_from_a_video_and_refuses_in_one_line(ckpt, frames, capsys):
    path = ckpt("qwen3_vl-vision")
    code = cli.main(["generate", "--model", str(path), "--video", str(frames), "--prompt", "what happens",
                     "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["videos"] == 1
    vlm, _, _ = load_both(path)
    prompt = vlm.prepare("what happens", videos=[frames])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == prompt.soft_tokens
    assert out["tokens"] == [r.token for r in stream_generate(vlm, prompt, max_tokens=4)]
    for extra, model, message in [([], ckpt("gemma3-vision"), "takes no video"),
                                  (["--image", str(next(frames.glob("*.png")))], path, "--image with --video"),
                                  (["--chat"], path, "--chat with --video"),
                                  ([], path, "no such video")]:
        video = "/nonexistent-video" if message == "no such video" else str(frames)
        code = cli.main(["generate", "--model", str(model), "--video", video, "--prompt", "x", "--max-tokens", "2"]
                        + extra)
        err = capsys.readouterr().err
        assert code == 1 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
