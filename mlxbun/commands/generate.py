"""`mlxbun generate`: stream a completion from a checkpoint (or a zoo model) to stdout.

Speeds and peak memory go to stderr; `--json` prints one JSON object instead. Every option is
`mlxbun.generate.stream_generate`'s; bad ones are one-line `MlxbunError`s (exit 1).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from mlxbun.commands.diffusion_flags import add_diffusion_arguments, run_diffusion
from mlxbun.commands.hub_flags import add_offline
from mlxbun.commands.image_flags import add_image_arguments
from mlxbun.commands.speculative_flags import (
    add_spec_arguments,
    check_spec_results,
    finish_spec_from_args,
    run_spec_from_args,
    spec_requested,
)
from mlxbun.errors import MlxbunError
from mlxbun.fast import FAST_FIDELITY, enable_fast
from mlxbun.names import (KV_FORMS, MODEL_FORMS, KVSettings, comma_items, parse_engine, parse_kv, parse_model,
                          whole)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model (mlx-lm's token stream)",
                       description="Generate text from a model: the token stream of mlx-lm 0.32.2's "
                                   "stream_generate, over mlxbun's graph and caches.")
    p.add_argument("--model", required=True, metavar="MODEL",
                   help=f"the model: {MODEL_FORMS}")
    p.add_argument("--engine", "--backend", dest="engine", default="mlxbun", metavar="{mlxbun,mlx-lm}",
                   help="graph to run: mlxbun's (default) or mlx-lm's through the adapter")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompt-ids", metavar="ID,ID,...", help="prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens-to-keep", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--repetition-context-size", type=int, default=20)
    p.add_argument("--kv-bits", type=float, default=None,
                   help="KV cache bits (uniform: 2-8; turboquant: e.g. 3.5)")
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=0)
    p.add_argument("--kv-scheme", default="uniform", metavar="{uniform,turboquant}")
    p.add_argument("--kv-key-bits", type=int, default=None, metavar="K",
                   help="turboquant: the keys' width (1-8); the values get 2 x --kv-bits - K unless "
                        "--kv-value-bits is given (default: mlx-vlm's split, 3.5 = 3-bit keys + 4-bit values)")
    p.add_argument("--kv-value-bits", type=int, default=None, metavar="V",
                   help="turboquant: the values' width (1-8); with --kv-key-bits, --kv-bits may be left out")
    p.add_argument("--kv", metavar="SETTING", default=None,
                   help=f"the KV setting in one name ({KV_FORMS}), instead of --kv-bits / --kv-group-size "
                        "/ --kv-scheme / --quantized-kv-start / --kv-key-bits / --kv-value-bits; e.g. "
                        "turboquant:3.5,keys=4 puts TurboQuant's extra bit on the keys")
    p.add_argument("--kv-config", metavar="FILE|none",
                   help="per-layer KV plan (mixed caches; optiq's kv_config.json). Default: the checkpoint's "
                        "own kv_config.json when it has one and no other KV option is given; 'none': no plan")
    p.add_argument("--max-kv-size", type=int, default=None, help="bound every full-attention cache")
    p.add_argument("--prompt-cache", metavar="FILE", help="continue from a saved prompt cache")
    p.add_argument("--save-prompt-cache", metavar="FILE", help="save the cache after generating")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop before this text (repeatable)")
    p.add_argument("--fast", action="store_true",
                   help="the fast path (own GPU kernels, compiled decode; fidelity L2-fast: not bit-exact, "
                        "see `mlxbun bench --fast` for its measured speed and drift)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks: under `mlx.launch -n N --backend ring|nccl` the model is split "
                        "across the N ranks (the default: all of them; 1 opts out and every rank runs the whole "
                        "model); only rank 0 prints")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and speeds")
    add_offline(p)
    add_spec_arguments(p)
    add_diffusion_arguments(p)
    add_image_arguments(p)
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- inputs


def _parse_ids(text: str) -> list[int]:
    ids = []
    for i, t in enumerate(comma_items(text, "--prompt-ids"), 1):
        try:
            ids.append(int(t))
        except ValueError:
            raise MlxbunError(f"--prompt-ids {text!r}: item {i} ({t!r}) is not an integer; expected "
                              "comma-separated integers") from None
    return ids


def _chat_prompt(tokenizer, text: str, system, continuing: bool) -> list[int]:
    if not tokenizer.has_chat_template:
        raise MlxbunError(f"--chat: {tokenizer.path} has no chat template")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if continuing:
        # The saved cache holds the conversation so far: keep only the turn after it (mlx-lm's
        # "<query>" trick: render with a marker, cut where the user text starts).
        messages[-1]["content"] = "<query>"
        marked = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rendered = rendered[marked.index("<query>"):]
    # The template writes BOS itself: encode without added special tokens, as mlx-lm does.
    return tokenizer.encode(rendered, add_special_tokens=False)


def build_prompt(args, tokenizer) -> list[int]:
    if args.system is not None and not args.chat:
        raise MlxbunError("--system needs --chat")
    if args.prompt_ids is not None:
        if args.chat:
            raise MlxbunError("--chat applies to --prompt text, not --prompt-ids")
        return _parse_ids(args.prompt_ids)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        return _chat_prompt(tokenizer, text, args.system, continuing=args.prompt_cache is not None)
    if args.prompt_cache is not None:
        return tokenizer.encode(text, add_special_tokens=False)  # the cache holds the prefix (and BOS)
    return tokenizer.encode_prompt(text)


# ----------------------------------------------------------------------------- run


def run(args) -> int:
    from mlxbun.parallel import primary_output, tensor_group

    group = tensor_group(args.tp)
    if group is not None:
        for flag in ("prompt_cache", "save_prompt_cache"):
            if getattr(args, flag) is not None:
                raise MlxbunError(f"--{flag.replace('_', '-')} under tensor parallelism: each rank holds its own "
                                  "heads' part of the cache (run with --tp 1 to use prompt caches)")
    with primary_output():
        return _run(args, group)


def _run(args, group) -> int:
    from mlxbun.cache.prompt_cache import check_save_path
    from mlxbun.generate import check_token_ids, stream_generate, vocab_size_of
    from mlxbun.generation_caches import (NO_KV_CONFIG, KVHeadDimError, check_kv_config_file, kv_layers,
                                          make_generation_cache, model_identity_of)
    from mlxbun.locate import locate, open_runtime
    from mlxbun.tokenizer import load_tokenizer

    _apply_kv_setting(args)
    media = (args.image, args.audio, getattr(args, "video", None))
    if any(m is not None for m in media):  # a tower (commands/image_flags.py): refusals first
        from mlxbun.commands.image_flags import check_image_flags, run_audio, run_images

        check_image_flags(args)
        return (run_images if args.audio is None else run_audio)(args, locate(args.model))
    if args.prompt_ids is not None:
        _parse_ids(args.prompt_ids)  # before the model loads (build_prompt parses them again)
    if args.kv_config not in (None, NO_KV_CONFIG):
        check_kv_config_file(args.kv_config, "--kv-config")
    if args.prompt_cache is not None:
        _prompt_cache_file(args.prompt_cache)
    if args.prompt_cache is not None and args.max_kv_size is not None:
        raise MlxbunError("--prompt-cache brings its own caches; --max-kv-size cannot change them")
    if args.save_prompt_cache is not None:  # where the cache goes, before any work
        try:
            check_save_path(args.save_prompt_cache)
        except MlxbunError as e:
            raise MlxbunError(f"--save-prompt-cache {e}") from None
    check_spec_results(args)
    path = locate(args.model)
    model = open_runtime(path, parse_engine(args.engine, what="--engine/--backend"), tensor_group=group)
    if args.save_prompt_cache is not None and model_identity_of(model) is None:
        raise MlxbunError(f"--save-prompt-cache: {path} has no mlxbun config to record with the cache")
    tokenizer = load_tokenizer(path)
    prompt = build_prompt(args, tokenizer)
    if args.prompt_ids is not None:
        check_token_ids(prompt, vocab_size_of(model), "--prompt-ids")
    profile = getattr(model, "profile", None)
    if profile is not None and profile.execution.loop != "autoregressive":
        if args.fast:
            raise MlxbunError(f"--fast: {args.model} decodes by diffusion; the fast path covers autoregressive "
                              "decoding only")
        return _run_diffusion(args, model, tokenizer, prompt)

    kv = dict(kv_bits=whole(args.kv_bits), kv_group_size=args.kv_group_size,
              kv_scheme=args.kv_scheme, quantized_kv_start=args.quantized_kv_start,
              kv_key_bits=args.kv_key_bits, kv_value_bits=args.kv_value_bits)
    plan, from_checkpoint = _kv_plan(args, model, kv)
    prior: list[int] = []  # tokens a loaded prompt cache already holds
    if args.prompt_cache is not None:
        cache, prior = _load_cache(args.prompt_cache, model, kv)
    elif args.save_prompt_cache is not None:
        cache = make_generation_cache(model, kv_config=args.kv_config, max_kv_size=args.max_kv_size, **kv)
    else:
        cache = None

    spec = spec_requested(args)
    fast = _fast_path(args, model)
    if spec:
        stream = run_spec_from_args(args, model, tokenizer, prompt, fast=fast or False)
    else:
        stream = stream_generate(
            model, tokenizer, prompt,
            max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, min_tokens_to_keep=args.min_tokens_to_keep, seed=args.seed,
            repetition_penalty=args.repetition_penalty, repetition_context_size=args.repetition_context_size,
            kv_config=args.kv_config,
            max_kv_size=args.max_kv_size if cache is None else None,
            prompt_cache=cache, stop=args.stop, prefill_step_size=args.prefill_step_size, fast=fast or False, **kv,
        )
    if from_checkpoint and not args.json:  # (the plan passed the stream's checks)
        print(f"KV: the checkpoint's per-layer plan {plan.source} ({plan.describe()}); "
              "--kv-config none to opt out", file=sys.stderr)
    coverage = kv_layers(model, kv_bits=kv["kv_bits"], kv_scheme=kv["kv_scheme"], plan=plan)
    setting = KVSettings.from_flags(**kv)  # (the stream has checked these options)
    say_kv = (plan is not None or kv["kv_bits"] is not None) and not args.json
    text, tokens, last = "", [], None
    try:
        for last in stream:
            if say_kv:  # once the first token is out: the caches passed the first quantize point
                what = f" ({setting.label})" if plan is None else ""
                print(f"KV: quantized on {coverage.describe()}{what}", file=sys.stderr)
                say_kv = False
            text += last.text
            tokens.append(last.token)
            if not args.json:
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except KVHeadDimError as e:
        raise MlxbunError(f"{e}{zoo_hint(args.model, e.group_size)}") from None
    spec_info = finish_spec_from_args(args, last, model, tokenizer, prompt, model_path=path) if spec else None
    if args.save_prompt_cache is not None:
        # Every yielded token (EOS included) has been fed to the cache: it holds prior + prompt + tokens.
        _save_cache(args.save_prompt_cache, cache, model, path, prior + prompt + tokens)

    if fast is not None:
        fast.collect_kernel_gaps()
        if not args.json:
            for line in [fast.describe(), *fast.notes]:
                print(f"fast: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "text": text,
            "tokens": tokens,
            "finish_reason": last.finish_reason,
            "prompt_tokens": last.prompt_tokens,
            "prompt_tps": last.prompt_tps,
            "generation_tokens": last.generation_tokens,
            "generation_tps": last.generation_tps,
            "peak_memory_gb": last.peak_memory,
            "kv_config": None if plan is None else {
                "file": plan.source, "from_checkpoint": from_checkpoint,
                "layers": [{"layer_idx": i, "bits": b, "group_size": g} for i, (b, g) in plan.layers.items()]},
            "kv": str(setting),
            "kv_layers": list(coverage.layers),
            **({"spec": spec_info} if spec else {}),
            **({"tensor_parallel": {"ranks": group.size()}} if group is not None else {}),
            **({"fast": {"fidelity": FAST_FIDELITY, "path": fast.describe(), "notes": fast.notes}}
               if fast is not None else {}),
        }))
    else:
        sys.stdout.write("\n")
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec", file=sys.stderr)
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec",
              file=sys.stderr)
        print(f"Peak memory: {last.peak_memory:.3f} GB", file=sys.stderr)
        if group is not None:
            print(f"Tensor parallel: split across {group.size()} ranks (peak memory: rank 0's)", file=sys.stderr)
    return 0


def _fast_path(args, model):
    """The model's FastPath for --fast (None without it); refused where it cannot apply."""
    if not args.fast:
        return None
    if parse_engine(args.engine, what="--engine/--backend") != "mlxbun":
        raise MlxbunError(f"--fast runs mlxbun's own graphs; --engine {args.engine} has no fast path")
    return enable_fast(model)


def _kv_plan(args, model, kv: dict):
    """(the per-layer KV plan the run uses or None, whether it is the checkpoint's own default);
    `args.kv_config` becomes that plan, or "none" (None would ask the library for the default)."""
    from mlxbun.generation_caches import NO_KV_CONFIG, load_kv_plan, resolve_kv_config

    given = args.kv_config
    plan = resolve_kv_config(model, given, kv_bits=kv["kv_bits"], kv_scheme=kv["kv_scheme"],
                             max_kv_size=args.max_kv_size)
    if plan is not None:
        plan = load_kv_plan(plan, len(model.make_cache()))
    args.kv_config = NO_KV_CONFIG if plan is None else plan
    return plan, plan is not None and given is None


def zoo_hint(model: str, group_size: int, flag: str = "--model ") -> str:
    """For a zoo model whose heads the zoo can widen, the wide form of its name whose head dim the
    group size divides (none where the build would refuse it: MLA heads, no head_dim setting);
    `flag`: what precedes the name in the advice (kv-plan takes it as its argument)."""
    from mlxbun.zoo import ZooArgumentError, check_head_dim

    spec = parse_model(model)
    if spec.kind != "zoo":
        return ""
    try:
        check_head_dim(spec.value, group_size)
    except ZooArgumentError as e:
        return f"; {e}"
    except MlxbunError:  # an arch outside the dense table (its own builder): no hint
        return ""
    return f"; the zoo builds wider heads on request: {flag}{replace(spec, head_dim=group_size)}"


_KV_FLAGS = {"kv_bits": None, "kv_group_size": 64, "kv_scheme": "uniform", "quantized_kv_start": 0,
             "kv_key_bits": None, "kv_value_bits": None}


def _apply_kv_setting(args) -> None:
    """`--kv NAME` fills the KV flags (which must then stay at their defaults); a TurboQuant
    key/value split given by flags alone gets its mean width as --kv-bits."""
    if args.kv is None:
        if args.kv_key_bits is not None or args.kv_value_bits is not None:
            args.kv_bits = KVSettings.from_flags(
                kv_bits=whole(args.kv_bits), kv_group_size=args.kv_group_size, kv_scheme=args.kv_scheme,
                quantized_kv_start=args.quantized_kv_start, kv_key_bits=args.kv_key_bits,
                kv_value_bits=args.kv_value_bits).bits
        return
    given = [f"--{k.replace('_', '-')}" for k, default in _KV_FLAGS.items() if getattr(args, k) != default]
    if given:
        raise MlxbunError(f"--kv {args.kv} already sets the KV cache; drop {', '.join(given)}")
    for key, value in parse_kv(args.kv).as_options().items():
        setattr(args, key, value)


_AUTOREGRESSIVE_ONLY = ("kv_bits", "kv_key_bits", "kv_value_bits", "kv_config", "max_kv_size", "prompt_cache",
                        "save_prompt_cache", "stop", "repetition_penalty", "draft")


def _run_diffusion(args, model, tokenizer, prompt) -> int:
    from mlxbun.generation_caches import NO_KV_CONFIG

    used = [n for n in _AUTOREGRESSIVE_ONLY if getattr(args, n) is not None
            and not (n == "kv_config" and args.kv_config == NO_KV_CONFIG)]
    if used:
        flags = ", ".join("--" + n.replace("_", "-") for n in used)
        raise MlxbunError(f"{flags}: autoregressive-only options; {model.profile.id} decodes by diffusion")
    out = run_diffusion(args, model, tokenizer, prompt)
    if args.json:
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        d = out["diffusion"]
        print(f"Generation: {out['generation_tokens']} tokens, {out['generation_tps']:.3f} tokens-per-sec, "
              f"{d['denoising_steps']} denoising steps, {d['tokens_per_forward']:.2f} tokens per forward",
              file=sys.stderr)
    return 0


def _prompt_cache_file(file: str) -> Path:
    p = Path(file).expanduser()
    if p.is_dir():
        raise MlxbunError(f"--prompt-cache {file}: is a directory; give a prompt-cache file (--save-prompt-cache "
                          "writes one)")
    if not p.is_file():
        raise MlxbunError(f"--prompt-cache {file}: no such file")
    return p


def _load_cache(file: str, model, kv: dict) -> tuple[list, list[int]]:
    from mlxbun.cache.prompt_cache import cached_tokens
    from mlxbun.generation_caches import load_prompt_cache_for

    p = _prompt_cache_file(file)
    cache, metadata = load_prompt_cache_for(model, p)
    bits = getattr(cache[0], "bits", None) if cache else None
    if bits is not None:  # mlx-lm's check: the options must describe the cache as saved
        if kv["kv_bits"] is not None and kv["kv_bits"] != bits:
            raise MlxbunError(f"--kv-bits {kv['kv_bits']} does not match the {bits}-bit cache in {file}")
        group = getattr(cache[0], "group_size", None)
        if group is not None and kv["kv_group_size"] != group:
            raise MlxbunError(f"--kv-group-size {kv['kv_group_size']} does not match the cache in {file} ({group})")
    return cache, cached_tokens(metadata) or []


def _save_cache(file: str, cache: list, model, model_path: Path, tokens: list[int]) -> None:
    from mlxbun.cache.prompt_cache import save_prompt_cache
    from mlxbun.generation_caches import model_identity_of

    save_prompt_cache(Path(file).expanduser(), cache, {"model": str(model_path)},
                      model_identity=model_identity_of(model), tokens=tokens)
