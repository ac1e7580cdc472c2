"""One zoo row (`Arch`) and the tiny sizes every row shrinks its real config to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["Arch", "HEAD_DIM", "HEADS", "HIDDEN", "INTERMEDIATE", "MAX_POSITIONS", "MINISTRAL3_KNOBS", "MOE_EXPERTS",
           "MOE_INTERMEDIATE", "MOE_TOP_K", "SLIDING_WINDOW"]

HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 512
SLIDING_WINDOW = 16  # a 40-token prompt crosses it

# MoE rows: 4 experts, 2 per token, expert width 64 (a quantization group), so a 40-token
# prompt routes 80 picks (mlx-lm's sorted-indices path) and a decode step 2 (the unsorted one)
MOE_EXPERTS, MOE_TOP_K, MOE_INTERMEDIATE = 4, 2, 64

# Ministral 3: yarn + llama-4 attention scaling, read from rope_parameters only; original
# context 32 so a 40-token prompt reaches the scaled region (real: 16384 * 16 = 262144)
MINISTRAL3_KNOBS = {"rope_parameters": {
    "rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
    "original_max_position_embeddings": 32, "max_position_embeddings": MAX_POSITIONS,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1}}


@dataclass(frozen=True)
class Arch:
    """One zoo row. `hf_config` names the transformers configuration class whose defaults are
    shrunk; without one, `base` holds the keys of a real hub config."""

    name: str  # model_type (unless `model_type` says otherwise)
    architecture: str  # config.json "architectures"[0]
    hf_config: str | None = None
    base: Mapping = field(default_factory=dict)
    layers: int = 2  # enough that every layer kind of the arch appears
    kv_heads: int | None = None  # None: 2 if the default config has GQA, else 4 (MHA)
    knobs: Mapping = field(default_factory=dict)  # config-class kwargs: rope, pattern, ...
    extra: Mapping = field(default_factory=dict)  # hub-config keys the config class lacks
    legacy_rope: bool = True  # mlx-lm reads rope_theta/rope_scaling rather than rope_parameters
    rope_type_key: str = "rope_type"  # the key real hub rope_scaling dicts use ("type" for some)
    post: Callable[[dict], None] | None = None  # last fix-ups to match real hub configs
    extra_variants: tuple[str, ...] = ()  # names.OPT_IN_VARIANTS this arch's port / manifest run
    unquantizable: bool = False  # the oracle cannot quantize it (afm7's FusedLinear): float variants only
    routed: bool = False  # the config routes through experts where its row has no MoE knobs
    # (gemma4's enable_moe_block): the variants of the MoE rows
    # the config's model_type when it is not `name`: a wrapper's second text model
    # ("mistral3-ministral3": mistral3 with a ministral3 text_config, the row's text_rows)
    model_type: str | None = None
