"""What spec_acceptance.ipynb computes: a drafter x k sweep over a named prompt set, against
plain decoding on the same prompts, with rows in the results table, plots, and the CPU
benchmark table (`benchmarks/spec-cpu.md`).

    sweep = spec_sweep("zoo:llama", ["ngram", "self:1", "model:zoo:llama@q8"], ks=(1, 2, 4))
    sweep.summary()          # one row per drafter x k (aggregated over the prompts)
    per_position_plot(sweep); acceptance_length_plot(sweep); speedup_plot(sweep)

Drafters are named as `mlxbun.names.parse_drafter` reads them: "ngram[:N]" (prompt lookup),
"self[:L]" (the target's first L blocks), "model:MODEL" (a draft model, e.g. "model:zoo:llama@q8"
or "model:zoo:llama,seed=1"). With temperature 0, `SpecSweep.require_same_as_plain()` fails when
any run's tokens differ from plain decoding's (the notebook ends with it).

Command line (the CPU benchmark table):
    python -m mlxbun.experiments.spec_acceptance --out benchmarks/spec-cpu.md
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.generate import prepare_prompt, vocab_size_of
from mlxbun.lab.plots import figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.names import parse_drafter
from mlxbun.results.identity import environment
from mlxbun.speculative import make_drafter, speculative_text
from mlxbun.speculative.compare import plain_run
from mlxbun.speculative.stats import SpecStats

__all__ = [
    "DEFAULT_DRAFTERS", "PROMPT_SET", "SPEC_PROMPTS", "SpecSweep", "acceptance_length_plot", "draft_length",
    "per_position_plot",
    "spec_sweep", "speedup_plot", "write_cpu_benchmark",
]

EXPERIMENT = "spec_acceptance"

# The prompt set "spec-zoo-v1": short texts, most with repeated spans (so prompt lookup has
# something to find), one without. Names are stable: results rows carry them.
PROMPT_SET = "spec-zoo-v1"
SPEC_PROMPTS: dict[str, str] = {
    "repeat-sentence": ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
                        "The quick brown fox"),
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a",
    "list": "apples, pears, plums, apples, pears, plums, apples, pears, plums, apples,",
    "qa": ("Question: What is the capital of France? Answer: Paris. Question: What is the capital of Italy? "
           "Answer: Rome. Question: What is the capital of Spain? Answer:"),
    "story": "Once upon a time there was a little cat that lived in a small house near the river.",
}

DEFAULT_DRAFTERS = ("ngram", "self:1", "model:zoo:llama@q8", "model:zoo:llama@seed1")


def draft_length(k) -> tuple[int, bool]:
    """A sweep's k: an int (a fixed draft length) or "aK" (AdaptiveDraftLength with k_max K) ->
    (k or k_max, adaptive)."""
    text = str(k).strip()
    adaptive = text.startswith("a")
    digits = text[1:] if adaptive else text
    if isinstance(k, bool) or not digits.isdigit() or int(digits) < 1:
        raise MlxbunError(f"ks: each k must be a positive integer or 'aK' (adaptive, k_max K), got {k!r}")
    return int(digits), adaptive


def _drafter_factories(drafters: Sequence[str], engine: str) -> dict:
    """drafter name -> a function making a fresh Drafter; every name is parsed (a bad one refuses
    before any work) and each draft model is opened once."""
    out = {}
    for d in drafters:
        spec = parse_drafter(d)
        if spec.kind == "model":
            model = open_runtime(spec.model, engine)
            out[d] = lambda model=model, label=str(spec.model): make_drafter(model, label=label)
        else:
            out[d] = lambda spec=spec: make_drafter(spec)
    return out


# ---------------------------------------------------------------- the sweep


STAT_COLUMNS = ["drafts", "draft_tokens", "accepted_tokens", "draft_acceptance_rate", "mean_acceptance_length",
                "tokens_per_s", "plain_tokens_per_s", "speedup", "decode_tokens_per_s", "plain_decode_tokens_per_s",
                "decode_speedup", "speedup_bound", "cost_aware_bound", "verify_cost", "draft_s", "verify_s",
                "replayed_tokens", "replay_s"]  # replay: a recurrent target's rollback
ROW_COLUMNS = ["drafter", "k", "prompt", *STAT_COLUMNS, "same_as_plain"]


@dataclass
class SpecSweep:
    """Everything spec_acceptance.ipynb shows. `runs` maps (drafter, k, prompt) to SpecStats."""

    model: str
    prompt_set: str
    prompts: dict
    drafters: list
    ks: list
    temperature: float
    runs: dict = field(default_factory=dict)
    same: dict = field(default_factory=dict)  # (drafter, k, prompt) -> greedy tokens == plain's
    run_id: str | None = None

    def stats(self, drafter: str, k: int):
        """The SpecStats of one drafter x k, aggregated over the prompts."""
        return SpecStats.aggregate(self.runs[(drafter, k, p)] for p in self.prompts)

    def table(self):
        """One row per drafter x k x prompt."""
        rows = []
        for (d, k, p), s in self.runs.items():
            rows.append([d, k, p, *(getattr(s, c) for c in STAT_COLUMNS), self.same.get((d, k, p))])
        return pd.DataFrame(rows, columns=ROW_COLUMNS)

    def summary(self):
        """One row per drafter x k, aggregated over the prompt set."""
        rows = []
        for d in self.drafters:
            for k in self.ks:
                s = self.stats(d, k)
                same = [self.same.get((d, k, p)) for p in self.prompts]
                rows.append([d, k, len(self.prompts), *(getattr(s, c) for c in STAT_COLUMNS),
                             None if None in same else all(same)])
        return pd.DataFrame(rows, columns=["drafter", "k", "prompts"] + ROW_COLUMNS[3:])

    def per_position(self):
        """Long table: drafter, k, position, acceptance rate (vLLM's per-position rate)."""
        rows = [(d, k, i, r) for d in self.drafters for k in self.ks
                for i, r in enumerate(self.stats(d, k).acceptance_per_position)]
        return pd.DataFrame(rows, columns=["drafter", "k", "position", "acceptance_rate"])

    def histogram(self):
        """Long table: drafter, k, acceptance length (1 + accepted), rounds."""
        rows = [(d, k, a, n) for d in self.drafters for k in self.ks
                for a, n in sorted(self.stats(d, k).acceptance_length_histogram.items())]
        return pd.DataFrame(rows, columns=["drafter", "k", "acceptance_length", "rounds"])

    def require_same_as_plain(self) -> None:
        """Greedy speculative decoding must emit plain decoding's tokens: refuse (naming the
        drafter, k and prompt) when any run did not. Nothing to check when sampling."""
        bad = [f"{d} k={k} prompt {p!r}" for (d, k, p), same in self.same.items() if not same]
        if bad:
            raise MlxbunError(f"greedy speculative output differs from plain decoding ({len(bad)} of "
                              f"{len(self.same)} runs): {'; '.join(bad[:5])}")


def _median_run(fn, repeats: int):
    """Run `fn` `repeats` times; return the result with the median wall time."""
    results = [fn() for _ in range(max(1, repeats))]
    walls = [r[-1] for r in results]
    return results[walls.index(statistics.median_low(walls))]


def spec_sweep(model: str = "zoo:llama", drafters: Sequence[str] = DEFAULT_DRAFTERS, ks: Sequence[int] = (1, 2, 4), *,
               prompts: dict | None = None, prompt_set: str | None = None, max_tokens: int = 16,
               variant: str = "float32", engine: str = "mlxbun", temperature: float = 0.0, seed: int = 0,
               repeats: int = 1, results_path=None, record: bool = True, experiment: str = EXPERIMENT,
               extra_params: dict | None = None, fast: bool = False) -> SpecSweep:
    """Every drafter x k on every prompt, against plain decoding of the same prompt.

    Plain decoding runs first per prompt (after one untimed warm-up generation); tokens/s are
    end to end (prefill included) for both, the median of `repeats` runs. With temperature 0
    each run's tokens are checked against plain decoding's (`same_as_plain`). Rows go to the
    results table (`experiment`, default "spec_acceptance"; `extra_params` join the run's
    parameters): every `SpecStats` row per drafter x k x prompt, plus `plain_tokens_per_s` and
    `same_as_plain` (1/0). A k may be "aK": the adaptive draft length with k_max K. `fast`: plain
    and speculative decoding both on the target's fast path (L2-fast: `same_as_plain` then holds
    the speculative tokens to the fast path's plain decode).
    """
    if prompts is None:
        prompts, prompt_set = dict(SPEC_PROMPTS), prompt_set or PROMPT_SET
    prompt_set = prompt_set or "custom"
    ks = [k if draft_length(k)[1] else int(k) for k in ks]  # "aK": adaptive (refused here when malformed)
    drafters = [str(d) for d in drafters]
    path = model_path(model, variant=variant)
    factories = _drafter_factories(drafters, engine)
    target = open_runtime(path, engine)
    tok = optional_tokenizer(path)
    if tok is None:
        raise MlxbunError(f"{path}: no tokenizer to encode the prompts")
    vocab = vocab_size_of(target)
    for pname, prompt in prompts.items():  # every prompt, before any run
        try:
            prepare_prompt(tok, prompt, vocab)
        except MlxbunError as e:
            raise MlxbunError(f"prompt {pname!r}: {e}") from None
    sampling = dict(max_tokens=max_tokens, temperature=temperature, seed=seed, fast=fast)
    out = SpecSweep(str(model), prompt_set, dict(prompts), drafters, ks, temperature)
    params = {"model": str(model), "variant": variant, "engine": engine, "prompt_set": prompt_set,
              "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "repeats": repeats,
              **({"fast": True} if fast else {}), **(extra_params or {})}
    with recording(experiment, model=path, params=params, results_path=results_path, record=record) as run:
        plain_run(target, tok, next(iter(prompts.values())), **sampling)  # warm-up (compiled samplers, allocator)
        for pname, text in prompts.items():
            def plain_once():
                r = plain_run(target, tok, text, **sampling)
                return r, r.wall_s

            plain = _median_run(plain_once, repeats)[0]
            if run is not None:
                run.record("plain_tokens_per_s", plain.tokens_per_s, "tok/s", prompt=pname)
                run.record("plain_decode_tokens_per_s", plain.decode_tokens_per_s, "tok/s", prompt=pname)
            for d in drafters:
                for k in ks:
                    def once():
                        num_draft, adaptive = draft_length(k)
                        _, ids, stats = speculative_text(target, tok, text, drafter=factories[d](),
                                                         num_draft=num_draft, adaptive=adaptive, **sampling)
                        return ids, stats, stats.wall_s

                    ids, stats, _ = _median_run(once, repeats)
                    stats.plain_tokens_per_s = plain.tokens_per_s
                    if plain.decode_tokens_per_s == plain.decode_tokens_per_s:  # not NaN
                        stats.plain_decode_tokens_per_s = plain.decode_tokens_per_s
                    out.runs[(d, k, pname)] = stats
                    if temperature == 0:
                        out.same[(d, k, pname)] = ids == plain.tokens
                    if run is not None:
                        extra = {"drafter": d, "k": k, "prompt": pname}
                        stats.record(run, **extra)
                        if temperature == 0:
                            run.record("same_as_plain", float(out.same[(d, k, pname)]), None, **extra)
        if run is not None:
            out.run_id = run.run_id
    return out


# ---------------------------------------------------------------- plots


def per_position_plot(sweep: SpecSweep, title: str = "acceptance rate per draft position"):
    """One panel per drafter, one line per k: accepted at position i over draft rounds."""
    df = sweep.per_position()
    fig = figure(3.2 * len(sweep.drafters), 3.2)
    axes = fig.subplots(1, len(sweep.drafters), sharey=True, squeeze=False)[0]
    for ax, d in zip(axes, sweep.drafters):
        for k in sweep.ks:
            g = df[(df.drafter == d) & (df.k.astype(str) == str(k))]
            ax.plot(g.position + 1, g.acceptance_rate, marker="o", label=f"k={k}")
        ax.set_title(d, fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_xticks(range(1, max(draft_length(k)[0] for k in sweep.ks) + 1))
        ax.set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("acceptance rate")
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    return fig


def acceptance_length_plot(sweep: SpecSweep, k: int | None = None,
                           title: str = "acceptance length per round (1 + accepted drafts)"):
    """Histogram (share of rounds) of the acceptance length, one bar group per drafter, at k
    (default: the largest k of the sweep)."""
    k = max((k for k in sweep.ks if not draft_length(k)[1]), default=sweep.ks[0]) if k is None else k
    df = sweep.histogram()
    df = df[df.k.astype(str) == str(k)]
    fig = figure(7, 3.4)
    ax = fig.subplots()
    lengths = np.arange(1, draft_length(k)[0] + 2)
    width = 0.8 / max(1, len(sweep.drafters))
    for i, d in enumerate(sweep.drafters):
        g = df[df.drafter == d].set_index("acceptance_length")["rounds"].reindex(lengths, fill_value=0)
        total = g.sum()
        ax.bar(lengths + i * width - 0.4 + width / 2, g / total if total else g, width, label=d)
    ax.set_xticks(lengths)
    ax.set_xlabel("acceptance length")
    ax.set_ylabel("share of draft rounds")
    ax.set_title(f"{title}, k={k}")
    ax.legend(fontsize=7)
    return fig


def speedup_plot(sweep: SpecSweep, title: str = "end-to-end speedup vs plain decoding"):
    """Speedup (tokens/s over plain decoding's, aggregated over the prompts) against k."""
    df = sweep.summary()
    fig = figure(6, 3.4)
    ax = fig.subplots()
    fixed = df[[not draft_length(k)[1] for k in df.k]]
    for d in sweep.drafters:
        g = fixed[fixed.drafter == d]
        ax.plot(g.k.astype(int), g.speedup, marker="o", label=d)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("draft tokens per round (k)")
    ax.set_ylabel("speedup (x)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


# ---------------------------------------------------------------- the CPU benchmark table


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def benchmark_markdown(sweep: SpecSweep, command: str) -> str:
    import mlx.core as mx

    env = environment()
    df = sweep.summary()
    lines = [
        "# Speculative decoding on CPU: zoo checkpoints",
        "",
        f"Machine: {platform.machine()} {env.get('cpu') or platform.processor()}, {env.get('cpu_count')} cores "
        f"(shared with other jobs), mlx {mx.__version__} ({env.get('backend')}), mlxbun at "
        f"{env.get('revision') or 'unknown revision'}.",
        "",
        f"Command: `{command}`",
        "",
        f"Target `{sweep.model}`; prompt set `{sweep.prompt_set}` ({len(sweep.prompts)} prompts: "
        f"{', '.join(sweep.prompts)}; defined in `mlxbun/experiments/spec_acceptance.py`), greedy, "
        f"{next(iter(sweep.runs.values())).generated_tokens} tokens per prompt. Per drafter x k the "
        "counts are summed over the prompts; tokens/s are end to end (prefill included), the median "
        "of the repeats, and plain decoding (`stream_generate`, same prompt and options) is the "
        "baseline. `same` = every prompt's greedy tokens equal plain decoding's. Timings on this",
        "shared 2-core machine move by +-20% between runs: read differences under that as noise.",
        "",
        "| drafter | k | acceptance | mean acc. length | tokens/s | plain tokens/s | speedup | same |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in df.itertuples():
        lines.append(f"| {r.drafter} | {r.k} | {_fmt(r.draft_acceptance_rate, '.3f')} | "
                     f"{_fmt(r.mean_acceptance_length, '.2f')} | {_fmt(r.tokens_per_s, '.1f')} | "
                     f"{_fmt(r.plain_tokens_per_s, '.1f')} | {_fmt(r.speedup, '.2f')} | {r.same_as_plain} |")
    lines += ["", *_reading(df), ""]
    return "\n".join(lines)


def _reading(df) -> list[str]:
    """The commentary under the table, from the numbers in it."""
    per = []
    for d, g in df.groupby("drafter", sort=False):
        best = g.loc[g.speedup.idxmax()] if g.speedup.notna().any() else g.iloc[0]
        per.append((d, g.draft_acceptance_rate.min(), g.draft_acceptance_rate.max(), best))
    slower = [d for d, _, _, b in per if not b.speedup >= 1.0]
    faster = [f"{d} (best {b.speedup:.2f}x at k={b.k})" for d, _, _, b in per if b.speedup >= 1.0]
    out = [
        "Reading it honestly: the zoo models are tiny (hidden 64, 2 layers, vocab 512) with random",
        "weights, so their text is near-random. Draft acceptance rate (range over k): "
        + "; ".join(f"{d} {lo:.0%}-{hi:.0%}" for d, lo, hi, _ in per) + ".",
        "It is high only where the draft is nearly the target (`@q8`: the target's own 8-bit",
        "quantization, a second model as expensive as the target) or where the text repeats (`ngram`",
        "on these prompts); an independent model (`@seed1`) and a shallow self-draft are almost never",
        "accepted, as expected of random weights.",
        "",
        "Speed: a tiny model's forward pass on this CPU costs about as much for k+1 tokens as for one",
        "(per-op and Python overhead dominate, not arithmetic or memory traffic), so verification is",
        "nearly free and the drafting cost decides. Slower than plain decoding at every k: "
        + (", ".join(slower) if slower else "none") + ".",
    ]
    if faster:
        out.append("Faster at some k: " + ", ".join(faster) + " -- because lookup drafting costs next to")
        out.append("nothing and the verify is overhead-bound here; on real models the balance differs.")
    out.append("These numbers measure the engine's overhead on toy models, not the technique.")
    return out


def write_cpu_benchmark(out="benchmarks/spec-cpu.md", *, model: str = "zoo:llama",
                        drafters: Sequence[str] = DEFAULT_DRAFTERS, ks: Sequence[int] = (1, 2, 3, 4, 6),
                        max_tokens: int = 32, repeats: int = 3, command: str | None = None,
                        results_path=None, record: bool = True) -> SpecSweep:
    """Run the sweep and write the Markdown benchmark table to `out`."""
    sweep = spec_sweep(model, drafters, ks, max_tokens=max_tokens, repeats=repeats, results_path=results_path,
                       record=record)
    command = command or ("python -m mlxbun.experiments.spec_acceptance " + " ".join(sys.argv[1:])).strip()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(benchmark_markdown(sweep, command))
    return sweep


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxbun.experiments.spec_acceptance",
                                description="Speculative decoding drafter x k sweep -> a Markdown benchmark table")
    p.add_argument("--out", default="benchmarks/spec-cpu.md")
    p.add_argument("--model", default="zoo:llama")
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS))
    p.add_argument("--ks", default="1,2,3,4,6")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=None, help="results table path (default: the user's)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    command = "python -m mlxbun.experiments.spec_acceptance " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        sweep = write_cpu_benchmark(args.out, model=args.model, drafters=args.drafters.split(","),
                                    ks=[int(k) for k in args.ks.split(",")], max_tokens=args.max_tokens,
                                    repeats=args.repeats, command=command.strip(), results_path=args.results,
                                    record=not args.no_record)
    except MlxbunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(sweep.summary().to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
