"""The real models against llama.cpp itself, the runtime their GGUF files were made for.

    make oracle     # builds llama-cpp-python from source into .venv (about 9 minutes on 2 cores)
    .venv/bin/python benchmarks/llama_cpp_reference.py

For each real model (SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M, Qwen2.5-Coder-0.5B-Instruct
Q5_0/Q8_0/Q4_K/Q6_K, Qwen2.5-Coder-1.5B-Instruct Q4_K_M) this runs llama.cpp on the GGUF file and
mlxbun on its float32 import (`mlxbun import gguf --quant none`: every tensor's value as gguf-py
dequantizes it, which the packed import holds bit for bit; dense matmuls, minutes faster on this
CPU than MLX's quantized ones), on the same token ids:

- the evaluation text (benchmarks/texts/alice-ch1-2.txt, tokenized by llama.cpp itself): every
  position's logits, compared with llama.cpp's `--kl-divergence` statistics (mean / 99.9 % KLD,
  top-1 agreement, PPL ratio): `benchmarks/real-models.md`, section "mlxbun vs llama.cpp";
- a few fixed prompts (the coder models also two code prompts): llama.cpp's greedy continuations.

It writes what llama.cpp said to `goldens/real-<model>-llamacpp.json` (the text's ids, llama.cpp's
top-1 id at every position, the greedy continuations), which `tests/test_real_models.py` holds
mlxbun's tokenizer and forward to without needing llama.cpp installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.conftest.real_gguf finds the real models' files

from mlxbun.factory import open_model  # noqa: E402
from mlxbun.gguf.importer import cached_import  # noqa: E402
from mlxbun.parity.metrics import compare_logits  # noqa: E402
from tests.conftest import real_gguf  # noqa: E402

TEXT = ROOT / "benchmarks" / "texts" / "alice-ch1-2.txt"
N_TEXT = 1024  # positions scored (a 1024-token window: both models' logits for all of it fit memory)
PROMPTS = ["The capital of France is", "The Eiffel Tower is located in the city of",
           "def fibonacci(n):\n    ", "Water boils at a temperature of"]
CODE_PROMPTS = ["# Python: return the sum of the squares of a list of numbers\ndef sum_of_squares(xs):\n",
                "// JavaScript: reverse a string\nfunction reverse(s) {\n  return"]
CODER = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
MODELS = ("smollm2", "gemma3", *CODER)
GREEDY = 16


def _llama(path: Path):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, logits_all=True, verbose=False, n_threads=2)


def _llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def _greedy(llm, ids: list[int]) -> list[int]:
    out = []
    llm.reset()
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) == GREEDY or tok == llm.token_eos():
            break
    return out


def measure(name: str, tmp: Path) -> tuple[dict, object]:
    """(the golden of llama.cpp's outputs, mlxbun-vs-llama.cpp statistics) for one real model."""
    gguf = real_gguf(name, _Factory(tmp))
    llm = _llama(gguf)
    ids = llm.tokenize(TEXT.read_text().encode(), add_bos=True)[:N_TEXT]
    theirs = _llama_logits(llm, ids)
    model = open_model(cached_import(gguf, root=tmp / "imports", quant="none"))
    ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    del model
    stats = compare_logits(theirs[:-1], ours[:-1], ids[1:])  # position i predicts ids[i + 1]
    golden = {
        "schema": "mlxbun-llamacpp-reference/1",
        "model": name, "gguf": gguf.name, "llama_cpp_python": __import__("llama_cpp").__version__,
        "text": TEXT.name, "text_ids": ids, "top1": [int(i) for i in theirs.argmax(-1)],
        "prompts": [{"text": p, "ids": (pi := llm.tokenize(p.encode(), add_bos=True)), "greedy": _greedy(llm, pi)}
                    for p in PROMPTS + (CODE_PROMPTS if name in CODER else [])],
    }
    return golden, stats


class _Factory:
    """The bit of pytest's tmp_path_factory that real_gguf uses (where Gemma's chunks assemble)."""

    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _row(name: str, s) -> str:
    return (f"| {name} | {s.count} | {s.kld_mean:.5f} | {s.kld_percentiles['99.9']:.4f} | {s.kld_max:.4f} | "
            f"{100 * s.same_top_p:.2f} % | {s.ppl_ratio:.4f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(ROOT / ".oracle-work"), help="where imports and assembled files go")
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in args.models.split(","):
        golden, stats = measure(name, work)
        (ROOT / "goldens" / f"real-{name}-llamacpp.json").write_text(json.dumps(golden, indent=1) + "\n")
        lines.append(_row(name, stats))
        print(lines[-1])
    table = "\n".join([
        "| model | positions | mean KLD | 99.9 % KLD | max KLD | same top-1 | PPL(mlxbun) / PPL(llama.cpp) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", *lines])
    (work / "llama-cpp-table.md").write_text(
        f"llama-cpp-python {__import__('llama_cpp').__version__}, mlx {mx.__version__}, "
        f"{platform.machine()}\n\n{table}\n")
    print(f"table: {work / 'llama-cpp-table.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
