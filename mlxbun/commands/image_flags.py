"""`mlxbun generate --image FILE [--image FILE ...]` / `--video DIR|FILE.npy` / `--audio FILE.wav
[--audio ...]`: images or a video's frames into a VLM checkpoint's vision tower, audio clips into
its audio tower (mlxbun.multimodal). Every refusal comes before the model loads: flags the media
path does not take, a checkpoint without such a tower mlxbun builds, too many images / videos /
frames / clips, unreadable / truncated / unsupported files."""

from __future__ import annotations

import json
import sys

from mlxbun.errors import MlxbunError

# flags the media path does not combine with, and why
_REFUSED = {
    "prompt_ids": "the media are spliced into prompt text (give --prompt with the placeholders)",
    "chat": "the chat template's media items are not reproduced (write the placeholders into --prompt)",
    "prompt_cache": "a saved cache holds token embeddings, not the merged media rows",
    "save_prompt_cache": "a saved cache would hold the merged media rows under plain token ids",
    "fast": "the compiled decode step runs token ids only",
    "tp": "the tower is not split across ranks",
}


def add_image_arguments(p) -> None:
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image for a VLM checkpoint's tower (repeat for several); the prompt's "
                        "image placeholders (e.g. <start_of_image>) take them in order, else they go first")
    p.add_argument("--video", action="append", default=None, metavar="DIR|FILE.npy",
                   help="a video for a Qwen-VL checkpoint's tower (qwen2_vl, qwen2_5_vl, qwen3_vl): a directory "
                        "of its frames as images (name order) or a .npy uint8 array [T, H, W, C], all frames "
                        "taken (mlxbun decodes no .mp4: mlx-vlm does through OpenCV); repeat for several; the "
                        "prompt's video placeholders (<|video_pad|>) take them in order, else they go first")
    p.add_argument("--audio", action="append", default=None, metavar="FILE.wav",
                   help="a 16-bit PCM WAV clip at the processor's sample rate for a checkpoint's audio tower "
                        "(gemma3n, gemma4; repeat for several); the prompt's audio placeholders (the audio "
                        "token, e.g. <audio_soft_token>) take them in order, else they go first")


def check_image_flags(args) -> None:
    """The refusals of --image / --audio that need no file and no model."""
    from mlxbun.multimodal import MAX_IMAGES
    from mlxbun.names import parse_engine
    from mlxbun.towers.errors import TooManyClips, TooManyFrames, TooManyImages, VideoCountError
    from mlxbun.towers.usm import MAX_CLIPS
    from mlxbun.towers.video import MAX_VIDEOS

    images, audio, videos = getattr(args, "image", None), getattr(args, "audio", None), getattr(args, "video", None)
    if videos is not None and audio is not None:
        raise MlxbunError("--video with --audio: mlxbun takes video without audio (images and audio together go "
                          "to gemma3n's towers)")
    if images is not None and videos is not None:
        raise VideoCountError("--image with --video: mlxbun takes images or videos in one prompt, not both "
                              "(mlx-vlm's qwen2_vl / qwen2_5_vl run the images alone when both come)")
    flag = "--image" if images is not None else "--video" if videos is not None else "--audio"
    if parse_engine(args.engine, what="--engine/--backend") != "mlxbun":
        raise MlxbunError(f"{flag} runs on mlxbun's engine only (mlx-lm builds no tower)")
    for name, why in _REFUSED.items():
        v = getattr(args, name, None)
        if v not in (None, False) and not (name == "tp" and v == 1):
            raise MlxbunError(f"--{name.replace('_', '-')} with {flag}: {why}")
    if getattr(args, "draft", None) is not None:
        raise MlxbunError(f"{flag} with speculative decoding: the drafters see token ids only")
    if images is not None and len(images) > MAX_IMAGES:
        raise TooManyImages(f"{len(images)} --image files; mlxbun takes at most {MAX_IMAGES} per prompt")
    if videos is not None and len(videos) > MAX_VIDEOS:
        raise TooManyFrames(f"{len(videos)} --video given; mlxbun takes at most {MAX_VIDEOS} per prompt")
    if audio is not None and len(audio) > MAX_CLIPS:
        raise TooManyClips(f"{len(audio)} --audio files; mlxbun takes at most {MAX_CLIPS} per prompt")


def run_images(args, path) -> int:
    """Generate from --prompt and the --image files (or --video frames) of the checkpoint at `path`."""
    from mlxbun.multimodal import open_vlm, refuse_images, refuse_video
    from mlxbun.towers.images import load_image
    from mlxbun.towers.video import load_video

    check_image_flags(args)
    videos = getattr(args, "video", None)
    if videos is not None:
        spec = refuse_video(path, "--video")  # NoTowerError / NoVideoTower before anything loads
        videos = [load_video(f, spec.max_frames) for f in videos]  # VideoUnreadable / Format / TooManyFrames
    else:  # NoTowerError before anything loads
        refuse_images(path, "--image" if getattr(args, "audio", None) is None else "--image with --audio")
    clips = _clips_beside_images(args, path)
    images = [load_image(f) for f in args.image or ()]  # ImageUnreadable / ImageTruncated
    text = sys.stdin.read() if args.prompt == "-" else (args.prompt or "")
    vlm = open_vlm(path)
    vlm.check_generation()  # a text model needing positions mlxbun does not build, before the tower
    prompt = vlm.prepare(text, images, videos=videos or (), **({"clips": clips} if clips else {}))
    if videos:
        return _generate(args, vlm, prompt, "videos", prompt.n_videos)
    return _generate(args, vlm, prompt, "images", prompt.n_images, {"audio_clips": len(clips)} if clips else None)


def _clips_beside_images(args, path) -> list:
    """--audio's clips beside --image (gemma3n's towers take both in one prompt), read and checked
    before anything loads; refused by name for any other checkpoint."""
    from mlxbun.multimodal import load_clip, refuse_audio
    from mlxbun.towers.loader import _read_config
    from mlxbun.towers.usm import sampling_rate

    if getattr(args, "audio", None) is None:
        return []
    model_type = _read_config(path).get("model_type")
    if model_type != "gemma3n":
        raise MlxbunError(f"--image with --audio: {path}: {model_type}; mlxbun takes images and audio in one prompt "
                          "on gemma3n only")
    refuse_audio(path, "--image with --audio")
    rate = sampling_rate(path)
    return [load_clip(f, rate) for f in args.audio]  # AudioUnreadable / AudioTruncated / AudioFormatError


def run_audio(args, path) -> int:
    """Generate from --prompt and the --audio WAV files of the checkpoint at `path` (with --image:
    run_images, gemma3n's towers together)."""
    from mlxbun.multimodal import load_clip, open_alm, refuse_audio
    from mlxbun.towers.usm import sampling_rate

    if getattr(args, "image", None) is not None:
        return run_images(args, path)
    check_image_flags(args)
    refuse_audio(path, "--audio")  # NoTowerError before anything loads
    rate = sampling_rate(path)
    clips = [load_clip(f, rate) for f in args.audio]  # AudioUnreadable / AudioTruncated / AudioFormatError
    text = sys.stdin.read() if args.prompt == "-" else (args.prompt or "")
    alm = open_alm(path)
    prompt = alm.prepare(text, clips)
    return _generate(args, alm, prompt, "audio_clips", prompt.n_clips)


def _generate(args, model, prompt, what: str, count: int, extra: dict | None = None) -> int:
    from mlxbun.multimodal import stream_generate
    from mlxbun.names import whole

    stream = stream_generate(
        model, prompt, max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, min_tokens_to_keep=args.min_tokens_to_keep, seed=args.seed,
        repetition_penalty=args.repetition_penalty, repetition_context_size=args.repetition_context_size,
        max_kv_size=args.max_kv_size, stop=args.stop, prefill_step_size=args.prefill_step_size,
        kv_bits=whole(args.kv_bits), kv_group_size=args.kv_group_size, kv_scheme=args.kv_scheme,
        quantized_kv_start=args.quantized_kv_start, kv_key_bits=args.kv_key_bits,
        kv_value_bits=args.kv_value_bits, kv_config=args.kv_config)
    out, tokens, last = "", [], None
    for last in stream:
        out += last.text
        tokens.append(last.token)
        if not args.json:
            sys.stdout.write(last.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"text": out, "tokens": tokens, "finish_reason": last.finish_reason,
                          "prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
                          "generation_tokens": last.generation_tokens, "generation_tps": last.generation_tps,
                          "peak_memory_gb": last.peak_memory, what: count, **(extra or {}),
                          "soft_tokens": prompt.soft_tokens, "prompt_ids": prompt.ids.tolist()}))
    else:
        sys.stdout.write("\n")
        also = "".join(f", {k.replace('_', ' ')}: {v}" for k, v in (extra or {}).items())
        print(f"{what.replace('_', ' ').capitalize()}: {count}{also} ({prompt.soft_tokens} soft tokens)",
              file=sys.stderr)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=sys.stderr)
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
              file=sys.stderr)
    return 0
