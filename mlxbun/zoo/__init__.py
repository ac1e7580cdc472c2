"""The tiny checkpoint zoo: for every supported arch, a tiny checkpoint in real Hugging Face
layout (shrunk real config, sharded safetensors, a real BPE tokenizer), built locally and
deterministically, in float32/float16/bfloat16 and 4/8-bit/mixed quantizations.

    make_checkpoint("qwen3", out_dir, quant=4)      # -> out_dir/tiny-qwen3-q4
    cached_checkpoint("gemma3_text")                # built once per cache root
    tiny_config("llama")                            # the config.json dict
    cached_checkpoint("diffusion_gemma")            # graphs held to mlx-vlm have their own builders
    cached_checkpoint("gemma3-vision", quant=8)     # a VLM with its towers (zoo.towers; zoo:gemma3-vision@q8)

Modules: common (shared helpers, imports no other zoo module), archs (the dense arch table),
build / diffusion / llada / towers (the builders), registry (builders by arch, the entry points),
weights, tokenizer, hfcache.
"""

from mlxbun.zoo.archs import ARCHS, tiny_config
from mlxbun.zoo.build import check_head_dim
from mlxbun.zoo.common import DTYPES, QUANTS, ZooArgumentError
from mlxbun.zoo.diffusion import cached_diffusion_checkpoint, make_diffusion_checkpoint
from mlxbun.zoo.llada import cached_llada2_checkpoint, make_llada2_checkpoint
from mlxbun.zoo.registry import (BUILDERS, ORACLE_VLM_ARCHS, TOWER_ZOO_ARCHS, cached_checkpoint, check_build,
                                  make_checkpoint)

__all__ = [
    "ARCHS",
    "BUILDERS",
    "ORACLE_VLM_ARCHS",
    "TOWER_ZOO_ARCHS",
    "cached_diffusion_checkpoint",
    "cached_llada2_checkpoint",
    "make_diffusion_checkpoint",
    "make_llada2_checkpoint",
    "DTYPES",
    "QUANTS",
    "ZooArgumentError",
    "cached_checkpoint",
    "check_build",
    "check_head_dim",
    "make_checkpoint",
    "tiny_config",
]
