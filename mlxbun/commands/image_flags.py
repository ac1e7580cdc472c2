"""`mlxbun generate --image FILE [--image FILE ...]`: images into a VLM checkpoint's tower
(mlxbun.multimodal). Every refusal comes before the model loads: flags the image path does not
take, a checkpoint without a tower mlxbun builds, too many images, unreadable / truncated files."""

from __future__ import annotations

import json
import sys

from mlxbun.errors import MlxbunError

# flags the image path does not combine with, and why
_REFUSED = {
    "prompt_ids": "the images are spliced into prompt text (give --prompt with the image placeholders)",
    "chat": "the chat template's image items are not reproduced (write the placeholders into --prompt)",
    "prompt_cache": "a saved cache holds token embeddings, not the merged image rows",
    "save_prompt_cache": "a saved cache would hold the merged image rows under plain token ids",
    "fast": "the compiled decode step runs token ids only",
    "tp": "the tower is not split across ranks",
}


def add_image_arguments(p) -> None:
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image for a VLM checkpoint's tower (repeat for several); the prompt's "
                        "image placeholders (e.g. <start_of_image>) take them in order, else they go first")


def check_image_flags(args) -> None:
    from mlxbun.multimodal import MAX_IMAGES
    from mlxbun.names import parse_engine
    from mlxbun.towers.errors import TooManyImages

    if parse_engine(args.engine, what="--engine/--backend") != "mlxbun":
        raise MlxbunError("--image runs on mlxbun's engine only (mlx-lm builds no tower)")
    for flag, why in _REFUSED.items():
        v = getattr(args, flag, None)
        if v not in (None, False) and not (flag == "tp" and v == 1):
            raise MlxbunError(f"--{flag.replace('_', '-')} with --image: {why}")
    if getattr(args, "draft", None) is not None:
        raise MlxbunError("--image with speculative decoding: the drafters see token ids only")
    if len(args.image) > MAX_IMAGES:
        raise TooManyImages(f"{len(args.image)} --image files; mlxbun takes at most {MAX_IMAGES} per prompt")


def run_images(args, path) -> int:
    """Generate from --prompt and the --image files of the checkpoint at `path`."""
    from mlxbun.multimodal import open_vlm, refuse_images, stream_generate
    from mlxbun.names import whole
    from mlxbun.towers.images import load_image

    check_image_flags(args)
    refuse_images(path, "--image")  # NoTowerError before anything loads
    images = [load_image(f) for f in args.image]  # ImageUnreadable / ImageTruncated
    text = sys.stdin.read() if args.prompt == "-" else (args.prompt or "")
    vlm = open_vlm(path)
    vlm.check_generation()  # a text model needing positions mlxbun does not build, before the tower
    prompt = vlm.prepare(text, images)
    stream = stream_generate(
        vlm, prompt, max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
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
                          "peak_memory_gb": last.peak_memory, "images": prompt.n_images,
                          "soft_tokens": prompt.soft_tokens, "prompt_ids": prompt.ids.tolist()}))
    else:
        sys.stdout.write("\n")
        print(f"Images: {prompt.n_images} ({prompt.soft_tokens} soft tokens)", file=sys.stderr)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=sys.stderr)
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
              file=sys.stderr)
    return 0
