"""`mlxbun bench`: llama-bench-style speed tests, mlxbun vs mlx-lm on one set of weights.

    from mlxbun.bench import run_bench
    r = run_bench("random:llama-3.2-1b", quant=4, prompt_len=512, gen_len=128)
    print(r.to_markdown()); r.rows(); r.ratio("tg128"); r.bandwidth_gb_s("mlxbun")

See runner.py (what is timed and how), engines.py (how both engines share the weights),
shapes.py (the real model shapes of `random:`), report.py (rows, table, results table).
"""

from mlxbun.bench.engines import ENGINES, load_engines
from mlxbun.bench.report import BenchResult, Sample, TestResult
from mlxbun.bench.runner import BenchArgumentError, measure_copy_bandwidth, run_bench
from mlxbun.bench.shapes import SHAPES, scale_down, shape_config

__all__ = [
    "ENGINES", "SHAPES", "BenchArgumentError", "BenchResult", "Sample", "TestResult", "load_engines",
    "measure_copy_bandwidth", "run_bench", "scale_down", "shape_config",
]
