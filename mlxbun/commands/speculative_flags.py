"""Speculative decoding for `mlxbun generate`: the flags, and the call behind them.

    --draft MODEL|ngram[:N]|self[:L]         the drafter (`mlxbun.names.parse_drafter`): a draft
                                             model (same vocabulary as the target), n-gram prompt
                                             lookup (longest n-gram N, default 3), or the target's
                                             first L blocks (default 1)
    --num-draft K                            draft tokens per round (the maximum with --adaptive)
    --adaptive                               choose k per round from acceptance and measured costs
    --ngram-min N                            shortest n-gram to look up (default 1)
    --draft-engine mlxbun|mlx-lm             graph that runs a draft model (alias --draft-backend)
    --spec-compare-plain                     also decode plainly: tokens/s and the speedup
    --spec-results PATH                      record the acceptance statistics (experiment 'spec')
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from mlxbun.config_reader import json_safe
from mlxbun.errors import MlxbunError
from mlxbun.names import DRAFTER_FORMS, parse_drafter, parse_engine, whole

__all__ = ["add_spec_arguments", "build_drafter", "check_spec_results", "finish_spec_from_args",
           "run_spec_from_args", "spec_requested"]


def add_spec_arguments(parser) -> None:
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, metavar=DRAFTER_FORMS.replace(" ", ""),
                   help="speculative decoding with a draft model, n-gram prompt lookup, or a self-draft "
                        "(the target's first L blocks)")
    g.add_argument("--num-draft", "--num-draft-tokens", dest="num_draft_tokens", type=int, default=3,
                   metavar="K", help="draft tokens per round (default 3)")
    g.add_argument("--adaptive", "--adaptive-draft", dest="adaptive_draft", action="store_true",
                   help="pick the draft length per round from the acceptance rate and measured costs")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to look up (default 1)")
    g.add_argument("--draft-engine", "--draft-backend", dest="draft_engine", default="mlxbun",
                   metavar="{mlxbun,mlx-lm}", help="graph that runs the draft model")
    g.add_argument("--spec-compare-plain", action="store_true",
                   help="also run plain decoding on the same prompt and report tokens/s and the speedup")
    g.add_argument("--spec-results", metavar="PATH", default=None,
                   help="record the acceptance statistics in this results table (experiment 'spec')")


def spec_requested(args) -> bool:
    return getattr(args, "draft", None) is not None


def check_spec_results(args) -> None:
    """Before any work: --spec-results needs --draft, and an existing file there must be an mlxbun
    results database; a missing one must be creatable, and is created when the statistics are
    recorded (`check_results`)."""
    if args.spec_results is None:
        return
    if not spec_requested(args):
        raise MlxbunError("--spec-results records speculative decoding statistics: it needs --draft")
    from mlxbun.results import check_results

    check_results(args.spec_results)


def build_drafter(args):
    """The Drafter the flags ask for (loading the draft model when there is one)."""
    from mlxbun.speculative import make_drafter

    spec = parse_drafter(args.draft)
    if args.num_draft_tokens < 1:
        raise MlxbunError(f"--num-draft must be >= 1, got {args.num_draft_tokens}")
    if spec.kind == "ngram":
        if args.ngram_min > spec.n:
            raise MlxbunError(f"--ngram-min {args.ngram_min} exceeds the longest n-gram {spec.n}")
        return make_drafter(spec, min_n=args.ngram_min)
    return make_drafter(spec, engine=parse_engine(args.draft_engine, what="--draft-engine/--draft-backend"))


def _options(args) -> dict:
    """stream_generate's options from the generate command's flags."""
    return dict(
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        min_tokens_to_keep=args.min_tokens_to_keep, seed=args.seed, repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size, kv_bits=whole(args.kv_bits),
        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start, kv_scheme=args.kv_scheme,
        kv_key_bits=args.kv_key_bits, kv_value_bits=args.kv_value_bits,
        kv_config=args.kv_config, max_kv_size=args.max_kv_size, stop=args.stop,
        prefill_step_size=args.prefill_step_size)


def run_spec_from_args(args, model, tokenizer, prompt, *, fast=False):
    """`speculative_generate`'s response stream for the generate command's flags (`fast`: the
    model's FastPath for --fast, else False)."""
    from mlxbun.speculative import speculative_generate

    for flag in ("prompt_cache", "save_prompt_cache"):
        if getattr(args, flag, None) is not None:
            raise MlxbunError(f"--{flag.replace('_', '-')} does not combine with speculative decoding")
    return speculative_generate(model, tokenizer, prompt, drafter=build_drafter(args),
                                num_draft=args.num_draft_tokens, adaptive=args.adaptive_draft, fast=fast,
                                **_options(args))


def finish_spec_from_args(args, last, model, tokenizer, prompt, *, model_path=None, quiet: Optional[bool] = None,
                          file=None) -> dict[str, Any]:
    """After the stream: the optional plain comparison, the results rows (identified by
    `model_path`, the checkpoint directory), the summary line on stderr (unless `quiet`, default:
    --json). Returns `stats.as_dict()` (for --json output)."""
    if last is None or getattr(last, "stats", None) is None:
        raise MlxbunError("no speculative response to report on")
    stats = last.stats
    if args.spec_compare_plain:
        from mlxbun.speculative.compare import plain_run

        plain = plain_run(model, tokenizer, prompt, **_options(args), fast=bool(getattr(args, "fast", False)))
        stats.plain_tokens_per_s = plain.tokens_per_s
    if args.spec_results is not None:
        from mlxbun.results import open_results

        with open_results(args.spec_results) as store:
            # a path: an mlxbun graph is an nn.Module, i.e. a dict, which model_identity reads as fields
            run = store.new_run("spec", model=model_path or getattr(model, "path", None),
                                params={"drafter": str(parse_drafter(args.draft)), "k": args.num_draft_tokens,
                                        "adaptive": args.adaptive_draft, "temperature": args.temp})
            stats.record(run)
    quiet = args.json if quiet is None else quiet
    if not quiet:
        print(f"Speculative: {stats.summary()}", file=file or sys.stderr)
    # JSON has no NaN: a statistic with nothing to measure (e.g. speedup without a plain run) is null
    return json_safe(stats.as_dict())
