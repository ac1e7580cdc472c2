"""What rollback costs speculative decoding on a hybrid target, against acceptance.

A recurrent state cannot be trimmed: when the target rejects a draft, the engine restores the
recurrent caches to the round's start and replays the n + 1 kept tokens, through the recurrent
mixers alone (`rollback="mixers"`, the default) or the whole target (`"model"`). Two measurements:

1. The sweep: the target fixed, acceptance moved by the draft (the target's own weights with
   multiplicative noise of growing size; `noise` 0: the draft is the target, every draft accepted,
   nothing replayed), greedy, draft model drafter, both rollbacks. Per row: acceptance, replays
   per round, replayed tokens per generated token, the replay's share of the round time (draft +
   verify + replay), one replay's time over one verify forward's, and tokens/s over plain
   decoding's. An attention-only target of the same size (llama) under the same drafts is the
   no-rollback reference.
2. One rollback in isolation: a verify forward of 7 tokens on a prefilled cache, then the commit
   keeping n + 1 of them and the replay, timed until the states are evaluated (best of trials:
   the least disturbed by other jobs on a shared machine).

    python benchmarks/spec_hybrid_rollback.py --out benchmarks/spec-hybrid-rollback.md

Models: `mlx-lm:ARCH` are the tiny in-process mlx-lm models of tests/hybrid_models.py (hidden 64,
2-4 layers, vocab 256, random weights); any other name goes through `mlxbun.locate` (a checkpoint
directory, `zoo:ARCH`). Absolute CPU times of tiny models are only indicative (per-call overhead
dominates, and this machine is shared); read the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxbun.generate import stream_generate  # noqa: E402
from mlxbun.speculative import DraftModelDrafter, speculative_generate  # noqa: E402
from tests.hybrid_models import IdTokenizer, open_hybrid  # noqa: E402

TOK = IdTokenizer()
NOISES = (0.0, 0.01, 0.05, 0.2)


def open_named(name: str, seed: int = 0):
    if name.startswith("mlx-lm:"):
        return open_hybrid(name, seed)
    from mlxbun.locate import open_runtime

    return open_runtime(name, "mlxbun")


def noisy_copy(name: str, noise: float):
    """The target's weights (seed 0) times (1 + noise * N(0, 1)), the noise keyed by name."""
    draft = open_named(name)
    module = getattr(draft, "module", draft)

    def jitter(path, p):
        if noise == 0 or not mx.issubdtype(p.dtype, mx.floating):
            return p
        key = mx.random.key(int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "little"))
        return p * (1 + noise * mx.random.normal(p.shape, key=key))

    module.update(tree_map_with_path(jitter, module.parameters()))
    mx.eval(module.parameters())
    return draft


def prompts(n: int) -> list[list[int]]:
    return [[(a * i * i + b * i) % 250 + 3 for i in range(24)] for a, b in ((7, 3), (13, 5), (3, 11))[:n]]


def run(target, draft, prompt, k, max_tokens, repeats, rollback):
    """(SpecStats of the fastest repeat, plain tokens/s median, same tokens as plain)."""
    plain_ids, plain_tps, best = None, [], None
    for _ in range(repeats):
        out = list(stream_generate(target, TOK, prompt, max_tokens=max_tokens))
        plain_ids = [r.token for r in out]
        plain_tps.append(out[-1].generation_tps)
        spec = list(speculative_generate(target, TOK, prompt, drafter=DraftModelDrafter(draft), num_draft=k,
                                         max_tokens=max_tokens, rollback=rollback))
        stats = spec[-1].stats
        same = [r.token for r in spec] == plain_ids
        if best is None or stats.wall_s < best[0].wall_s:
            best = (stats, same)
    return best[0], statistics.median(plain_tps), best[1]


def sweep(models, ks, max_tokens, repeats, n_prompts):
    rows = []
    for name in models:
        target = open_named(name)
        recurrent = any(type(c).__name__ in ("ArraysCache", "CacheList") for c in target.make_cache())
        for noise in NOISES:
            draft = noisy_copy(name, noise)
            for rollback in (("mixers", "model") if recurrent else ("-",)):
                for k in ks:
                    for p_i, prompt in enumerate(prompts(n_prompts)):
                        stats, plain_tps, same = run(target, draft, prompt, k, max_tokens, repeats,
                                                     "mixers" if rollback == "-" else rollback)
                        rows.append(dict(model=name, rollback=rollback, noise=noise, k=k, prompt=p_i, stats=stats,
                                         plain_tps=plain_tps, same=same))
                        print(f"{name} {rollback} noise={noise} k={k} p={p_i}: acc {stats.draft_acceptance_rate:.2f} "
                              f"replayed {stats.replayed_tokens} in {stats.replay_s:.3f}s", file=sys.stderr)
    return rows


def rollback_cost(name: str, kept: int, rollback: str, fed: int = 7, trials: int = 30) -> float:
    """Best-of-trials ms of one rollback keeping `kept` of `fed` verified tokens, states evaluated."""
    from mlxbun.cache.arrays import begin_spec_round, commit_spec_round
    from mlxbun.generation_caches import make_generation_cache
    from mlxbun.speculative.drafters import model_blocks
    from mlxbun.speculative.replay import MixerReplay

    target = open_named(name)
    ids = mx.array([[(11 * i + 5) % 250 for i in range(fed)]])
    mixers = MixerReplay(target, model_blocks(target)) if rollback == "mixers" else None
    times = []
    with mixers.attach(lambda: make_generation_cache(target)) if mixers else nullcontext():
        for _ in range(trials):
            cache = make_generation_cache(target)
            target(mx.array([list(range(3, 23))]), cache=cache)
            mx.eval([c.state for c in cache])
            begin_spec_round(cache)
            mx.eval((mixers.verify if mixers else target)(ids, cache=cache), [c.state for c in cache])
            t0 = time.perf_counter()
            if mixers:
                mixers.commit(cache, kept, fed)
            elif commit_spec_round(cache, kept):
                target(ids[:, :kept], cache=cache)
            mx.eval([c.state for c in cache])
            times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def cost_table(models) -> list[str]:
    lines = ["| model | kept tokens (of 7) | rollback=model (ms) | rollback=mixers (ms) | mixers / model |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name in models:
        for kept in (1, 3, 5):
            full, mix = rollback_cost(name, kept, "model"), rollback_cost(name, kept, "mixers")
            lines.append(f"| {name} | {kept} | {full:.3f} | {mix:.3f} | {mix / full:.2f} |")
    return lines


def replay_head_check(name: str, vocab: int, tokens: int = 4, trials: int = 30) -> list[str]:
    """A replay's forward evaluates only the cache states (the engine drops its logits): MLX's lazy
    graph then never runs the LM head. Best-of-trials ms of a `tokens`-token forward on a prefilled cache,
    evaluating the caches only vs the logits too, at a vocabulary where the head dominates."""
    from mlxbun.generation_caches import make_generation_cache
    from mlxbun.zoo.weights import build_model
    from tests.hybrid_models import tiny_config

    arch = name.partition(":")[2]
    model = build_model({**tiny_config(arch), "vocab_size": vocab}, 0)
    ids = mx.array([list(range(tokens))])

    def median_ms(with_logits: bool) -> float:
        times = []
        for _ in range(trials):
            cache = make_generation_cache(model)
            model(mx.array([list(range(20))]), cache=cache)
            mx.eval([c.state for c in cache])
            t0 = time.perf_counter()
            out = model(ids, cache=cache)
            mx.eval([c.state for c in cache] + ([out] if with_logits else []))
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    caches, logits = median_ms(False), median_ms(True)
    return [f"| {name} | {vocab} | {tokens} | {caches:.2f} | {logits:.2f} | {caches / logits:.2f} |"]


def reading(rows, costs) -> list[str]:
    """The commentary under the table, from its numbers."""
    from mlxbun.speculative import SpecStats

    def agg(model, rollback, noise=None):
        return SpecStats.aggregate(r["stats"] for r in rows if r["model"] == model and r["rollback"] == rollback
                                   and (noise is None or r["noise"] == noise))

    out = ["Reading it: every run's greedy tokens equal plain decoding's (`same`) "
           f"({'all' if all(r['same'] for r in rows) else 'NOT all'} {len(rows)} runs). The counts are exact; "
           "the times are not (tokens/s over plain swings by tens of percent between repeats here, and "
           "a draft model as large as its target cannot speed these tiny models up)."]
    worst = max(r["noise"] for r in rows)
    for model in dict.fromkeys(r["model"] for r in rows if r["rollback"] != "-"):
        full, mix = agg(model, "model"), agg(model, "mixers")
        hard_full, hard_mix = agg(model, "model", worst), agg(model, "mixers", worst)
        ratio = [float(c.split("|")[5]) for c in costs[2:] if c.split("|")[1].strip() == model]
        out.append(f"- {model}: {full.replayed_tokens / full.generated_tokens:.2f} tokens replayed per generated "
                   f"token over the sweep ({hard_full.replayed_tokens / hard_full.generated_tokens:.2f} at noise "
                   f"{worst}, acceptance {hard_full.draft_acceptance_rate:.2f}); the replay takes "
                   f"{hard_full.replay_time_fraction:.0%} of the round time with rollback=model and "
                   f"{hard_mix.replay_time_fraction:.0%} with rollback=mixers at that noise; one rollback in "
                   f"isolation costs the mixers {min(ratio):.2f}-{max(ratio):.2f} of the whole-model replay.")
    return out


def table(rows) -> list[str]:
    from mlxbun.speculative import SpecStats

    lines = ["| model | rollback | draft noise | k | acceptance | replays / round | replayed tok / generated | "
             "replay share of round time | replay / verify forward | tokens/s vs plain | same |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["rollback"], r["noise"], r["k"]), []).append(r)
    for (model, rollback, noise, k), rs in groups.items():
        s = SpecStats.aggregate(r["stats"] for r in rs)
        per_verify = s.verify_s / s.rounds
        per_replay = s.replay_s / s.replays if s.replays else float("nan")
        speed = statistics.median(r["stats"].tokens_per_s / r["plain_tps"] for r in rs)
        lines.append(f"| {model} | {rollback} | {noise} | {k} | {s.draft_acceptance_rate:.2f} | {s.replays / s.rounds:.2f} | "
                     f"{s.replayed_tokens / s.generated_tokens:.2f} | {s.replay_time_fraction:.2f} | "
                     f"{per_replay / per_verify:.2f} | {speed:.2f} | {all(r['same'] for r in rs)} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["mlx-lm:lfm2", "mlx-lm:qwen3_next", "mlx-lm:nemotron_h",
                                                     "mlx-lm:llama"])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = sweep(args.models, args.k, args.max_tokens, args.repeats, args.prompts)
    costs = cost_table([m for m in args.models if m != "mlx-lm:llama"])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python benchmarks/spec_hybrid_rollback.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        "# Speculative decoding on hybrids: rollback cost vs acceptance (CPU, tiny models)", "",
        f"Machine: {platform.machine()}, mlx {mx.__version__} ({mx.default_device()}), mlxbun at git:{commit}.", "",
        f"Command: `{command.strip()}`", "",
        f"Greedy, draft model drafter, {args.max_tokens} tokens per prompt, {args.prompts} prompts per row (counts "
        f"summed; tokens/s ratio: the median over prompts of the fastest of {args.repeats} repeats over plain "
        "decoding's median). Draft = the target's weights x (1 + noise * N(0, 1)). `replay / verify forward`: "
        "the mean time of one replay forward over one verify forward. Absolute CPU times of these tiny models "
        "are only indicative (shared 2-core machine, per-call overhead dominates); the ratios are the reading.",
        "", *table(rows), "", *reading(rows, costs), "",
        "## One rollback in isolation", "",
        "A verify forward of 7 tokens on a 20-token cache, then the commit keeping n + 1 of them and the "
        "replay, timed until the cache states are evaluated; best of 30 trials.", "",
        *costs, "",
        "## The replay skips the LM head", "",
        "The engine evaluates only the cache states after a replay forward, so MLX never computes its logits: "
        f"the LM head (and any layer after the last cached one) is free. Best of 30 forwards of 4 tokens on a "
        "prefilled cache, the vocabulary raised so that the head dominates:", "",
        "| model | vocab | tokens | caches only (ms) | caches + logits (ms) | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *[line for name in args.models if name.startswith("mlx-lm:") and name != "mlx-lm:llama"
          for line in replay_head_check(name, 65536)], ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
