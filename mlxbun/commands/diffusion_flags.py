"""`mlxbun generate` for diffusion checkpoints: the profile's loop picks this path.

`loop: diffusion` (DiffusionGemma) runs `diffusion_generate`; `loop: masked-diffusion`
(LLaDA2) runs `masked_diffusion_generate`. Text streams as each block completes; `--json`
prints the same object as autoregressive models plus a `diffusion` object of statistics.
"""

from __future__ import annotations

import sys
import time

from mlxbun.diffusion.schedule import SAMPLERS


def add_diffusion_arguments(p) -> None:
    g = p.add_argument_group("diffusion checkpoints (DiffusionGemma, LLaDA2)")
    g.add_argument("--sampler", default=None, metavar="{confidence-threshold,entropy-bound}",
                   help="DiffusionGemma denoising sampler (default: the checkpoint's)")
    g.add_argument("--steps", type=int, default=None, help="denoising steps per block (default: the checkpoint's)")
    g.add_argument("--threshold", type=float, default=None, help="confidence threshold to reveal a position")
    g.add_argument("--entropy-bound", type=float, default=None, help="entropy-bound sampler's bound")
    g.add_argument("--t-min", type=float, default=None, help="temperature schedule start (divides logits)")
    g.add_argument("--t-max", type=float, default=None, help="temperature schedule end")
    g.add_argument("--block-length", type=int, default=32, help="LLaDA2: tokens per block (default 32)")


def _check(args) -> None:
    from mlxbun.errors import MlxbunError

    if args.sampler is not None and args.sampler not in SAMPLERS:
        raise MlxbunError(f"--sampler {args.sampler!r}: choose {' or '.join(SAMPLERS)}")
    for name in ("steps", "block_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise MlxbunError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.max_tokens < 1:
        raise MlxbunError(f"--max-tokens must be >= 1, got {args.max_tokens}")


def run_diffusion(args, model, tokenizer, prompt: list[int]) -> dict:
    """Stream a diffusion generation to stdout (unless --json); return the JSON object."""
    _check(args)
    loop = model.profile.execution.loop
    if loop == "diffusion":
        result = _diffusion_gemma(args, model, tokenizer, prompt)
    else:
        result = _masked(args, model, tokenizer, prompt)
    return result


def _emit(args, text: str) -> None:
    if not args.json:
        sys.stdout.write(text)
        sys.stdout.flush()


def _diffusion_gemma(args, model, tokenizer, prompt) -> dict:
    from mlxbun.diffusion.engine import diffusion_generate

    stream = diffusion_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, seed=args.seed, temperature=args.temp,
        steps=args.steps, sampler=args.sampler or "confidence-threshold", threshold=args.threshold,
        entropy_bound=args.entropy_bound, t_min=args.t_min, t_max=args.t_max,
        prefill_step_size=args.prefill_step_size,
    )
    text, tokens, stats = "", [], None
    for block in stream:
        text += block.text
        tokens += block.tokens
        _emit(args, block.text)
        stats = block.run or stats
    summary = stats.summary()
    summary.update(
        sampler=args.sampler or "confidence-threshold",
        revealed_per_step=stats.revealed_per_step,
        reveal_step=[b.reveal_step for b in stats.blocks],
    )
    return dict(text=text, tokens=tokens, finish_reason=stats.finish_reason,
                prompt_tokens=stats.prompt_tokens, prompt_tps=stats.prompt_tps,
                generation_tokens=stats.generation_tokens, generation_tps=stats.generation_tps,
                diffusion=summary)


def _masked(args, model, tokenizer, prompt) -> dict:
    from mlxbun.diffusion.masked import masked_diffusion_generate

    kw = dict(mask_token_id=model.mask_token_id, max_tokens=args.max_tokens, block_length=args.block_length,
              temperature=args.temp, eos_token_ids=tokenizer.eos_token_ids, seed=args.seed)
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.threshold is not None:
        kw["threshold"] = args.threshold
    t0 = time.perf_counter()
    text, last = "", None
    detok = tokenizer.detokenizer()
    for last in masked_diffusion_generate(model, prompt, **kw):
        piece = "".join(detok.add_token(t) for t in last.block_tokens)
        text += piece
        _emit(args, piece)
    tail = detok.finalize()
    text += tail
    _emit(args, tail)
    s = last.stats
    return dict(text=text, tokens=list(last.tokens), finish_reason=last.finish_reason,
                prompt_tokens=s.prompt_tokens, prompt_tps=s.prompt_tokens / max(s.prompt_time_s, 1e-9),
                generation_tokens=s.generation_tokens, generation_tps=s.generation_tps,
                diffusion=dict(loop="masked-diffusion", blocks=s.blocks, nfe=s.nfe,
                               denoising_steps=s.nfe, tokens_per_forward=s.tokens_per_forward,
                               revealed_per_step=[list(r) for r in s.revealed_per_step],
                               reveal_step=list(s.reveal_step), unrevealed=s.unrevealed,
                               elapsed_s=time.perf_counter() - t0))
