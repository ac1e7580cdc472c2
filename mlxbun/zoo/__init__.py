"""The tiny checkpoint zoo: for every supported arch, a tiny checkpoint in real Hugging Face
layout (shrunk real config, sharded mlx-lm-named safetensors, a real BPE tokenizer), built
locally and deterministically, in float32/float16/bfloat16 and 4/8-bit/mixed quantizations.

    make_checkpoint("qwen3", out_dir, quant=4)      # -> out_dir/tiny-qwen3-q4
    cached_checkpoint("gemma3_text")                # built once per cache root
    tiny_config("llama")                            # the config.json dict
"""

from mlxbun.zoo.archs import ARCHS, tiny_config
from mlxbun.zoo.build import DTYPES, QUANTS, ZooArgumentError, make_checkpoint
from mlxbun.zoo.cache import cached_checkpoint

__all__ = [
    "ARCHS",
    "DTYPES",
    "QUANTS",
    "ZooArgumentError",
    "cached_checkpoint",
    "make_checkpoint",
    "tiny_config",
]
