"""Block-diffusion decoding (DiffusionGemma), held token-for-token to mlx-vlm 0.7.10.

    from mlxbun.diffusion import diffusion_generate, collect
    ids, stats = collect(diffusion_generate(model, tokenizer, "Hello", max_tokens=64, seed=0))

`masked` is the LLaDA-style mask-token loop (`masked_diffusion_generate`), held to mlx-vlm's
llada2 loop and mlx-optiq's. `engine` is the block loop, `samplers` the canvas draws and unmasking rules, `schedule` the
temperature schedule and settings resolution, `stats` what a run did (NFE, reveal steps).
"""

from mlxbun.diffusion.masked import (
    DiffusionArgumentError,
    MaskedBlockResponse,
    MaskedDiffusionStats,
    masked_diffusion,
    masked_diffusion_generate,
    transfer_floors,
)
from mlxbun.diffusion.engine import DiffusionBlock, StepEvent, collect, diffusion_generate, stop_token_ids
from mlxbun.diffusion.schedule import SAMPLERS, DiffusionSettings, linear_temperature, resolve_settings
from mlxbun.diffusion.stats import BlockStats, DiffusionStats, reveal_steps

__all__ = [
    "SAMPLERS",
    "DiffusionArgumentError",
    "MaskedBlockResponse",
    "MaskedDiffusionStats",
    "masked_diffusion",
    "masked_diffusion_generate",
    "transfer_floors",
    "BlockStats",
    "DiffusionBlock",
    "DiffusionSettings",
    "DiffusionStats",
    "StepEvent",
    "collect",
    "diffusion_generate",
    "linear_temperature",
    "resolve_settings",
    "reveal_steps",
    "stop_token_ids",
]
