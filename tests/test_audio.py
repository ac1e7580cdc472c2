"""gemma3n's audio tower held bit-exact to mlx-vlm 0.7.10, run live: the WAV read, the processor's
log-mel frames and mask, the spliced ids and soft-token counts, the tower stage by stage, the soft
tokens, the merged rows, the prompt's logits and greedy generation (tokens and log-probabilities
vs mlx-vlm's generate_step) on the tiny zoo checkpoint with its audio tower
(mlxbun.zoo.towers "gemma3n-audio"), in every dtype / quantization; each bad input refused by
name. Test audio: sine and noise written here with the standard library's wave module."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.multimodal import open_alm, stream_generate
from mlxbun.towers.errors import (AudioCountError, AudioFormatError, AudioTooLong, AudioTruncated,
                                  AudioUnreadable, NoTowerError, TooManyClips)
from mlxbun.towers.usm import MAX_CLIPS
from tests.audio_oracle import RATE, prompt_logits_equal, samples_of, write_wav

ARCH = "gemma3n-audio"
VARIANTS = [("float32", None), ("float16", None), ("bfloat16", None), ("float32", 4), ("bfloat16", 8),
            ("float32", "mixed")]
AUDIO = "<audio_soft_token>"
PROMPT = f"hi {AUDIO} and {AUDIO} there"


@pytest.fixture(scope="session")
def wavs(run_tmp) -> list[Path]:
    """A 0.75 s sine, 0.44 s of noise, and a 0.5 s stereo clip (the channels differ)."""
    t = np.arange(12_000) / RATE
    noise = np.random.default_rng(0).standard_normal(7_000) * 0.1
    stereo = np.stack([0.2 * np.sin(2 * np.pi * 300 * t[:8000]), 0.1 * np.cos(2 * np.pi * 700 * t[:8000])], 1)
    return [write_wav(run_tmp / "audio-sine.wav", 0.3 * np.sin(2 * np.pi * 440 * t)),
            write_wav(run_tmp / "audio-noise.wav", noise), write_wav(run_tmp / "audio-stereo.wav", stereo)]


_LOADED: dict = {}


def _both(path: Path):
    """(mlxbun's AudioLanguageModel, mlx-vlm's model, processor), loaded once per checkpoint (mlx-vlm's
    gemma3n without its vision tower, which the checkpoint does not carry: mlxbun.zoo.towers)."""
    if path not in _LOADED:
        from mlx_vlm.utils import load

        from mlxbun.zoo.towers import without_vision_tower

        with without_vision_tower("gemma3n"):
            model, processor = load(str(path))
        _LOADED[path] = (open_alm(path), model, processor)
    return _LOADED[path]


def _oracle_inputs(processor, clips, prompt=PROMPT):
    from mlx_vlm.utils import prepare_inputs

    return prepare_inputs(processor, audio=[samples_of(c) for c in clips], prompts=[prompt], add_special_tokens=True)


@pytest.mark.parametrize("dtype,quant", VARIANTS, ids=[f"{d}-{q}" for d, q in VARIANTS])
def test_audio_tower_splice_merge_and_logits_are_bit_exact(tower_ckpt, wavs, dtype, quant):
    alm, model, processor = _both(tower_ckpt(dtype, quant, ARCH))
    ref = _oracle_inputs(processor, wavs[:2])
    ours = alm.prepare(PROMPT, wavs[:2])
    # the processor: spliced ids, log-mel frames and their mask; the soft-token count
    assert ours.ids.tolist() == ref["input_ids"][0].tolist()
    assert mx.array_equal(ours.features, ref["input_features"]) and mx.array_equal(ours.mask, ref["input_features_mask"])
    assert ours.soft_tokens == int((ref["input_ids"] == model.config.audio_token_id).sum().item()) == 2 * 8
    # the tower stage by stage (the subsampling stack, then each conformer block), then its output
    padded = ~ref["input_features_mask"]
    tower = model.audio_tower
    x = tower.subsample_conv_projection(ref["input_features"])
    mask = alm.audio.tower.subsampled_mask(padded, x.shape[1])
    theirs = [x]
    for block in tower.conformer:
        theirs.append(x := block(x, mask))
    taps: list = []
    enc, _ = alm.audio.tower(ours.features, ~ours.mask, taps=taps)
    assert len(taps) == len(theirs)
    for i, (a, b) in enumerate(zip(taps, theirs)):
        assert mx.array_equal(a, b), f"audio tower stage {i} differs"
    want_enc, _ = tower(ref["input_features"], padded)
    assert mx.array_equal(enc, want_enc)
    # the soft tokens and the merged rows: mlx-vlm's get_input_embeddings
    emb = model.get_input_embeddings(ref["input_ids"], None, input_features=ref["input_features"],
                                     input_features_mask=ref["input_features_mask"])
    assert mx.array_equal(ours.embeddings, emb.inputs_embeds)
    prompt_logits_equal(alm, model, ref, emb, ours)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 4)], ids=["float32", "bf16-q4"])
def test_audio_greedy_generation_is_bit_exact(tower_ckpt, wavs, dtype, quant):
    """mlx-vlm's generate_step and mlxbun's stream_generate, greedy: the same tokens and bit-equal
    log-probabilities (decoding runs mlx-vlm's gemma3n composition too: AudioLanguageModel.hidden_kw)."""
    from mlx_vlm.generate.ar import generate_step

    alm, model, processor = _both(tower_ckpt(dtype, quant, ARCH))
    ref = _oracle_inputs(processor, wavs[:2])
    theirs = list(generate_step(ref["input_ids"], model, None, ref["attention_mask"], max_tokens=6,
                                temperature=0.0, input_features=ref["input_features"],
                                input_features_mask=ref["input_features_mask"]))
    ours = [(r.token, r.logprobs) for r in stream_generate(alm, alm.prepare(PROMPT, wavs[:2]), max_tokens=6)]
    assert len(ours) >= 3 and [t for t, _ in ours] == [t for t, _ in theirs[:len(ours)]]
    for (_, a), (_, b) in zip(ours, theirs):
        assert mx.array_equal(a, b)


def test_stereo_clip_and_a_prompt_without_placeholders_match_the_processor(tower_ckpt, wavs):
    alm, model, processor = _both(tower_ckpt(arch=ARCH))
    ref = _oracle_inputs(processor, wavs[2:], f"{AUDIO}what is this")
    ours = alm.prepare("what is this", wavs[2:])  # the placeholder goes first (one a clip, as for an empty text)
    assert ours.ids.tolist() == ref["input_ids"][0].tolist() and ours.n_clips == 1
    assert mx.array_equal(ours.features, ref["input_features"])
    emb = model.get_input_embeddings(ref["input_ids"], None, input_features=ref["input_features"],
                                     input_features_mask=ref["input_features_mask"])
    assert mx.array_equal(ours.embeddings, emb.inputs_embeds)


# ------------------------------------------------------------------ bad input: one named error each


def test_bad_wavs_are_refused_by_name(tower_ckpt, wavs, tmp_path):
    alm, _, _ = _both(tower_ckpt(arch=ARCH))
    good = wavs[0].read_bytes()
    cut_data = tmp_path / "cut.wav"
    cut_data.write_bytes(good[: len(good) // 2])
    cut_head = tmp_path / "head.wav"
    cut_head.write_bytes(good[:20])
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    byte = write_wav(tmp_path / "u8.wav", np.zeros(4000), width=1)
    slow = write_wav(tmp_path / "8k.wav", np.zeros(4000), rate=8000)
    long = write_wav(tmp_path / "long.wav", np.zeros(RATE * 2))
    cases = [(tmp_path / "missing.wav", AudioUnreadable, "no such audio file"), (tmp_path, AudioUnreadable, "not a file"),
             (text, AudioUnreadable, "not a RIFF/WAVE"), (cut_data, AudioTruncated, "declares"),
             (cut_head, AudioTruncated, "ends early"), (byte, AudioFormatError, "8-bit"),
             (slow, AudioFormatError, "8000 Hz"), (long, AudioTooLong, "holds 8 a clip")]
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            alm.prepare(AUDIO, [path])
    with pytest.raises(AudioCountError, match="holds 2 audio clip placeholder"):
        alm.prepare(PROMPT, wavs[:1])
    with pytest.raises(TooManyClips, match=f"at most {MAX_CLIPS}"):
        alm.prepare(AUDIO, [tmp_path / "missing.wav"] * (MAX_CLIPS + 1))  # before any file is read


def test_audio_on_a_checkpoint_without_an_audio_tower_is_refused(tower_ckpt, zoo_root):
    from mlxbun.multimodal import refuse_audio
    from mlxbun.zoo import cached_checkpoint

    with pytest.raises(NoTowerError, match="gemma3 is a model without an audio tower"):
        refuse_audio(tower_ckpt("float32", None, "gemma3-vision"))
    with pytest.raises(NoTowerError, match="llama is a model without an audio tower"):
        open_alm(cached_checkpoint("llama", root=zoo_root))
    with pytest.raises(NoTowerError, match="holds no audio_tower"):  # gemma3n's text-only build
        refuse_audio(cached_checkpoint("gemma3n", root=zoo_root))


# ------------------------------------------------------------------ the CLI


def test_cli_generate_with_audio_equals_the_api(tower_ckpt, wavs, capsys):
    path = tower_ckpt(arch=ARCH)
    code = cli.main(["generate", "--model", str(path), "--audio", str(wavs[0]), "--audio", str(wavs[1]),
                     "--prompt", PROMPT, "--max-tokens", "5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    alm, _, _ = _both(path)
    prompt = alm.prepare(PROMPT, wavs[:2])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == 16 and out["audio_clips"] == 2
    assert out["tokens"] == [r.token for r in stream_generate(alm, prompt, max_tokens=5)]


@pytest.mark.parametrize("extra,message", [
    (["--model", "zoo:llama"], "llama is a model without an audio tower"),
    (["--model", "zoo:gemma3n"], "holds no audio_tower"),
    (["--audio", "/nonexistent.wav"], "no such audio file"),
    (["--audio", "x.wav"] * MAX_CLIPS, f"at most {MAX_CLIPS}"),
    (["--image", "x.png"], "--image with --audio"),
    (["--fast"], "--fast with --audio"),
    (["--engine", "mlx-lm"], "mlxbun's engine only"),
])
def test_cli_audio_refusals_are_one_line(tower_ckpt, wavs, capsys, monkeypatch, extra, message):
    import mlxbun.multimodal as mm

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(mm, "open_alm", no_load)
    args = ["generate", "--model", str(tower_ckpt(arch=ARCH)), "--audio", str(wavs[0]), "--prompt", "x",
            "--max-tokens", "2"]
    code = cli.main(args + extra)
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ gemma4's audio tower

G4 = "gemma4-towers"
G4_AUDIO = "<|audio|>"
# gemma4 on this CPU: unquantized float16 / bfloat16 MoE experts do not run (mlx's gather_mm takes
# float32 only), so its variants are float32 and the quantized ones
G4_VARIANTS = [("float32", None), ("float32", 4), ("bfloat16", 8), ("float32", "mixed")]


def _g4_clip(n: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / RATE)).astype(np.float32)


def _g4(tower_ckpt, dtype="float32", quant=None):
    from mlx_vlm.utils import load

    path = tower_ckpt(dtype, quant, G4)
    if path not in _LOADED:
        model, processor = load(str(path))
        _LOADED[path] = (open_alm(path), model, processor)
    return _LOADED[path]


@pytest.mark.parametrize("dtype,quant", G4_VARIANTS, ids=[f"{d}-{q}" for d, q in G4_VARIANTS])
def test_gemma4_audio_tower_splice_merge_and_logits_are_bit_exact(tower_ckpt, dtype, quant):
    from mlx_vlm.utils import prepare_inputs

    alm, model, processor = _g4(tower_ckpt, dtype, quant)
    clip, prompt = _g4_clip(9600), f"hi {G4_AUDIO} there"  # 600 ms: 15 tokens, 15 encodings
    ref = prepare_inputs(processor, audio=[clip], prompts=[prompt], add_special_tokens=True)
    ours = alm.prepare(prompt, [clip])
    assert ours.ids.tolist() == ref["input_ids"][0].tolist() and ours.soft_tokens == 15
    assert mx.array_equal(ours.features, ref["input_features"]) and mx.array_equal(ours.mask, ref["input_features_mask"])
    tower, padded = model.audio_tower, ~ref["input_features_mask"]
    x, mask = tower.subsample_conv_projection(ref["input_features"], padded)
    local = tower._build_causal_valid_mask()
    theirs = [x]
    for block in tower.layers:
        theirs.append(x := block(x, mask, local))
    taps: list = []
    enc, _ = alm.audio.tower(ours.features, ~ours.mask, taps=taps)
    for i, (a, b) in enumerate(zip(taps, theirs)):
        assert mx.array_equal(a, b), f"gemma4 audio tower stage {i} differs"
    assert len(taps) == len(theirs) and mx.array_equal(enc, tower(ref["input_features"], padded)[0])
    emb = model.get_input_embeddings(ref["input_ids"], None, input_features=ref["input_features"],
                                     input_features_mask=ref["input_features_mask"])
    assert mx.array_equal(ours.embeddings, emb.inputs_embeds)
    prompt_logits_equal(alm, model, ref, emb, ours)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", 8)], ids=["float32", "bf16-q8"])
def test_gemma4_audio_greedy_generation_is_bit_exact(tower_ckpt, dtype, quant):
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import prepare_inputs

    alm, model, processor = _g4(tower_ckpt, dtype, quant)
    clip, prompt = _g4_clip(9600), f"hi {G4_AUDIO} there"
    ref = prepare_inputs(processor, audio=[clip], prompts=[prompt], add_special_tokens=True)
    theirs = list(generate_step(ref["input_ids"], model, None, ref["attention_mask"], max_tokens=5,
                                temperature=0.0, input_features=ref["input_features"],
                                input_features_mask=ref["input_features_mask"]))
    ours = [(r.token, r.logprobs) for r in stream_generate(alm, alm.prepare(prompt, [clip]), max_tokens=5)]
    assert len(ours) >= 3 and [t for t, _ in ours] == [t for t, _ in theirs[:len(ours)]]
    for (_, a), (_, b) in zip(ours, theirs):
        assert mx.array_equal(a, b)


def test_gemma4_clips_whose_tokens_and_encodings_disagree_are_refused(tower_ckpt):
    """mlx-vlm's processor gives a clip ceil(ms / 40) tokens (at most audio_seq_length) and its merge
    lays the tower's encodings over them in order, wrapping around where the counts differ."""
    alm, _, _ = _g4(tower_ckpt)
    with pytest.raises(AudioCountError, match=r"take \[11\] audio tokens but the tower gives 10"):
        alm.prepare(G4_AUDIO, [_g4_clip(6500)])
    with pytest.raises(AudioCountError, match="padded to the longest"):
        alm.prepare(G4_AUDIO * 2, [_g4_clip(9600), _g4_clip(6400)])
    with pytest.raises(AudioTooLong, match="past the 16 tokens a clip takes"):
        alm.prepare(G4_AUDIO, [_g4_clip(2 * RATE)])


def test_cli_generates_from_gemma4_audio(tower_ckpt, run_tmp, capsys):
    wav = write_wav(run_tmp / "audio-g4.wav", _g4_clip(9600).astype(np.float64))
    path = tower_ckpt("float32", None, G4)
    code = cli.main(["generate", "--model", str(path), "--audio", str(wav), "--prompt", f"hi {G4_AUDIO}",
                     "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    alm, _, _ = _g4(tower_ckpt)
    prompt = alm.prepare(f"hi {G4_AUDIO}", [wav])
    assert out["prompt_ids"] == prompt.ids.tolist() and out["soft_tokens"] == 15 and out["audio_clips"] == 1
    assert out["tokens"] == [r.token for r in stream_generate(alm, prompt, max_tokens=4)]
